"""The constraint build queue: cheapest first, a fast lane for small builds, a cap, cancellation.

Two heavy workers (the host has 2 cores and also runs the engine loop) take the pending build with
the lowest static cost (`static_check`: a `(yes|no)` is 5, a nested JSON schema ~1 K). A third,
fast-lane worker takes only builds whose cost is at most CHEAP_COST, so a fresh small regex never
waits behind heavy builds that already occupy both heavy workers. The static cost can be wrong
(`(a|b)*a(a|b){14}` costs 33 but has 32 K states), so a fast-lane build that used more than
CHEAP_SECONDS of CPU is preempted and re-queued for the heavy workers, at a cost above CHEAP_COST.
(Each worker builds in a child process of its own: build_process.)

A Future is never marked running, so `Future.cancel()` works at any time: `BuildJob.cancel` cancels
it (waiters get concurrent.futures.CancelledError at once), drops the job if it has not started,
and otherwise sets the flag the running build polls (BuildGuard.check), so the CPU is free again
within milliseconds.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

from jsgl.errors import OverloadedError
from jsgl.fsm.budget import BuildBudget, BuildGuard, BuildPreempted

log = logging.getLogger(__name__)

HEAVY_WORKERS = 2
CHEAP_COST = 200  # static cost of a build the fast lane takes (measured: cost 70 -> 0.3 s, 1 K -> 1.5 s)
CHEAP_SECONDS = 1.0  # CPU seconds: a fast-lane build using more was misjudged; re-queue it as heavy

_seq = itertools.count()


class BuildJob:
    """One build: `build(guard)` runs on a worker; its result or exception resolves `future`."""

    def __init__(self, cost: int, budget: BuildBudget, build: Callable[[BuildGuard], object]) -> None:
        self.cost = cost
        self.order = next(_seq)  # FIFO among equal costs
        self.budget = budget
        self.build = build
        self.future: Future = Future()
        self.cancelled = threading.Event()
        self.queue: BuildQueue | None = None

    def __lt__(self, other: BuildJob) -> bool:
        return (self.cost, self.order) < (other.cost, other.order)

    def cancel(self) -> None:
        """Nobody needs the result any more: resolve the future as cancelled and stop the build."""
        self.cancelled.set()
        self.future.cancel()
        if self.queue is not None:
            self.queue.forget(self)

    def run(self, preempt_after: float | None = None) -> bool:
        """Run the build (see BuildGuard for the arguments); False when it was preempted (the
        caller re-queues it)."""
        if self.cancelled.is_set():
            return True
        guard = BuildGuard(self.budget, self.cancelled, preempt_after)
        try:
            result = self.build(guard)
        except BuildPreempted:
            return False
        except BaseException as e:  # the request's error (budget, invalid regex) or a bug: the caller's to see
            _settle(self.future, exception=e)
        else:
            _settle(self.future, result=result)
        return True


def _settle(future: Future, result: object = None, exception: BaseException | None = None) -> None:
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled meanwhile: nobody is waiting
        pass


class BuildQueue:
    def __init__(self, heavy_workers: int = HEAVY_WORKERS, cheap_cost: int = CHEAP_COST,
                 cheap_seconds: float = CHEAP_SECONDS, on_worker_start: Callable[[], object] | None = None) -> None:
        self.on_worker_start = on_worker_start  # e.g. boot the worker's build process ahead of its first job
        self.cheap_cost = cheap_cost
        self.cheap_seconds = cheap_seconds
        self._heap: list[BuildJob] = []
        self._pending = 0  # jobs in the heap that are not cancelled
        self._running = 0
        self._cond = threading.Condition()
        self._threads = [threading.Thread(target=self._work, args=(False,), name=f"jsgl-fsm-{i}", daemon=True)
                         for i in range(heavy_workers)]
        self._threads.append(threading.Thread(target=self._work, args=(True,), name="jsgl-fsm-fast", daemon=True))
        for t in self._threads:
            t.start()

    def submit(self, job: BuildJob) -> None:
        """Queue `job`. Raises OverloadedError when job.budget.max_queued builds are already waiting."""
        with self._cond:
            if self._pending >= job.budget.max_queued:
                raise OverloadedError(
                    f"{self._pending} constraint builds are already queued (the server's limit); retry later")
            self._push(job)

    def stats(self) -> dict[str, int]:
        """Builds waiting for a worker, and builds running (cancelled ones until they notice)."""
        with self._cond:
            return {"queued": self._pending, "running": self._running}

    def forget(self, job: BuildJob) -> None:
        """A cancelled job stops counting against the cap; its heap entry is skipped when reached."""
        with self._cond:
            if job.queue is self:
                job.queue = None
                self._pending -= 1

    def _push(self, job: BuildJob) -> None:
        job.queue = self
        self._pending += 1
        heapq.heappush(self._heap, job)
        self._cond.notify_all()

    def _take(self, fast_lane: bool) -> BuildJob:
        with self._cond:
            while True:
                while self._heap and self._heap[0].cancelled.is_set():
                    heapq.heappop(self._heap)  # already forgotten
                if self._heap and (not fast_lane or self._heap[0].cost <= self.cheap_cost):
                    job = heapq.heappop(self._heap)
                    job.queue = None
                    self._pending -= 1
                    self._running += 1
                    return job
                self._cond.wait()

    def _work(self, fast_lane: bool) -> None:
        if self.on_worker_start is not None:
            try:
                self.on_worker_start()
            except Exception:  # the first job will try again, and fail with its own error
                log.exception("constraint build worker failed to start")
        while True:
            job = self._take(fast_lane)
            try:
                done = job.run(preempt_after=self.cheap_seconds if fast_lane else None)
            except BaseException as e:  # a bug outside the build itself: fail the job, keep the worker
                log.exception("constraint build worker error")
                _settle(job.future, exception=e)
                done = True
            with self._cond:
                self._running -= 1
            if not done:
                log.info("constraint build of static cost %d ran over %.1fs on the fast lane; re-queued",
                         job.cost, self.cheap_seconds)
                job.cost = max(job.cost, self.cheap_cost + 1)
                with self._cond:
                    if not job.cancelled.is_set():
                        self._push(job)  # over the cap is fine: it was admitted already
