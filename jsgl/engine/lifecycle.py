"""An engine's threads, stopped once: by ``Engine.shutdown()``, when the engine is garbage-collected, or at
interpreter exit.

At exit the interpreter freezes daemon threads where they stand; one inside XLA (a background compile, a step)
is unwound through C++ that swallows the unwinding, and the process aborts (``FATAL: exception not rethrown``,
status 134). And jax's own exit hook clears its caches and backends under a compile still tracing. So each engine
registers its stop with ``atexit`` once its backend is up (after jax's hook: hooks run last registered first), and
as a ``weakref.finalize`` for collection; both hold only the engine's parts, never the engine.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import TYPE_CHECKING, Any

from jsgl.engine import multihost

if TYPE_CHECKING:
    from jsgl.engine.engine_loop import EngineLoop
    from jsgl.engine.mailbox import Mailbox
    from jsgl.engine.model_runner import ModelRunner

log = logging.getLogger("jsgl.engine")

LOOP_JOIN_S = 30.0  # the engine thread ends after the step under way (a step is well under a second on CPU)
# An XLA compile cannot be cancelled: at exit the background waits for the one under way (seconds on CPU).
COMPILE_JOIN_S = 600.0


class EngineThreads:
    """What runs beside the caller: the engine thread (rank 0), the background precompile, and the step channel
    to the other ranks of a multi-process engine."""

    def __init__(self, runner: ModelRunner, mailbox: Mailbox, loop: EngineLoop, follower: bool):
        self.runner, self.mailbox, self.loop, self.follower = runner, mailbox, loop, follower

    def stop(self) -> None:
        """Stop the background compile (after the shape under way), then the engine thread (after its step: the
        requests still queued or running end as aborted), then release the other ranks."""
        compiler = self.runner.compiler  # (the store's fallback may have replaced the one that started)
        compiler.stop(COMPILE_JOIN_S)
        if self.follower:
            return
        self.mailbox.stop()
        if self.loop.started():
            self.loop.join(timeout=LOOP_JOIN_S)
            if self.loop.is_alive():
                log.warning("the engine thread did not stop within %.0f s", LOOP_JOIN_S)
        channel = self.runner.channel
        if channel is not None and not self.loop.is_alive():  # the loop's last step is done: release the others
            channel.send_control(multihost.STOP)
            self.runner.channel = None


def stop_when_unused(owner: Any, threads: EngineThreads) -> weakref.finalize:
    """Stop ``threads`` when ``owner`` is collected or the interpreter exits, whichever is first; calling the
    result stops them now (once: later calls do nothing, and a called finalizer holds nothing of the engine)."""
    finalizer = weakref.finalize(owner, threads.stop)
    finalizer.atexit = False  # (weakref's own exit hook may be older than jax's, and so run after it)
    atexit.register(finalizer)
    return finalizer
