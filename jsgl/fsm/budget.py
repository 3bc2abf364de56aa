"""How big and how slow a constraint build may get, and the guard that enforces it while building.

A request's regex / JSON schema is compiled on the server's CPUs, so without limits a 15-byte
pattern (`[\\s\\S]{1,2000}`) could take 16 s, 2.9 GB of RAM and 903 MB of disk. The limits are
checked in three places, cheapest first:
  1. statically, before anything is queued (`static_check.check_regex`, `json_schema`): pattern
     length, nesting, counted repeats and the expanded size they imply;
  2. while building, by a `BuildGuard`: automaton states (interegular's and ours), the index's
     bytes (estimated from the byte FSM before the vocabulary walk, counted during it), a deadline,
     the build process's resident memory and a cancellation flag, polled in every long loop (at
     least every ~25 ms of CPU: tests/test_fsm_budget_limits.py), with backstops in build_process;
  3. nothing over budget is cached, in memory or on disk.

Default numbers were measured on SmolLM2-135M's tokenizer (49152 tokens, 6 KiB of bitmask per
state) on a 2-core host; the typical JSON schemas of tests/test_fsm_json.py take 0.5-2 s, 400-660
byte states and 5-12 MB, far inside every limit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from contextlib import contextmanager
from dataclasses import dataclass

from jsgl.errors import ConstraintBudgetError
from jsgl.fsm.procfs import rss_bytes

# A statm read costs ~10 us; every 5 ms of CPU, builds stopped within 1.1 MiB of 128-512 MiB limits.
RSS_CHECK_S = 0.005
# The backstops (the parent's kill on CPU seconds or resident memory, the child's RLIMIT_DATA) sit this far
# past the limits: the guard answers first; they catch what it cannot (a loop without checks, one big array).
BACKSTOP_FRACTION = 0.1
TICKS = 256  # BuildGuard.tick: loops of ~1-10 us an iteration check every 0.3-3 ms


@dataclass(frozen=True)
class BuildBudget:
    # Static limits (checked before a build is queued).
    max_regex_chars: int = 100_000  # typical schemas give 2-5 K characters
    max_nesting: int = 64  # group depth; interegular's recursive parser overflows near 150 (~7 frames a level)
    max_repeat: int = 1_000  # one counted bound: {m,n}, maxLength/minLength, maxItems/minItems
    max_expanded: int = 10_000  # positions after expanding counted repeats (nested ones multiply)
    max_class_chars: int = 100_000  # characters named by classes: [一-龥] is 21 K, [\U00010000-\U0010FFFF] 1 M
    max_schema_depth: int = 32  # JSON schema nesting (objects / arrays / combinators)
    max_integer_digits: int = 40  # digits of an integer bound (a 128-bit integer has 39)
    # Limits while building.
    max_states: int = 20_000  # character-level automaton states, interegular's intermediates included
    # interegular's states are sets of other automata's states; their total size per automaton is its
    # memory and work. Typical schemas: <= 5 K; `((a{1,12}){1,12}){1,12}`: 1.1 M (2 s, growing fast).
    max_automaton_elements: int = 100_000
    max_index_bytes: int = 128 << 20  # TokenIndex.nbytes (a maxLength-128 string: 76 MB)
    max_build_seconds: float = 10.0  # CPU seconds of one build in its child process (build_process)
    # Resident memory of the build's child process (~42 MiB idle, with the vocabulary). The largest index the
    # byte budget allows ([\s\S]{1,300}: 127 MiB) peaks at 413 MiB, a maxLength-64 schema at 304 MiB: 2.5x room.
    max_build_memory_bytes: int = 1 << 30
    # Server-wide: builds waiting for a worker beyond this are refused (OverloadedError, 503).
    max_queued: int = 64


DEFAULT_BUDGET = BuildBudget()


class BuildMemoryError(ConstraintBudgetError):
    """A build outgrew max_build_memory_bytes. Its process is replaced afterwards (build_process), as
    memory a process freed is not reliably returned to the OS."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"constraint build exceeded the server's memory limit ({limit / 2**20:g} MiB)")
        self.limit = limit

    def __reduce__(self) -> tuple:  # pickles by its argument (the child sends it to the parent)
        return type(self), (self.limit,)


