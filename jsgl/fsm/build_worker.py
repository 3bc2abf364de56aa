"""The child side of build_process: `python -m jsgl.fsm.build_worker`, driven over stdin/stdout.

Messages are pickles: ("build", regex, fingerprint, vocab or None, vocab_size, budget, seconds left,
CPU seconds before preemption) and ("cancel",) in; ("ok", TokenIndex) | ("error", exc) |
("preempted", None) out. A reader thread takes messages, so a cancellation reaches the running build's
guard at its next check.
"""

from __future__ import annotations

import os
import pickle
import queue
import sys
import threading
import time
from typing import Any

from jsgl.fsm.budget import BuildGuard, BuildPreempted
from jsgl.fsm.regex_fsm import compile_regex
from jsgl.fsm.token_index import build_token_index


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
    vocabs: dict[str, Any] = {}
    while True:
        _, regex, fingerprint, vocab, vocab_size, budget, seconds, preempt_after = jobs.get()
        cancelled.clear()  # a late cancel of the previous job was read before this job
        if vocab is not None:
            vocabs = {fingerprint: vocab}  # one tokenizer per server: keep only the latest
        guard = BuildGuard(budget, cancelled, preempt_after=preempt_after, clock=time.process_time)
        guard.deadline = time.process_time() + seconds  # what is left of the parent's budget, in CPU seconds
        try:
            with guard.active():
                t0 = time.perf_counter()
                fsm = compile_regex(regex, guard)
                index = build_token_index(fsm, vocabs[fingerprint], vocab_size, guard)
                index.build_seconds = time.perf_counter() - t0
            reply: tuple[str, Any] = ("ok", index)
        except BuildPreempted:
            reply = ("preempted", None)
        except BaseException as exc:  # the request's error (budget, bad regex, cancelled) or a bug
            reply = ("error", exc)
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # an exception that does not pickle
            data = pickle.dumps(("error", RuntimeError(f"constraint build failed: {type(exc).__name__}")))
        stdout.write(data)
        stdout.flush()


if __name__ == "__main__":
    main()
