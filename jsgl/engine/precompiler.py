"""Step shapes compiled before the requests that need them: all at start (``precompile`` common or all, what
`jsgl serve` does), or in a background thread while the engine already serves (``background``, the in-process
engine's default).

In the background the planned shapes (``ModelRunner.planned_signatures``) are compiled in the order a first
workload meets them: by requests per step, then tokens (decode at batch 1, 2, 4, 8, then the 8-request extends a
first prompt needs, ...), each batch bucket's sampler beside its first shape; and only while the engine is idle,
as compiling beside a running step slows both (docs/performance.md). The engine thread never waits for the plan:
a step whose shape the background has not reached is compiled at once on the request path (and the background
skips it); one the background is compiling waits for that one alone. An executable's first run pays one-time
costs, so small ones are run on padding: at start right away, and those compiled in the background by the engine
thread when it is idle (a padding run donates the KV pool, which only that thread may touch).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jsgl.engine.model_runner import ModelRunner

log = logging.getLogger("jsgl.engine.precompiler")

# Precompiled shapes of at most this many tokens are also run once on padding (cheap: decode, short extends).
WARM_RUN_MAX_TOKENS = 64
ORIGINS = ("start", "background", "request")
BACKGROUND_THREAD = "jsgl-precompile"


class StepCompiler:
    """A runner's compiled step executables by signature (tokens, requests, new per request, attended, prompt
    top-k), and where each was compiled: at start, in the background, or on the request path (``counts``)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.executables: dict[tuple, Any] = {}
        self.counts = dict.fromkeys(ORIGINS, 0)
        self.unplanned = 0  # request-path signatures outside a plan (none planned: precompile off)
        self.background_s: float | None = None  # the background's seconds, once it is done
        self._planned: set[tuple] = set()
        self._seen: set[tuple] = set()  # every signature compiled, jit's own included
        self._compiling: dict[tuple, threading.Event] = {}
        self._lock = threading.Lock()
        self._unwarmed: deque[tuple] = deque()  # compiled in the background, padding run still to do
        self._samplers: set[int] = set()  # batch buckets whose sampler is compiled
        self._sampler_buckets: set[int] = set()  # those the plan's steps can have
        self._stop = threading.Event()
        self._engine_idle = threading.Event()
        self._engine_idle.set()  # until the engine's first step
        self._thread: threading.Thread | None = None

    @property
    def compiles(self) -> int:
        return len(self._seen)

    # ----------------------------------------------------------------------------------- the plan
    def compile_all(self, plan: list[tuple]) -> None:
        """Compile ``plan`` now, with each batch bucket's sampler, and run the small executables on padding."""
        self._adopt(plan)
        for signature in order(plan):
            if self._claim(signature):
                self._build(signature, "start")
                if signature[0] <= WARM_RUN_MAX_TOKENS:
                    self.runner.run_padding(signature, self.executables[signature])
            self._warm_samplers(upto=signature[1])
        self._warm_samplers()

    def start_background(self, plan: list[tuple], then: Callable[[], None] | None = None) -> None:
        """Compile ``plan`` in a thread, then call ``then`` (more start-up work for the same thread)."""
        self._adopt(plan)
        self._thread = threading.Thread(target=self._background, args=(plan, then), name=BACKGROUND_THREAD,
                                        daemon=True)
        self._thread.start()

    def _adopt(self, plan: list[tuple]) -> None:
        """Take ``plan`` as planned, with the sampler's batch buckets its steps can have (also an extend's for each
        decode batch: a padded-attention plan leaves extends to first use)."""
        self._planned.update(plan)
        decode_counts = {signature[1] for signature in plan if signature[2] == 1}
        self._sampler_buckets |= {signature[1] for signature in plan} | {
            self.runner.step_shape(n, n, 1, 1, False)[1] for n in decode_counts}

    def _background(self, plan: list[tuple], then: Callable[[], None] | None) -> None:
        started = time.perf_counter()
        try:
            for signature in order(plan):
                if not self._when_idle():
                    return
                if self._claim(signature):
                    try:
                        self._build(signature, "background")
                    except Exception:  # the request path meets it again, as one request's error
                        log.exception("background precompile of %s failed", signature)
                        continue
                    if signature[0] <= WARM_RUN_MAX_TOKENS:
                        self._unwarmed.append(signature)
                if self._stop.is_set():  # (a sampler compile is one more wait for a shutdown)
                    return
                self._warm_samplers(upto=signature[1])
            if not self._when_idle():
                return
            self._warm_samplers()
            if then is not None and self._when_idle():
                then()
        finally:
            self.background_s = time.perf_counter() - started
            log.info("compiled %d step shapes in the background in %.1f s (%d more on the request path)",
                     self.counts["background"], self.background_s, self.counts["request"])

    def _when_idle(self) -> bool:
        """Wait until the engine is idle; False once stopped."""
        while not self._engine_idle.wait(0.5):
            if self._stop.is_set():
                return False
        return not self._stop.is_set()

    def engine_busy(self, busy: bool) -> None:
        """The engine thread says whether it is stepping (the background pauses meanwhile)."""
        if busy == self._engine_idle.is_set():
            (self._engine_idle.clear if busy else self._engine_idle.set)()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the background is done (True), or ``timeout`` seconds (False); True without one. The background
        runs only while the engine is idle."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the background after the shape it is compiling."""
        self._stop.set()
        self.wait(timeout)

    # ------------------------------------------------------------------------- the engine thread
    def executable(self, signature: tuple) -> Any:
        """The compiled step for ``signature``, or None where it is not planned (jit compiles it, ``count_jit``).
        A planned one not compiled yet is compiled here, or awaited where the background is compiling it."""
        compiled = self.executables.get(signature)
        if compiled is not None or signature not in self._planned:
            return compiled
        while True:
            with self._lock:
                compiled = self.executables.get(signature)
                if compiled is not None or signature not in self._planned:
                    return compiled
                in_progress = self._compiling.get(signature)
            if in_progress is not None:
                in_progress.wait()
            elif self._claim(signature):
                return self._build(signature, "request")

    def count_jit(self, signature: tuple) -> None:
        """A signature jit compiles on the request path (the first time it is met)."""
        if signature in self._seen:
            return
        with self._lock:
            self._seen.add(signature)
            self.counts["request"] += 1
            if self._planned:
                self.unplanned += 1
                log.info("compiling a step shape precompile did not cover: (tokens, requests, new per request, "
                         "attended, prompt top-k) = %s", signature)

    def warm_next(self) -> bool:
        """Run one executable the background compiled on padding (when the engine is idle); False if none is left."""
        if not self._unwarmed:
            return False
        signature = self._unwarmed.popleft()
        self.runner.run_padding(signature, self.executables[signature])
        return True

    # ---------------------------------------------------------------------------------- building
    def _claim(self, signature: tuple) -> bool:
        """Take ``signature`` to compile: False if it is compiled or being compiled."""
        with self._lock:
            if signature in self.executables or signature in self._compiling:
                return False
            self._compiling[signature] = threading.Event()
            return True

    def _build(self, signature: tuple, origin: str) -> Any:
        try:
            compiled = self.runner.compile_step(signature)
        except BaseException:
            with self._lock:  # left to jit, which raises on the request path as that request's error
                self._planned.discard(signature)
                self._compiling.pop(signature).set()
            raise
        with self._lock:
            self.executables[signature] = compiled
            self._seen.add(signature)
            self.counts[origin] += 1
            self._compiling.pop(signature).set()
        return compiled

    def _warm_samplers(self, upto: int | None = None) -> None:
        """Compile and run the sampler at every planned batch bucket up to ``upto`` not done yet."""
        if not self.executables:
            return
        # The logits' placement is part of jit's dispatch key: the sampler runs on zeros placed as every step's
        # logits are (committed; sharded over the vocabulary under tensor parallelism), or serving re-lowers it.
        logits = next(iter(self.executables.values())).out_info[1]["logits"]  # shape [B, V], dtype, placement
        for num_b in sorted(b for b in self._sampler_buckets - self._samplers if upto is None or b <= upto):
            self._samplers.add(num_b)
            self.runner.run_sampler(num_b, logits)


def compile_plan(runner: ModelRunner, plan: list[tuple]) -> None:
    """``compile_all(plan)`` before the first request. A stored executable that does not run (XLA's serialization has
    had gaps) drops the executable store, and the plan compiles afresh through a new compiler on intact pools."""
    try:
        runner.compiler.compile_all(plan)
    except Exception:
        if runner.store is None or not runner.store.loaded:
            raise
        log.exception("a stored step executable failed to run; removing %s and compiling", runner.store.directory)
        runner.store.forget()
        # Not the old compiler: it holds the executables loaded from the store, the one that failed among them.
        runner.store, runner.compiler = None, StepCompiler(runner)
        if not runner.kv_intact():
            runner.reset_kv()
        runner.compiler.compile_all(plan)


def order(plan: list[tuple]) -> list[tuple]:
    """The order a first workload meets shapes: fewer requests first, then fewer tokens, then shorter context."""
    return sorted(plan, key=lambda signature: (signature[1], signature[0], signature[3], signature[4]))

