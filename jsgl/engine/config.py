"""Engine options (also the CLI's flags): memory, batching, caching and ablation switches."""

from __future__ import annotations

import dataclasses
import os

from jsgl.errors import ConfigError

PRECOMPILE_MODES = ("background", "common", "all", "off")
# The fields that take one of a few names (the command's flags offer the same choices).
CHOICES = {"device": ("auto", "cpu", "gpu", "tpu"), "grammar_backend": ("jsgl", "llguidance"),
           "precompile": PRECOMPILE_MODES, "executable_store": ("auto", "on", "off"),
           "weights_cache": ("auto", "orbax", "off"), "prefix_cache": ("radix", "flat", "none"),
           "speculative_algorithm": ("none", "ngram")}


@dataclasses.dataclass
class EngineConfig:
    model: str = "smollm2-135m"
    # auto: whatever JAX's default backend is; cpu | gpu | tpu: that, or an error (jsgl.engine.platform)
    device: str = "auto"
    # Memory budget of the KV pool (K and V of all layers, in the KV dtype). None: 1 GiB on CPU; on a GPU/TPU the
    # pool is sized from mem_fraction instead.
    kv_cache_gb: float | None = None
    num_kv_slots: int | None = None  # overrides kv_cache_gb when set
    # Fraction of the device's memory for weights + KV pool (SGLang's mem_fraction_static); when set, the
    # pool is what is left after weights and activations (jsgl.engine.memory), instead of kv_cache_gb.
    # None: 0.85 on a GPU/TPU unless kv_cache_gb or num_kv_slots is given; unused on CPU.
    mem_fraction: float | None = None
    page_size: int | None = None  # None: 1 on CPU (token-granular, as in the paper), 16 on a GPU/TPU
    max_running_requests: int = 64
    chunked_prefill_size: int = 512  # new prompt tokens per extend step
    # While requests decode, prefill steps (whose chunks shrink as a prompt's context grows) take at most this
    # share of the engine's time: a long prompt cannot stall them. 1: prefill and decode steps alternate.
    prefill_share: float = 0.5
    # Mixed steps: while requests decode, each step carries their tokens and at most this much prefill (in tokens
    # at short context, fewer as a prompt's context grows). 0: off. None: the platform's (jsgl.engine.platform):
    # on a GPU/TPU the chunk's budget less max_running_requests (at least half the chunk); off on CPU, where they
    # save nothing measurable (docs/performance.md).
    mixed_prefill_tokens: int | None = None
    context_length: int | None = None  # defaults to the model's
    attention_backend: str = "auto"  # auto | native | pallas | tpu | cpu
    # The layers as one lax.scan (one layer compiled: compile time that does not grow with depth) or unrolled:
    # auto = scanned on a TPU; unrolled on CPU (faster there, and what the CPU kernels need) and on a GPU, until a
    # scanned step's speed is measured there (docs/performance.md).
    layers: str = "auto"  # auto | scanned | unrolled
    # Weights and activations (matmuls accumulate in float32), and the KV pool: auto = float32 on CPU,
    # bfloat16 on GPU/TPU; kv auto follows dtype (jsgl.engine.memory.resolve_dtypes). KV int8: the 8-bit format,
    # int8 values with a scale per token and head (jsgl.kernels.kv_quant), ~3.8x float32's slots.
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    kv_dtype: str = "auto"  # auto | bfloat16 | float16 | float32 | int8
    matmul_backend: str = "auto"  # auto | xla | packed | gguf (kernels of jsgl.kernels.cpu; gguf: Q4_1/Q8_0 blocks)
    attention_budget_gb: float = 0.5  # bound on an extend step's padded attention scores
    prefix_cache: str = "radix"  # radix | flat | none
    # Fig. 8(a)(b): use only this fraction of each radix prefix match (the rest is recomputed), which sets
    # a workload's cache hit rate (SequenceKV.match_fraction). 1.0: the whole match.
    cache_match_fraction: float = 1.0
    schedule_policy: str = "lpm"  # lpm | dfs-weight | fcfs | lof | random
    starvation_s: float | None = 30.0  # waiting longer than this goes first, whatever the priorities
    # Request priorities (SGLang's --enable-priority-scheduling): higher first, preempting lower ones. Off (SGLang's
    # default), a request's `priority` is validated but ignored: every request counts as 0.
    enable_priority_scheduling: bool = False
    jump_forward: bool = True  # compressed-FSM jump-forward for regex/json_schema requests
    # Constrained decoding: jsgl's compressed FSM (regex, JSON schema; jump-forward) or llguidance (also
    # SGLang's `ebnf` grammars and schemas our regex conversion does not cover).
    grammar_backend: str = "jsgl"  # jsgl | llguidance
    # Compile the step shapes this configuration can produce (ModelRunner.planned_signatures; engine/precompiler.py):
    # background (common's, in a thread while the engine serves: a step waits only for its own shape) | common
    # (generation: decode and extend buckets, before the engine starts) | all (also prompt-logprob extends) | off.
    precompile: str = "background"
    # Compiled step executables saved on disk and loaded on the next start (engine/executable_store.py): auto (one
    # process, unless JSGL_EXECUTABLE_STORE=off: the test suite's engines) | on | off. With ``background``, the
    # stored shapes load at start (~0.1 s each) and the rest compile in the background.
    executable_store: str = "auto"
    # Overlap scheduling (SGLang's, on by default there too): while a decode step runs, the next decode step of
    # the same requests is dispatched with the running step's tokens as its inputs, still on device; the host
    # reads, detokenizes and schedules meanwhile. Off: each step is read back before the next is built. On CPU,
    # where the step runs on the host's cores, only decode batches of up to 8 overlap (overlap.CPU_OVERLAP_MAX_BATCH).
    overlap_schedule: bool = True
    # Speculative decoding (SGLang's flags; engine/speculative.py): ngram proposes each running request's next
    # tokens from the prefix cache's continuation of its tokens, else from its own earlier text (prompt lookup), cut
    # by its grammar, and verifies them in one decode step with its jump-forward tokens. none: off.
    speculative_algorithm: str = "none"
    speculative_num_draft_tokens: int = 4  # most draft tokens per request and step
    speculative_ngram_min_match_window_size: int = 1  # the n-gram lengths matched, longest first
    speculative_ngram_max_match_window_size: int = 4
    # Decode batches of more requests than this get no drafts (their verify rows cost more than they save); None: the
    # platform's (speculative.DEFAULT_MAX_BATCH).
    speculative_max_batch: int | None = None
    seed: int = 0  # seeds requests that do not bring their own
    # Tensor-parallel degree: jax.sharding over local devices, or with nnodes > 1 over every process's devices
    # (tp = devices per node x nnodes; docs/serving.md, multi-host).
    tp: int = 1
    # One engine over several processes (SGLang's names): rank 0's address and a free port, where the processes
    # meet (jax.distributed); the number of processes; this one's rank (0 serves, the others follow its steps).
    dist_init_addr: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    # Seconds to wait for the other processes to join, and after which a silent one counts as dead (jax's
    # coordination service then ends every process with that reason).
    dist_timeout: int = 60
    # The params as placed (dtype, tp padding and shards), saved as an orbax checkpoint and restored onto the
    # devices on the next start: auto (GGUF models: their converted weights) | orbax (also HF folders) | off.
    weights_cache: str = "auto"
    # Per-request limits (one request must not slow or break the others; cf. vLLM's --max-logprobs).
    max_top_logprobs: int = 20  # top_logprobs_num; each costs a [tokens, k] top-k and k triples per token
    max_stop_sequences: int = 32  # stop strings are scanned on every token of the request
    max_stop_chars: int = 256  # length of one stop string
    constraint_timeout_s: float = 60.0  # a regex/schema index not built by then fails its request (400)

    @property
    def uses_executable_store(self) -> bool:
        """``executable_store`` resolved: auto is on in one process unless JSGL_EXECUTABLE_STORE=off."""
        if self.nnodes > 1 or self.executable_store == "off":
            return False
        return self.executable_store == "on" or os.environ.get("JSGL_EXECUTABLE_STORE") != "off"

    def __post_init__(self) -> None:
        self.speculative_algorithm = self.speculative_algorithm.lower()  # SGLang spells it NGRAM
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}, not {getattr(self, name)!r}")
        self._check_ranges()
        if self.cache_match_fraction < 1.0 and self.prefix_cache != "radix":
            raise ConfigError("cache_match_fraction < 1 needs prefix_cache radix")
        if self.speculative_ngram_min_match_window_size > self.speculative_ngram_max_match_window_size:
            raise ConfigError(f"speculative_ngram_min_match_window_size {self.speculative_ngram_min_match_window_size}"
                              " is larger than speculative_ngram_max_match_window_size "
                              f"{self.speculative_ngram_max_match_window_size}")
        if self.node_rank >= self.nnodes:
            raise ConfigError(f"node_rank must be below nnodes ({self.nnodes}), not {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ConfigError("nnodes > 1 needs dist_init_addr HOST:PORT (rank 0's address and a free port)")

    def _check_ranges(self) -> None:
        """Each number outside its range, named with its value (the command's flag: ``--`` and the name with
        dashes)."""
        at_least = {"page_size": 1, "max_running_requests": 1, "chunked_prefill_size": 16, "mixed_prefill_tokens": 0,
                    "speculative_num_draft_tokens": 1, "speculative_max_batch": 1,
                    "speculative_ngram_min_match_window_size": 1, "nnodes": 1, "node_rank": 0, "dist_timeout": 1,
                    "max_top_logprobs": 0, "max_stop_sequences": 0, "max_stop_chars": 0}
        for name, least in at_least.items():
            value = getattr(self, name)
            if value is not None and value < least:  # None: the platform's default
                raise ConfigError(f"{name} must be at least {least}, not {value}")
        if not 0 < self.prefill_share <= 1:
            raise ConfigError(f"prefill_share must be in (0, 1], not {self.prefill_share}")
        if not 0.0 <= self.cache_match_fraction <= 1.0:
            raise ConfigError(f"cache_match_fraction must be within [0, 1], not {self.cache_match_fraction}")
        if self.constraint_timeout_s <= 0:
            raise ConfigError(f"constraint_timeout_s must be positive, not {self.constraint_timeout_s}")
