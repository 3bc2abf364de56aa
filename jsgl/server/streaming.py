"""Bridging the thread-based engine to asyncio, and Server-Sent Events.

The engine hands results out through a blocking per-request queue (`RequestHandle.stream()`). Each
request gets a small daemon thread that drains that queue and forwards chunks to the event loop with
`call_soon_threadsafe`, so the loop never blocks and a slow client never stalls the engine. A thread per
live request is cheap next to the model (they sleep on the queue), and unlike `run_in_executor` it cannot
starve when many streams are open at once: the default executor has only min(32, cpus + 4) workers.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from jsgl.engine.request import InvalidRequestError, StreamChunk


class ClientDisconnected(Exception):
    """The HTTP client went away while its request was running."""


class RequestRegistry:
    """The server's live requests by id: for /abort_request (incl. abort_all), duplicate-id checks and
    /get_server_info. Entries are added at submit and removed by the pump thread on the final chunk."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: dict[str, Any] = {}
        self.client_aborts = 0  # requests aborted because their HTTP client went away (or the reply broke)

    def add(self, handles: Sequence[Any]) -> None:
        with self._lock:
            for h in handles:
                self._handles[h.request_id] = h

    def discard(self, rid: str) -> None:
        with self._lock:
            self._handles.pop(rid, None)

    def note_client_abort(self) -> None:
        with self._lock:
            self.client_aborts += 1

    def __contains__(self, rid: str) -> bool:
        with self._lock:
            return rid in self._handles

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._handles)

    def __len__(self) -> int:
        with self._lock:
            return len(self._handles)


async def submit(engine: Any, registry: RequestRegistry, prompts: list[Any], params: list[dict[str, Any]],
                 rids: list[str] | None = None) -> list[Any]:
    """Queue the requests; raises InvalidRequestError (-> 400) before any is queued when one is bad.

    Submission runs in a worker thread because it tokenizes (and may validate a regex), which is too
    slow for the event loop on long prompts.
    """
    if rids is not None:
        dup = [r for r in rids if r in registry] or ([r for r in rids if rids.count(r) > 1])
        if dup:
            raise InvalidRequestError(f"request id {dup[0]!r} is already in use")

    def run() -> list[Any]:
        if rids is None:
            return engine.submit_batch(prompts, params)  # atomic: the scheduler sees the whole batch at once
        handles: list[Any] = []
        try:
            for prompt, p, rid in zip(prompts, params, rids, strict=True):
                handles.append(engine.submit(prompt, p, request_id=rid))
        except BaseException:
            for h in handles:  # all or nothing, like submit_batch
                h.abort()
            raise
        return handles

    handles = await asyncio.to_thread(run)
    registry.add(handles)
    return handles


class HandleGroup:
    """The chunks of one HTTP request's engine requests, merged into one asyncio stream of (index, chunk)."""

    def __init__(self, handles: Sequence[Any], registry: RequestRegistry) -> None:
        self.handles = list(handles)
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, StreamChunk]] = asyncio.Queue()
        self.finished = [False] * len(self.handles)
        self._registry = registry
        for i, handle in enumerate(self.handles):
            threading.Thread(target=self._pump, args=(i, handle), daemon=True,
                             name=f"jsgl-http-{handle.request_id}").start()

    def _pump(self, index: int, handle: Any) -> None:
        for chunk in handle.stream():
            if chunk.finished:
                self._registry.discard(handle.request_id)
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, chunk))
            except RuntimeError:  # the event loop has closed (server shutdown): nobody is listening
                return

    async def events(self, request: Request | None = None,
                     poll_s: float = 0.5) -> AsyncIterator[tuple[int, StreamChunk]]:
        """Yield (index, chunk) until every request has finished. With `request`, check every `poll_s`
        whether the client has disconnected and raise ClientDisconnected if so (non-streaming responses:
        nothing else notices a client that hangs up while we wait)."""
        getter: asyncio.Future | None = None
        loop = asyncio.get_running_loop()
        next_check = loop.time() + poll_s
        try:
            while not all(self.finished):
                if getter is None:
                    getter = asyncio.ensure_future(self.queue.get())
                # asyncio.wait (unlike wait_for) never cancels the getter, so a chunk is never lost to a timeout.
                done, _ = await asyncio.wait({getter}, timeout=poll_s if request is not None else None)
                # Check on a clock, not only when chunks stop: a fast decode yields a chunk every step.
                if request is not None and loop.time() >= next_check:
                    next_check = loop.time() + poll_s
                    if await request.is_disconnected():
                        raise ClientDisconnected()
                if not done:
                    continue
                index, chunk = getter.result()
                getter = None
                if chunk.finished:
                    self.finished[index] = True
                yield index, chunk
        finally:
            if getter is not None:
                getter.cancel()

    async def outputs(self, request: Request | None = None) -> list[Any]:
        """Wait for every final GenerateOutput (aborting all if the client disconnects)."""
        outs: list[Any] = [None] * len(self.handles)
        try:
            async for i, chunk in self.events(request):
                if chunk.finished:
                    outs[i] = chunk.output
        finally:
            self.abort_unfinished()
        return outs

    def abort_unfinished(self) -> None:
        """Abort what is still running: the engine then frees its KV slots (called on disconnect)."""
        for handle, done in zip(self.handles, self.finished):
            if not done:
                handle.abort()
                self._registry.note_client_abort()


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def stream_guard(group: HandleGroup, body: Callable[[], AsyncIterator[str]]) -> AsyncIterator[str]:
    """Wrap an SSE body so that however it ends (client disconnect cancels it, an error breaks it) the
    group's unfinished requests are aborted and their KV freed."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for piece in body():
                yield piece
        finally:
            group.abort_unfinished()

    return guarded()
