"""What ``Engine.submit`` returns: a handle to wait for, stream, or abort one request."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from jsgl.engine.request import GenerateOutput, StreamChunk
from jsgl.engine.sequence import Sequence

if TYPE_CHECKING:
    from jsgl.engine.engine import Engine


class RequestHandle:
    """A submitted request: wait for its result, stream it, or abort it."""

    def __init__(self, engine: Engine, seq: Sequence):
        self._engine, self._seq = engine, seq
        self.request_id = seq.rid

    def result(self, timeout: float | None = None) -> GenerateOutput:
        if not self._seq.done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish in {timeout}s")
        assert self._seq.output is not None
        return self._seq.output

    def stream(self) -> Iterator[StreamChunk]:
        while True:
            chunk = self._seq.stream_queue.get()
            yield chunk
            if chunk.finished:
                return

    def subscribe(self, callback: Callable[[StreamChunk], None]) -> None:
        """Have ``callback`` receive this request's chunks, in order, on the engine thread (keep it
        short and non-blocking), instead of reading `stream()`. Chunks published before the call are
        delivered first, from this thread. Use one of subscribe or stream, not both."""
        seq = self._seq
        with seq.listener_lock:
            while True:
                try:
                    callback(seq.stream_queue.get_nowait())
                except queue.Empty:
                    break
            seq.listener = callback

    def abort(self) -> None:
        self._engine.abort(self.request_id)

    @property
    def done(self) -> bool:
        return self._seq.done.is_set()
