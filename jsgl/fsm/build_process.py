"""Constraint builds run in child processes, at idle CPU priority.

Compiling a regex is mostly pure Python (interegular), so on a thread it holds the GIL that the engine
loop needs: two ~4 s builds on threads made an unrelated 24-token request take 3.3 s instead of 0.19 s.
Each build worker thread (build_queue) therefore hands the compile and the vocabulary walk to a child
process of its own, `python -m jsgl.fsm.build_worker` (a plain subprocess: multiprocessing's spawn would
re-run the user's main script in the child, and a fork of a process running JAX's threads may
deadlock). The child imports only `jsgl.fsm` (~0.3 s) and runs at SCHED_IDLE (build_worker).

The parent mirrors a cancellation to the child, which stops at its guard's next check, and kills a child
that overstays its budget (a backstop: the guard's own checks answer first). The budget is CPU seconds the
child used, not wall seconds: at idle priority a build on a busy machine mostly waits for a core.
"""

from __future__ import annotations

import os
import pickle
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from jsgl.errors import ConstraintBudgetError
from jsgl.fsm.budget import BuildBudget, BuildGuard, BuildPreempted
from jsgl.fsm.token_index import TokenIndex
from jsgl.fsm.vocab import VocabBytes

POLL_S = 0.02  # how often the waiting parent looks for a cancellation
KILL_GRACE_S = 5.0  # past its deadline by this much (CPU seconds), a child is killed
# ... or past this many times its budget in wall seconds: starved of CPU that long, the machine is saturated.
WALL_BACKSTOP_FACTOR = 10


# Idle priority before anything else, so the child's imports (~0.3 s of CPU) do not compete with serving
# either: SCHED_IDLE runs the child only on a core nothing else wants. At nice 10 (or 19) two builds made an
# unrelated request ~3x slower (a descheduled thread of the engine's two-thread matmul makes the other wait).
_BOOT = ("import os\ntry:\n    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
         "except (AttributeError, OSError):\n    os.nice(19)\n"
         "import runpy\nrunpy.run_module('jsgl.fsm.build_worker', run_name='__main__', alter_sys=True)\n")


class BuildProcess:
    """One child process; used by one worker thread at a time."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._fingerprint: str | None = None  # the vocabulary the child holds

    def _start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", _BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._fingerprint = None

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

    def _send(self, message: tuple) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        self._proc.stdin.flush()

    def build(self, regex: str, vocab: VocabBytes, vocab_size: int | None, budget: BuildBudget,
              guard: BuildGuard) -> TokenIndex:
        """Compile `regex` into its token index in the child, under `guard`'s deadline, preemption and
        cancellation. Raises what the build raised (ConstraintBudgetError, InvalidRequestError,
        CancelledError, BuildPreempted)."""
        self.start()
        proc = self._proc
        seconds = guard.deadline - guard.clock()
        preempt = None if guard.preempt_at is None else max(guard.preempt_at - time.thread_time(), 0.0)
        send_vocab = vocab if self._fingerprint != vocab.fingerprint else None
        try:
            self._send(("build", regex, vocab.fingerprint, send_vocab, vocab_size, budget, seconds, preempt))
        except OSError as exc:
            self.stop()
            raise RuntimeError("the constraint build process died") from exc
        self._fingerprint = vocab.fingerprint
        cpu_start = _cpu_seconds(proc.pid)
        wall_kill_at = time.monotonic() + WALL_BACKSTOP_FACTOR * seconds + KILL_GRACE_S
        told = False
        # select() sees the pipe, not the reader's buffer: safe, as the child writes one reply per request.
        while not select.select([proc.stdout], [], [], POLL_S)[0]:
            if guard.cancelled.is_set() and not told:
                self._send(("cancel",))
                told = True
            cpu = _cpu_seconds(proc.pid)
            over_cpu = cpu is not None and cpu_start is not None and cpu - cpu_start > seconds + KILL_GRACE_S
            if over_cpu or time.monotonic() > wall_kill_at or proc.poll() is not None:
                self.stop()
                raise ConstraintBudgetError(
                    f"constraint build exceeded the server's time limit ({budget.max_build_seconds:g} s)")
        try:
            kind, payload = pickle.load(proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            self.stop()
            raise RuntimeError("the constraint build process died") from exc
        if kind == "preempted":
            raise BuildPreempted
        if kind == "error":
            raise payload
        return payload


def _cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) a process has used, from /proc (Linux); None where unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


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
