"""Constraint builds run in child processes, at idle CPU priority.

Compiling a regex is mostly pure Python (interegular), so on a thread it holds the GIL that the engine
loop needs: two ~4 s builds on threads made an unrelated 24-token request take 3.3 s instead of 0.19 s.
Each build worker thread (build_queue) therefore hands the compile and the vocabulary walk to a child
process of its own, `python -m jsgl.fsm.build_worker` (a plain subprocess: multiprocessing's spawn would
re-run the user's main script in the child, and a fork of a process running JAX's threads may
deadlock). The child imports only `jsgl.fsm` (~0.3 s) and runs at SCHED_IDLE (build_worker).

The parent mirrors a cancellation to the child, which stops at its guard's next check. The time limit is
CPU seconds the child used, not wall seconds: at idle priority a build on a busy machine mostly waits for a
core; the limit bounds the work a request may cost. The memory limit is the child's resident memory
(build_worker enforces it). The guard's checks answer first (every long loop polls it, at least every
~25 ms of CPU); the parent is the backstop, killing a child BACKSTOP_FRACTION (10%) past either limit
(CPU seconds or resident memory, read from /proc every POLL_S) or WALL_BACKSTOP_FACTOR times past the
time limit in wall seconds. A child that went over a limit, or kept memory after a build, is replaced
by a fresh process, so what the build took returns to the OS.
"""

from __future__ import annotations

import pickle
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from jsgl.errors import ConstraintBudgetError
from jsgl.fsm import procfs
from jsgl.fsm.budget import BACKSTOP_FRACTION, BuildBudget, BuildGuard, BuildMemoryError, BuildPreempted
from jsgl.fsm.token_index import TokenIndex
from jsgl.fsm.vocab import VocabBytes

POLL_S = 0.02  # how often the waiting parent looks for a cancellation and reads the child's CPU and memory
# Past BACKSTOP_FRACTION of its time limit (CPU seconds) a child is killed, and at least this far past it:
GRACE_MIN_S = 0.05  # /proc counts CPU in 10 ms ticks, and the parent polls every 20 ms
# ... or past this many times its budget in wall seconds: starved of CPU that long, the machine is saturated.
WALL_BACKSTOP_FACTOR = 10
BOOT_TIMEOUT_S = 120.0  # wall seconds for a child's imports (~0.3 s of CPU, at idle priority)
# A child still this far above its idle size after a build (and malloc_trim) exits and is replaced. Trimmed,
# children measured within 16 MiB of idle after 1.2 GB builds; untrimmed they kept 300 MB.
RETIRE_ABOVE_BYTES = 64 << 20


# Idle priority before anything else, so the child's imports (~0.3 s of CPU) do not compete with serving
# either: SCHED_IDLE runs the child only on a core nothing else wants. At nice 10 (or 19) two builds made an
# unrelated request ~3x slower (a descheduled thread of the engine's two-thread matmul makes the other wait).
_BOOT = ("import os\ntry:\n    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
         "except (AttributeError, OSError):\n    os.nice(19)\n"
         "import runpy\nrunpy.run_module('jsgl.fsm.build_worker', run_name='__main__', alter_sys=True)\n")


def kill_limits(seconds: float) -> tuple[float, float]:
    """When the parent kills a child building under a time limit of ``seconds``: past this many CPU seconds, or
    this many wall seconds after the request. Both leave the child's own check (at the limit) time to answer."""
    grace = max(BACKSTOP_FRACTION * seconds, GRACE_MIN_S)
    return seconds + grace, WALL_BACKSTOP_FACTOR * seconds + grace


@dataclass
class BuildStats:
    """What the last build cost its child, as the parent read it from /proc."""

    pid: int
    outcome: str  # "ok", "error", "preempted", "killed: time", "killed: memory"
    cpu_seconds: float | None  # CPU the child used from the request to its reply (or to being killed)
    wall_seconds: float
    peak_rss: int | None  # bytes: the child's VmHWM, reset when the build started (build_worker)


