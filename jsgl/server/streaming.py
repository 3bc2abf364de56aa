"""Bridging the thread-based engine to asyncio, and Server-Sent Events.

Each request's chunks reach the event loop through `RequestHandle.subscribe`: the engine thread hands
each chunk to `call_soon_threadsafe`, so the loop never blocks, a slow client never stalls the engine,
and no thread is started per request (a 3,000-prompt batch once started ~2,900 pump threads).
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from jsgl.engine.request import StreamChunk
from jsgl.errors import OverloadedError


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
                 rids: list[str] | None = None, max_live: int | None = None,
                 samples: list[int] | None = None) -> list[Any]:
    """Queue the requests; raises InvalidRequestError (-> 400) before any is queued when one is bad, and
    OverloadedError (-> 503) when `max_live` requests would be exceeded. ``samples``: the engine's (the n of each
    prompt, whose samples must fit the KV pool together).

    Submission runs in a worker thread because it tokenizes (and may validate a regex), which is too
    slow for the event loop on long prompts. The engine itself refuses an id that is in use.
    """
    if max_live is not None and len(registry) + len(prompts) > max_live:
        raise OverloadedError(f"the server is at its limit of {max_live} concurrent requests "
                              "(--max-concurrent-requests); retry later")

    def run() -> list[Any]:  # atomic, all or nothing: the scheduler sees the whole batch at once
        return engine.submit_batch(prompts, params, request_ids=rids, samples=samples)

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
        self._first: tuple[int, StreamChunk] | None = None  # taken by peek(), not yet yielded
        for i, handle in enumerate(self.handles):
            handle.subscribe(functools.partial(self._deliver, i, handle.request_id))

    def _deliver(self, index: int, rid: str, chunk: StreamChunk) -> None:
        """Engine thread: forward a chunk to the event loop."""
        if chunk.finished:
            self._registry.discard(rid)
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, chunk))
        except RuntimeError:  # the event loop has closed (server shutdown): nobody is listening
            pass

    async def peek(self) -> tuple[int, StreamChunk]:
        """The first event, which `events()` will still yield (to answer an error before streaming)."""
        if self._first is None:
            index, chunk = await self.queue.get()
            if chunk.finished:
                self.finished[index] = True
            self._first = (index, chunk)
        return self._first

    async def events(self, request: Request | None = None,
                     poll_s: float = 0.5) -> AsyncIterator[tuple[int, StreamChunk]]:
        """Yield (index, chunk) until every request has finished. With `request`, check every `poll_s`
        whether the client has disconnected and raise ClientDisconnected if so (non-streaming responses:
        nothing else notices a client that hangs up while we wait)."""
        if self._first is not None:
            first, self._first = self._first, None
            yield first
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
