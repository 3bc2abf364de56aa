"""The child side of build_process: `python -m jsgl.fsm.build_worker`, driven over stdin/stdout.

Messages are pickles. In: ("build", regex, fingerprint, vocab or None, vocab_size, budget, CPU seconds
left, CPU seconds before preemption, retire_above) and ("cancel",). Out: ("ready", None) once booted;
per build, its reply ("ok", TokenIndex) | ("error", exc) | ("preempted", None), then ("idle", retire)
once the build's memory is freed. A reader thread takes messages, so a cancellation reaches the
running build's guard at its next check.

Memory: the guard stops a build whose resident memory passes budget.max_build_memory_bytes (checked
every few ms of CPU); RLIMIT_DATA stops any allocation that would take it BACKSTOP_FRACTION (10%) past
that (MemoryError, reported the same way), however the build allocates. After a build the child trims
its heap; if it is still `retire_above` bytes over its idle size it says so in "idle", then exits, and
the parent starts a fresh one.
"""

from __future__ import annotations

import os
import pickle
import queue
import sys
import threading
import time
from typing import Any, BinaryIO

from jsgl.fsm import procfs
from jsgl.fsm.budget import BACKSTOP_FRACTION, BuildBudget, BuildGuard, BuildMemoryError, BuildPreempted
from jsgl.fsm.regex_fsm import compile_regex
from jsgl.fsm.token_index import build_token_index


def _write(stdout: BinaryIO, reply: tuple) -> None:
    try:
        data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # an exception that does not pickle
        data = pickle.dumps(("error", RuntimeError(f"constraint build failed: {type(exc).__name__}")))
    stdout.write(data)
    stdout.flush()


def _cap_memory(budget: BuildBudget) -> None:
    """RLIMIT_DATA such that resident memory can grow to the limit plus BACKSTOP_FRACTION of it, at
    most: VmData counts writable private mappings touched or not, so the cap is VmData now plus the room
    left, not the limit itself."""
    rss, data = procfs.rss_bytes(), procfs.data_bytes()
    if rss is not None and data is not None:
        room = int(budget.max_build_memory_bytes * (1 + BACKSTOP_FRACTION)) - rss
        procfs.limit_data(data + max(room, 0))


def _build(message: tuple, vocabs: dict[str, Any], cancelled: threading.Event) -> tuple[str, Any]:
    _, regex, fingerprint, _, vocab_size, budget, seconds, preempt_after, _ = message
    guard = BuildGuard(budget, cancelled, preempt_after=preempt_after, clock=time.process_time,
                       max_rss=budget.max_build_memory_bytes)
    guard.deadline = time.process_time() + seconds  # what is left of the parent's budget, in CPU seconds
    procfs.reset_peak_rss()  # the parent reads VmHWM after the reply: this build's peak alone
    _cap_memory(budget)
    try:
        with guard.active():
            t0 = time.perf_counter()
            fsm = compile_regex(regex, guard)
            index = build_token_index(fsm, vocabs[fingerprint], vocab_size, guard)
            index.build_seconds = time.perf_counter() - t0
        return ("ok", index)
    except BuildPreempted:
        return ("preempted", None)
    except MemoryError as exc:  # an allocation past RLIMIT_DATA
        error = BuildMemoryError(budget.max_build_memory_bytes)
        error.__context__ = exc  # keeps the build's frames, to be freed after the reply (main)
        return ("error", error)
    except BaseException as exc:  # the request's error (budget, bad regex, cancelled) or a bug
        return ("error", exc)
    finally:
        procfs.limit_data(None)  # pickling the reply, and the reader thread, are not the build's to bound


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies may go to the pipe
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    cancelled = threading.Event()

    def read() -> None:
        while True:
            try:
                message = pickle.load(stdin)
            except (EOFError, OSError, pickle.UnpicklingError):
                os._exit(0)  # the parent went away
            if message[0] == "cancel":
                cancelled.set()
            else:
                jobs.put(message)

    threading.Thread(target=read, daemon=True).start()
    _write(stdout, ("ready", None))
    vocabs: dict[str, Any] = {}
    idle_rss: int | None = None  # resident memory with the current vocabulary, before any build
    while True:
        message = jobs.get()
        cancelled.clear()  # a late cancel of the previous job was read before this job
        if message[3] is not None:
            vocabs = {message[2]: message[3]}  # one tokenizer per server: keep only the latest
            idle_rss = None
        if idle_rss is None:
            idle_rss = procfs.rss_bytes()
        retire_above = message[8]
        reply = _build(message, vocabs, cancelled)
        _write(stdout, reply)
        # Only now free the build (an error's traceback holds its frames): freeing 1 GB of small objects
        # takes ~0.6 s, which the caller need not wait for.
        del reply, message
        procfs.trim_heap()
        rss = procfs.rss_bytes()
        retire = rss is not None and idle_rss is not None and rss > idle_rss + retire_above
        _write(stdout, ("idle", retire))
        if retire:
            os._exit(0)


if __name__ == "__main__":
    main()