class BuildProcess:
    """One child process; used by one worker thread at a time."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._fingerprint: str | None = None  # the vocabulary the child holds
        self._pending = 0  # messages the child owes before the next reply: "ready" after boot, "idle" after a build
        self._booting = False  # the message owed is "ready"
        self.last: BuildStats | None = None
        self.replacements = 0  # children killed (over a limit) or retired (kept memory) and started afresh

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _start(self) -> None:
        # Its own session: a Ctrl-C (or a notebook's interrupt) is for the parent; the child exits when its stdin
        # closes (the parent went away).
        self._proc = subprocess.Popen([sys.executable, "-c", _BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      start_new_session=True)
        self._fingerprint = None
        self._pending, self._booting = 1, True

    def start(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            self.stop()
            self._start()

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(5)
            for pipe in (self._proc.stdin, self._proc.stdout):
                pipe.close()
        self._proc = None
        self._pending = 0

    def replace(self) -> None:
        """Kill the child and start a fresh one, which boots while this worker waits for its next build."""
        self.stop()
        self.replacements += 1
        self._start()

    def _send(self, message: tuple) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        self._proc.stdin.flush()

    def _receive(self) -> tuple:
        assert self._proc is not None and self._proc.stdout is not None
        try:
            return pickle.load(self._proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            self.stop()
            raise RuntimeError("the constraint build process died") from exc

    def ready(self) -> None:
        """Start the child if needed and read what it owes ("ready", the last build's "idle"), so that it
        waits for a request and the CPU it uses from now on is the next build's."""
        self.start()
        while self._pending:
            assert self._proc is not None
            # Only "ready" is waited for with a timeout: an "idle" may already sit in the reader's buffer,
            # which select() does not see, and it follows its reply once the build is freed (< 1 s).
            if self._booting and not select.select([self._proc.stdout], [], [], BOOT_TIMEOUT_S)[0]:
                self.stop()
                raise RuntimeError("the constraint build process did not start")
            try:
                kind, retire = self._receive()
            except RuntimeError:
                if self._booting:
                    raise
                self._start()  # it died after its reply: the next build gets a fresh one
                continue
            self._pending, self._booting = self._pending - 1, False
            if kind == "idle" and retire:  # the child exits: it kept memory after trimming
                self.replace()

    def build(self, regex: str, vocab: VocabBytes, vocab_size: int | None, budget: BuildBudget,
              guard: BuildGuard) -> TokenIndex:
        """Compile `regex` into its token index in the child, under `guard`'s deadline, preemption and
        cancellation and `budget`'s memory limit. Raises what the build raised (ConstraintBudgetError,
        BuildMemoryError, InvalidRequestError, CancelledError, BuildPreempted)."""
        seconds = guard.deadline - guard.clock()
        preempt = None if guard.preempt_at is None else max(guard.preempt_at - time.thread_time(), 0.0)
        self.ready()
        proc = self._proc
        assert proc is not None
        send_vocab = vocab if self._fingerprint != vocab.fingerprint else None
        try:
            self._send(("build", regex, vocab.fingerprint, send_vocab, vocab_size, budget, seconds, preempt,
                        RETIRE_ABOVE_BYTES))
        except OSError as exc:
            self.stop()
            raise RuntimeError("the constraint build process died") from exc
        self._fingerprint = vocab.fingerprint
        cpu_start, t0 = procfs.cpu_seconds(proc.pid), time.monotonic()
        cpu_kill_after, wall_kill_after = kill_limits(seconds)
        wall_kill_at = t0 + wall_kill_after
        max_rss = budget.max_build_memory_bytes * (1 + BACKSTOP_FRACTION)
        told = False
        # select() sees the pipe, not the reader's buffer: safe, as everything the child wrote before this
        # request was read (ready()), and it writes nothing more before its reply.
        while not select.select([proc.stdout], [], [], POLL_S)[0]:
            if guard.cancelled.is_set() and not told:
                self._send(("cancel",))
                told = True
            cpu, rss = procfs.cpu_seconds(proc.pid), procfs.rss_bytes(proc.pid)
            used = None if cpu is None or cpu_start is None else cpu - cpu_start
            if rss is not None and rss > max_rss:
                self._record(proc, "killed: memory", used, t0)
                self.replace()
                raise BuildMemoryError(budget.max_build_memory_bytes)
            if (used is not None and used > cpu_kill_after) or time.monotonic() > wall_kill_at:
                self._record(proc, "killed: time", used, t0)
                self.replace()
                raise ConstraintBudgetError(
                    f"constraint build exceeded the server's time limit ({budget.max_build_seconds:g} s)")
            if proc.poll() is not None:
                self.stop()
                raise RuntimeError("the constraint build process died")
        kind, payload = self._receive()
        self._pending = 1  # its "idle" follows
        cpu = procfs.cpu_seconds(proc.pid)
        self._record(proc, kind, None if cpu is None or cpu_start is None else cpu - cpu_start, t0)
        if kind == "preempted":
            raise BuildPreempted
        if kind == "error":
            if isinstance(payload, BuildMemoryError):
                self.replace()  # freed memory is not reliably returned to the OS: a fresh process is
            raise payload
        return payload

    def _record(self, proc: subprocess.Popen, outcome: str, cpu: float | None, t0: float) -> None:
        self.last = BuildStats(pid=proc.pid, outcome=outcome, cpu_seconds=cpu,
                               wall_seconds=time.monotonic() - t0, peak_rss=procfs.peak_rss_bytes(proc.pid))


_local = threading.local()


def worker_process() -> BuildProcess:
    """This worker thread's own child process, started now if it is not running (workers call this when
    they start, so children boot with the engine rather than during a first constrained request)."""
    proc = getattr(_local, "proc", None)
    if proc is None:
        proc = _local.proc = BuildProcess()
    proc.start()
    return proc


def build_in_child(regex: str, vocab: VocabBytes, vocab_size: int | None, budget: BuildBudget,
                   guard: BuildGuard) -> Any:
    return worker_process().build(regex, vocab, vocab_size, budget, guard)
