"""Process-wide switches of the frontend (the default backend and the ablation knobs of paper Fig. 8c)."""

from __future__ import annotations

from typing import Any


class GlobalConfig:
    """Mutable settings read by the interpreter at run time (so a benchmark can flip them between runs)."""

    def __init__(self) -> None:
        # Where `fn.run()` sends requests when no backend= is given (see `set_default_backend`).
        self.default_backend: Any = None
        # Frontend hints: send the common prefix once (a max_new_tokens=0 request) before forking, before a
        # batch run, and before scoring the choices of a select, so the branches hit the radix cache instead
        # of each prefilling the prefix. Off = "No Frontend Hint" in the paper's ablation.
        self.enable_prefix_hint: bool = True
        # A batch-level prefix shorter than this is not worth an extra request.
        self.prefix_hint_min_chars: int = 32
        # Frontend parallelism: each state has its own executor thread, so `gen` does not block the
        # program, fork branches and batch items run concurrently and the engine batches them. Off = each
        # state runs inline in the caller's thread, one call after another.
        self.enable_parallelism: bool = True
        # Threads for run_batch(num_threads="auto").
        self.batch_threads_auto: int = 64
        # 0: quiet; 1: warn on program errors; 2: also print each finished program's text.
        self.verbosity: int = 1

        # SGLang's names. Output text: the engine's skip_special_tokens / spaces_between_special_tokens for
        # every gen that does not set them.
        self.skip_special_tokens_in_output: bool = True
        self.spaces_between_special_tokens_in_out: bool = True
        # run_batch's prefix hint (the traced constant prefix, sent once); needs enable_prefix_hint too.
        self.enable_precache_with_tracing: bool = True
        # join(mode="concate_and_append") through a backend that splices KV (support_concate_and_append).
        # No jsgl backend does (each concatenates text, and the radix cache reuses the prefix), so it is
        # read only for a third-party backend that sets the flag.
        self.enable_parallel_encoding: bool = True


global_config = GlobalConfig()