class BuildPreempted(Exception):
    """Internal: a build on the fast lane ran longer than a cheap build should; it goes back to the
    queue of the heavy workers instead of holding up the cheap ones."""


class BuildGuard:
    """Budget checks for one build attempt. `check()` is cheap (a clock read or two) and is called
    once per state in every long loop, so a build stops within milliseconds of its deadline or
    cancellation.

    `max_rss`: bytes of this process's resident memory over which the build raises BuildMemoryError;
    only for a process that runs nothing but the build (build_worker). Read every RSS_CHECK_S of the
    guard's clock, not every check: a read costs ~10 us, a check ~0.3 us.

    `preempt_after`: CPU seconds of this thread after which the build raises BuildPreempted (the
    fast lane's bound; CPU, not wall time, so a cheap build slowed by contention is not misjudged).
    Builds run in child processes (build_process), so builds never compete for one GIL.
    """

    def __init__(self, budget: BuildBudget, cancelled: threading.Event | None = None,
                 preempt_after: float | None = None, clock: Callable[[], float] = time.monotonic,
                 max_rss: int | None = None) -> None:
        self.budget = budget
        self.cancelled = cancelled if cancelled is not None else threading.Event()
        # The build process counts its own CPU seconds (time.process_time): builds run at idle priority, so
        # on a busy machine wall time mostly measures waiting for a core (a 0.4 s build once hit the 10 s
        # wall limit beside two benchmarks), while what the limit bounds is the work a request may cost.
        self.clock = clock
        start = clock()
        self.deadline = start + budget.max_build_seconds
        self.preempt_at = None if preempt_after is None else time.thread_time() + preempt_after
        self.max_rss = max_rss
        self.next_rss_check = start
        self.ticks = 0

    def check_cancelled(self) -> None:
        if self.cancelled.is_set():
            raise CancelledError("constraint build released by every request waiting for it")

    def check(self) -> None:
        self.check_cancelled()
        now = self.clock()
        if now > self.deadline:
            raise ConstraintBudgetError(
                f"constraint build exceeded the server's time limit ({self.budget.max_build_seconds:g} s)")
        if self.max_rss is not None and now >= self.next_rss_check:
            self.next_rss_check = now + RSS_CHECK_S
            rss = rss_bytes()
            if rss is not None and rss > self.max_rss:
                raise BuildMemoryError(self.budget.max_build_memory_bytes)
        if self.preempt_at is not None and time.thread_time() > self.preempt_at:
            raise BuildPreempted

    def tick(self) -> None:
        """check() every TICKS calls: for loops of microseconds an iteration, where a check each would
        cost ~10%."""
        self.ticks += 1
        if self.ticks >= TICKS:
            self.ticks = 0
            self.check()

    def fail_states(self, states: int, what: str) -> None:
        raise ConstraintBudgetError(
            f"constraint too complex: {what} needs more than {states - 1} states "
            f"(the server's limit is {self.budget.max_states})")

    def fail_automaton(self, states: int, elements: int) -> None:
        if states > self.budget.max_states:
            self.fail_states(states, "an intermediate regex automaton")
        raise ConstraintBudgetError(
            f"constraint too complex: an intermediate regex automaton holds more than {elements - 1} "
            f"sub-states (the server's limit is {self.budget.max_automaton_elements}), as nested counted "
            "repeats like (a{1,50}){1,50} do")

    def check_index_bytes(self, nbytes: int, what: str) -> None:
        if nbytes > self.budget.max_index_bytes:
            raise ConstraintBudgetError(
                f"constraint too large: {what} is at least {nbytes / 2**20:.0f} MiB "
                f"(the server's limit is {self.budget.max_index_bytes / 2**20:.0f} MiB)")

    @contextmanager
    def active(self) -> Iterator[BuildGuard]:
        """Make this the guard that code without a `guard` argument (interegular's crawl) consults."""
        prev = getattr(_local, "guard", None)
        _local.guard = self
        try:
            yield self
        finally:
            _local.guard = prev


_local = threading.local()


def current_guard() -> BuildGuard | None:
    """The guard of the build running on this thread, if any."""
    return getattr(_local, "guard", None)
