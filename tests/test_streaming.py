"""jsgl/server/streaming.py without a model: the engine-thread -> asyncio bridge, SSE, the request registry and
client-disconnect aborts.

The unit under test runs for real: real `RequestHandle`s over real `Sequence`s whose chunks the engine's own
`Sequence.publish` builds (with a real `IncrementalDetokenizer` over a one-character-per-token tokenizer),
published from a real background thread; real starlette `Request`s over an ASGI `receive` that reports
`http.disconnect` when the test says so; real asyncio loops. Only the engine that `submit` calls is a stand-in.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from starlette.requests import Request

from jsgl.engine.detokenizer import IncrementalDetokenizer
from jsgl.engine.handle import RequestHandle
from jsgl.engine.request import AbortReason, FinishReason, GenerateOutput, SamplingParams, new_request_id
from jsgl.engine.sequence import Sequence
from jsgl.errors import InvalidRequestError, OverloadedError
from jsgl.server.streaming import (
    SSE_DONE,
    ClientDisconnected,
    HandleGroup,
    RequestRegistry,
    sse,
    sse_response,
    stream_guard,
    submit,
)

BOUND_S = 3.0  # a hang (a chunk lost, a stream that never ends) fails the test after this long


class CharTokenizer:
    """Token id = code point: decode is exact and incremental, so each chunk's text is predictable."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


class StubEngine:
    """What `submit` calls: real handles over real sequences; records what it was asked to do."""

    BAD = "<bad>"

    def __init__(self):
        self.seqs: dict[str, Sequence] = {}
        self.calls: list[tuple] = []  # ("submit", rid) / ("submit_batch", n)
        self.aborted: list[str] = []
        self.threads: set[str] = set()

    def _make(self, prompt, params, request_id):
        if prompt == self.BAD:
            raise InvalidRequestError("bad prompt")
        p = SamplingParams(**params)
        seq = Sequence(rid=request_id or new_request_id(), prompt_ids=[ord(c) for c in prompt], params=p,
                       detok=IncrementalDetokenizer(CharTokenizer(), []), seed=0, stop_ids=set())
        self.seqs[seq.rid] = seq
        return RequestHandle(self, seq)

    def submit(self, prompt, sampling_params=None, request_id=None):
        self.threads.add(threading.current_thread().name)
        self.calls.append(("submit", request_id))
        return self._make(prompt, sampling_params or {}, request_id)

    def submit_batch(self, prompts, sampling_params, request_ids=None, samples=None):
        """All or nothing, as the engine's: a bad prompt or a length mismatch queues none of them."""
        self.threads.add(threading.current_thread().name)
        self.calls.append(("submit_batch", len(prompts)))
        ids = request_ids if request_ids is not None else [None] * len(prompts)
        made = [(p, s, rid) for p, s, rid in zip(prompts, sampling_params, ids, strict=True)]
        if any(p == self.BAD for p, _, _ in made):
            raise InvalidRequestError("bad prompt")
        return [self._make(p, s, rid) for p, s, rid in made]

    def abort(self, request_id):
        self.aborted.append(request_id)


def step(handle: RequestHandle, text: str, finish: FinishReason | None = None) -> None:
    """One engine step for a request, as the engine thread does it: new tokens, maybe finish, publish."""
    seq = handle._seq
    seq.output_ids.extend(ord(c) for c in text)
    seq.detok.add(seq.output_ids)
    if finish is not None:
        seq.finish_reason = finish
        if finish is FinishReason.ABORT:
            seq.abort_reason = AbortReason.CLIENT
    seq.publish()


def engine_thread(script, delay: float = 0.0) -> threading.Thread:
    """Run `script` (a list of (handle, text, finish) steps, or callables to run in between) on a thread."""

    def run():
        for item in script:
            if delay:
                time.sleep(delay)
            if callable(item):
                item()
            else:
                step(*item)

    t = threading.Thread(target=run, name="engine", daemon=True)
    t.start()
    return t


def make_handles(engine: StubEngine, registry: RequestRegistry, n: int, prefix: str = "r") -> list[RequestHandle]:
    handles = [engine.submit(f"p{i}", {}, request_id=f"{prefix}{i}") for i in range(n)]
    registry.add(handles)
    return handles


def make_request(hung_up: threading.Event, receive_times: list[float] | None = None) -> Request:
    """A real starlette Request whose client has hung up once `hung_up` is set."""

    async def receive():
        if receive_times is not None:
            receive_times.append(time.monotonic())
        if hung_up.is_set():
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)  # a live client that sends nothing more: is_disconnected's scope cancels this
        raise AssertionError("unreachable")

    scope = {"type": "http", "http_version": "1.1", "method": "POST", "scheme": "http", "path": "/generate",
             "raw_path": b"/generate", "query_string": b"", "root_path": "", "headers": [],
             "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 30000)}
    return Request(scope, receive)


async def collect(agen, bound: float = BOUND_S) -> list:
    async def run():
        return [x async for x in agen]

    return await asyncio.wait_for(run(), bound)


def by_index(events) -> dict[int, list[tuple[str, bool]]]:
    out: dict[int, list[tuple[str, bool]]] = {}
    for i, chunk in events:
        out.setdefault(i, []).append((chunk.text_delta, chunk.finished))
    return out


# ------------------------------------------------------------------------------------------- registry


def test_registry_add_discard_ids_len_contains():
    engine, reg = StubEngine(), RequestRegistry()
    assert len(reg) == 0 and reg.ids() == [] and "a" not in reg and reg.client_aborts == 0
    hs = [engine.submit("x", {}, request_id=rid) for rid in ("a", "b", "c")]
    reg.add(hs[:2])
    reg.add(hs[2:])
    assert reg.ids() == ["a", "b", "c"] and len(reg) == 3
    assert "a" in reg and "c" in reg and "z" not in reg
    reg.discard("b")
    assert reg.ids() == ["a", "c"] and len(reg) == 2 and "b" not in reg
    reg.discard("b")  # already gone (the final chunk and /abort_request may both discard): no error
    reg.discard("never-added")
    assert reg.ids() == ["a", "c"]
    ids = reg.ids()
    ids.append("mutating the copy")
    assert reg.ids() == ["a", "c"]  # a snapshot, not the live dict
    reg.note_client_abort()
    reg.note_client_abort()
    assert reg.client_aborts == 2 and len(reg) == 2  # counting aborts does not touch the live set


def test_registry_is_thread_safe():
    engine, reg = StubEngine(), RequestRegistry()
    hs = [engine.submit("x", {}, request_id=f"t{i}") for i in range(400)]

    def worker(part):
        for h in part:
            reg.add([h])
            reg.note_client_abort()
            assert h.request_id in reg
            reg.discard(h.request_id)

    threads = [threading.Thread(target=worker, args=(hs[k::4],)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reg) == 0 and reg.client_aborts == 400


# --------------------------------------------------------------------------------------------- submit


def test_submit_without_rids_is_one_atomic_batch_in_a_worker_thread():
    engine, reg = StubEngine(), RequestRegistry()
    handles = asyncio.run(submit(engine, reg, ["ab", "cd", "ef"], [{}, {"max_new_tokens": 3}, {}]))
    assert engine.calls == [("submit_batch", 3)]
    assert [h._seq.prompt_ids for h in handles] == [[97, 98], [99, 100], [101, 102]]
    assert handles[1]._seq.params.max_new_tokens == 3
    assert reg.ids() == [h.request_id for h in handles] and len(set(reg.ids())) == 3
    assert threading.main_thread().name not in engine.threads  # tokenizing stays off the event loop


def test_submit_with_rids_uses_them_in_order():
    engine, reg = StubEngine(), RequestRegistry()
    handles = asyncio.run(submit(engine, reg, ["a", "b"], [{"max_new_tokens": 7}, {"temperature": 0.5}],
                                 rids=["id-0", "id-1"]))
    assert [h.request_id for h in handles] == ["id-0", "id-1"]
    assert [h._seq.prompt_ids for h in handles] == [[97], [98]]
    assert handles[0]._seq.params.max_new_tokens == 7 and handles[1]._seq.params.temperature == 0.5
    assert handles[1]._seq.params.max_new_tokens == SamplingParams().max_new_tokens
    assert engine.calls == [("submit_batch", 2)]  # one batch: the scheduler sees every choice in the same step
    assert reg.ids() == ["id-0", "id-1"] and engine.aborted == []
    assert threading.main_thread().name not in engine.threads


def test_submit_with_rids_is_all_or_nothing():
    engine, reg = StubEngine(), RequestRegistry()
    with pytest.raises(InvalidRequestError, match="bad prompt"):
        asyncio.run(submit(engine, reg, ["a", "b", StubEngine.BAD, "d"], [{}] * 4, rids=["k0", "k1", "k2", "k3"]))
    assert engine.calls == [("submit_batch", 4)] and engine.aborted == []  # one batch: none of it was queued
    assert len(reg) == 0 and reg.client_aborts == 0  # nothing registered, and not a client abort


def test_submit_rids_length_mismatch_is_refused():
    engine, reg = StubEngine(), RequestRegistry()
    with pytest.raises(ValueError):
        asyncio.run(submit(engine, reg, ["a", "b"], [{}, {}], rids=["only-one"]))
    assert engine.aborted == [] and len(reg) == 0


def test_submit_failure_in_batch_registers_nothing():
    engine, reg = StubEngine(), RequestRegistry()
    with pytest.raises(InvalidRequestError):
        asyncio.run(submit(engine, reg, ["a", StubEngine.BAD], [{}, {}]))
    assert len(reg) == 0 and engine.aborted == []


def test_submit_max_live_boundary():
    engine, reg = StubEngine(), RequestRegistry()
    make_handles(engine, reg, 1, prefix="live")
    engine.calls.clear()
    # 1 live + 2 new == max_live: allowed.
    asyncio.run(submit(engine, reg, ["a", "b"], [{}, {}], max_live=3))
    assert len(reg) == 3 and engine.calls == [("submit_batch", 2)]
    # One more would exceed it: refused before anything reaches the engine.
    with pytest.raises(OverloadedError) as e:
        asyncio.run(submit(engine, reg, ["c"], [{}], rids=["c"], max_live=3))
    assert str(e.value) == ("the server is at its limit of 3 concurrent requests (--max-concurrent-requests); "
                            "retry later")
    assert len(reg) == 3 and engine.calls == [("submit_batch", 2)]
    # A request finishing frees its place.
    reg.discard("live0")
    asyncio.run(submit(engine, reg, ["c"], [{}], rids=["c"], max_live=3))
    assert "c" in reg and len(reg) == 3
    # A batch is refused as a whole even though part of it would fit.
    reg.discard("c")
    with pytest.raises(OverloadedError):
        asyncio.run(submit(engine, reg, ["d", "e"], [{}, {}], max_live=3))
    assert len(reg) == 2
    # No limit.
    asyncio.run(submit(engine, reg, ["x"] * 10, [{}] * 10))
    assert len(reg) == 12


# ---------------------------------------------------------------------------------------- HandleGroup


def test_events_merges_chunks_in_order_and_complete_per_index():
    engine, reg = StubEngine(), RequestRegistry()

    async def main():
        h = make_handles(engine, reg, 3)
        step(h[2], "early")  # published before the group subscribes: delivered first
        group = HandleGroup(h, reg)
        engine_thread([(h[0], "he", None), (h[1], "Ü", None), (h[0], "llo", None), (h[2], "!", FinishReason.STOP),
                       (h[1], "ber", FinishReason.LENGTH), (h[0], "", FinishReason.STOP)])
        return group, await collect(group.events())

    group, events = asyncio.run(main())
    assert by_index(events) == {0: [("he", False), ("llo", False), ("", True)],
                                1: [("Ü", False), ("ber", True)],
                                2: [("early", False), ("!", True)]}
    assert events[0][0] == 2  # the pre-subscription chunk comes first
    assert group.finished == [True, True, True]
    finals = {i: c.output for i, c in events if c.finished}
    assert {i: (o.text, o.finish_reason) for i, o in finals.items()} == {
        0: ("hello", FinishReason.STOP), 1: ("Über", FinishReason.LENGTH), 2: ("early!", FinishReason.STOP)}
    hello = [104, 101, 108, 108, 111]
    assert [c.token_ids for i, c in events if i == 0] == [[104, 101], hello, hello]
    assert len(reg) == 0 and reg.client_aborts == 0 and engine.aborted == []


def test_registry_discards_a_request_on_its_final_chunk_only():
    engine, reg = StubEngine(), RequestRegistry()
    seen = []

    async def main():
        h = make_handles(engine, reg, 2)
        group = HandleGroup(h, reg)
        gate = threading.Semaphore(0)  # lockstep: the engine takes its next step once the loop saw the last
        engine_thread([(h[0], "a", None), gate.acquire, (h[1], "b", None), gate.acquire,
                       (h[0], "c", FinishReason.STOP), gate.acquire, (h[1], "d", FinishReason.STOP)])
        async for i, chunk in group.events():
            seen.append((i, chunk.finished, sorted(reg.ids())))
            gate.release()

    asyncio.run(asyncio.wait_for(main(), BOUND_S))
    # The pump discards on the engine thread, before the chunk reaches the loop.
    assert seen == [(0, False, ["r0", "r1"]), (1, False, ["r0", "r1"]), (0, True, ["r1"]), (1, True, [])]


def test_no_chunk_is_lost_to_the_poll_timeout():
    engine, reg = StubEngine(), RequestRegistry()
    hung_up, receive_times = threading.Event(), []

    async def main():
        h = make_handles(engine, reg, 2)
        group = HandleGroup(h, reg)
        texts = [f"<{k}>" for k in range(12)]
        script = [(h[k % 2], t, None) for k, t in enumerate(texts)]
        script += [(h[0], "end0", FinishReason.STOP), (h[1], "end1", FinishReason.STOP)]
        engine_thread(script, delay=0.012)  # slower than poll_s: the wait times out between chunks
        return await collect(group.events(make_request(hung_up, receive_times), poll_s=0.005))

    events = asyncio.run(main())
    got = by_index(events)
    assert got == {0: [(f"<{k}>", False) for k in range(0, 12, 2)] + [("end0", True)],
                   1: [(f"<{k}>", False) for k in range(1, 12, 2)] + [("end1", True)]}
    assert len(receive_times) >= 3  # it did poll the client meanwhile


def test_peek_then_events_yields_the_first_chunk_once():
    engine, reg = StubEngine(), RequestRegistry()

    async def main():
        h = make_handles(engine, reg, 1)
        group = HandleGroup(h, reg)
        engine_thread([(h[0], "one", None), (h[0], "two", None), (h[0], "three", FinishReason.STOP)])
        first = await asyncio.wait_for(group.peek(), BOUND_S)
        again = await group.peek()
        assert again is first and first[0] == 0 and first[1].text_delta == "one"
        assert group.finished == [False]
        return await collect(group.events())

    events = asyncio.run(main())
    assert [(i, c.text_delta, c.finished) for i, c in events] == [
        (0, "one", False), (0, "two", False), (0, "three", True)]


def test_peek_of_a_final_first_chunk_ends_the_stream():
    """A request that fails at once sends one, final, chunk: peek sees it, events yields it and stops."""
    engine, reg = StubEngine(), RequestRegistry()

    async def main():
        h = make_handles(engine, reg, 1)
        group = HandleGroup(h, reg)
        engine_thread([(h[0], "", FinishReason.ABORT)])
        i, first = await asyncio.wait_for(group.peek(), BOUND_S)
        assert first.finished and first.output.abort_reason is AbortReason.CLIENT and group.finished == [True]
        return await collect(group.events())

    events = asyncio.run(main())
    assert [(i, c.finished) for i, c in events] == [(0, True)]


def test_events_resumes_after_a_partial_read():
    engine, reg = StubEngine(), RequestRegistry()

    async def main():
        h = make_handles(engine, reg, 1)
        group = HandleGroup(h, reg)
        engine_thread([(h[0], "a", None), (h[0], "b", None), (h[0], "c", FinishReason.STOP)])
        await asyncio.wait_for(group.peek(), BOUND_S)
        agen = group.events()
        first = await agen.__anext__()
        await agen.aclose()
        return first, await collect(group.events())

    first, rest = asyncio.run(main())
    assert first[1].text_delta == "a"
    assert [c.text_delta for _, c in rest] == ["b", "c"]  # the peeked chunk is not yielded a second time


def test_disconnect_detected_within_poll_and_only_unfinished_aborted():
    engine, reg = StubEngine(), RequestRegistry()
    hung_up = threading.Event()
    poll_s = 0.05
    got = []

    async def main():
        h = make_handles(engine, reg, 3)
        group = HandleGroup(h, reg)
        engine_thread([(h[0], "x", None), (h[1], "done", FinishReason.STOP), (h[0], "y", None)])
        request = make_request(hung_up)
        t0 = None
        with pytest.raises(ClientDisconnected):
            async for i, chunk in group.events(request, poll_s=poll_s):
                got.append((i, chunk.text_delta))
                if len(got) == 3:  # the engine has gone quiet: the client hangs up
                    await asyncio.sleep(0.02)
                    hung_up.set()
                    t0 = time.monotonic()
        elapsed = time.monotonic() - t0
        group.abort_unfinished()
        return group, h, elapsed

    group, h, elapsed = asyncio.run(asyncio.wait_for(main(), BOUND_S))
    assert elapsed < poll_s + 0.25, elapsed
    assert sorted(got) == [(0, "x"), (0, "y"), (1, "done")]
    assert group.finished == [False, True, False]
    assert engine.aborted == ["r0", "r2"] and reg.client_aborts == 2  # r1 had finished: not aborted


def test_disconnect_is_checked_on_a_clock_even_while_chunks_flow():
    """A fast decode yields a chunk every step: the client is still checked every poll_s, and only then."""
    engine, reg = StubEngine(), RequestRegistry()
    hung_up, receive_times = threading.Event(), []
    poll_s = 0.06
    stop = threading.Event()

    async def main():
        h = make_handles(engine, reg, 1)
        group = HandleGroup(h, reg)

        def flood():
            while not stop.is_set():
                step(h[0], "t")
                time.sleep(0.001)

        threading.Thread(target=flood, daemon=True).start()
        n = 0
        start = time.monotonic()
        try:
            with pytest.raises(ClientDisconnected):
                async for _ in group.events(make_request(hung_up, receive_times), poll_s=poll_s):
                    n += 1
                    if not hung_up.is_set() and time.monotonic() - start >= 3.5 * poll_s:  # after 3 checks
                        hung_up.set()
                        t0 = time.monotonic()
        finally:
            stop.set()
        return n, start, t0, time.monotonic()

    n, start, t0, end = asyncio.run(asyncio.wait_for(main(), BOUND_S))
    assert end - t0 < poll_s + 0.25
    assert n > 30
    # Checked on the clock: about one receive per poll_s, not one per chunk.
    assert len(receive_times) <= (end - start) / poll_s + 2, (len(receive_times), n)
    assert receive_times[0] - start >= poll_s * 0.8  # the first check waits a full poll_s


def test_disconnect_leaves_no_getter_to_swallow_a_chunk():
    engine, reg = StubEngine(), RequestRegistry()
    hung_up = threading.Event()
    hung_up.set()

    async def main():
        h = make_handles(engine, reg, 1)
        group = HandleGroup(h, reg)
        with pytest.raises(ClientDisconnected):
            await collect(group.events(make_request(hung_up), poll_s=0.01))
        engine_thread([(h[0], "late", FinishReason.STOP)])
        return await collect(group.events())

    events = asyncio.run(main())
    assert [(c.text_delta, c.finished) for _, c in events] == [("late", True)]


def test_cancelled_reader_leaves_no_getter_to_swallow_a_chunk():
    engine, reg = StubEngine(), RequestRegistry()

    async def main():
        h = make_handles(engine, reg, 1)
        group = HandleGroup(h, reg)
        reader = asyncio.ensure_future(collect(group.events()))
        await asyncio.sleep(0.02)  # the reader waits for a chunk
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        engine_thread([(h[0], "next", FinishReason.STOP)])
        return await collect(group.events())

    events = asyncio.run(main())
    assert [c.text_delta for _, c in events] == ["next"]


def test_outputs_returns_final_outputs_in_index_order():
    engine, reg = StubEngine(), RequestRegistry()
    hung_up = threading.Event()

    async def main():
        h = make_handles(engine, reg, 3)
        group = HandleGroup(h, reg)
        engine_thread([(h[2], "c", FinishReason.STOP), (h[0], "a", None), (h[1], "b", FinishReason.LENGTH),
                       (h[0], "a", FinishReason.STOP)])
        return await asyncio.wait_for(group.outputs(make_request(hung_up)), BOUND_S)

    outs = asyncio.run(main())
    assert all(isinstance(o, GenerateOutput) for o in outs)
    assert [(o.request_id, o.text, o.finish_reason) for o in outs] == [
        ("r0", "aa", FinishReason.STOP), ("r1", "b", FinishReason.LENGTH), ("r2", "c", FinishReason.STOP)]
    assert engine.aborted == [] and reg.client_aborts == 0 and len(reg) == 0


def test_outputs_aborts_the_unfinished_on_disconnect_within_the_default_poll():
    engine, reg = StubEngine(), RequestRegistry()
    hung_up = threading.Event()

    async def main():
        h = make_handles(engine, reg, 2)
        group = HandleGroup(h, reg)
        engine_thread([(h[1], "fin", FinishReason.STOP), hung_up.set])
        start = time.monotonic()
        with pytest.raises(ClientDisconnected):
            await asyncio.wait_for(group.outputs(make_request(hung_up)), BOUND_S)
        return time.monotonic() - start

    elapsed = asyncio.run(main())
    assert 0.4 <= elapsed < 1.2, elapsed  # the default poll is 0.5 s
    assert engine.aborted == ["r0"] and reg.client_aborts == 1 and reg.ids() == ["r0"]


def test_deliver_after_the_loop_closed_does_not_raise():
    engine, reg = StubEngine(), RequestRegistry()
    holder = {}

    async def main():
        h = make_handles(engine, reg, 2)
        holder["group"] = HandleGroup(h, reg)
        return h

    h = asyncio.run(main())  # the loop is closed on return (a server that shut down)
    assert holder["group"].loop.is_closed()
    errors = []

    def publish():
        try:
            step(h[0], "x", None)
            step(h[1], "y", FinishReason.STOP)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=publish)
    t.start()
    t.join()
    assert errors == []
    assert reg.ids() == ["r0"]  # the final chunk still leaves the registry


# ----------------------------------------------------------------------------------------- stream_guard


async def _sse_body(group: HandleGroup, fail_after: int | None = None):
    n = 0
    async for i, chunk in group.events():
        yield sse({"index": i, "text": chunk.text_delta})
        n += 1
        if fail_after is not None and n == fail_after:
            raise RuntimeError("broken reply")
    yield SSE_DONE


def test_stream_guard_passes_the_body_through_and_aborts_nothing_when_done():
    engine, reg = StubEngine(), RequestRegistry()

    async def main():
        h = make_handles(engine, reg, 2)
        group = HandleGroup(h, reg)
        engine_thread([(h[0], "a", None), (h[0], "b", FinishReason.STOP), (h[1], "c", FinishReason.STOP)])
        return await collect(stream_guard(group, lambda: _sse_body(group)))

    pieces = asyncio.run(main())
    assert pieces[-1] == SSE_DONE
    assert sorted(pieces[:-1]) == sorted(sse({"index": i, "text": t}) for i, t in [(0, "a"), (0, "b"), (1, "c")])
    assert engine.aborted == [] and reg.client_aborts == 0


def test_stream_guard_aborts_unfinished_on_cancellation():
    engine, reg = StubEngine(), RequestRegistry()

    async def main():
        h = make_handles(engine, reg, 3)
        group = HandleGroup(h, reg)
        got = []
        engine_thread([(h[0], "a", None), (h[1], "b", FinishReason.STOP)])

        async def consume():
            async for piece in stream_guard(group, lambda: _sse_body(group)):
                got.append(piece)

        task = asyncio.ensure_future(consume())
        deadline = time.monotonic() + BOUND_S
        while len(got) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        assert engine.aborted == []  # nothing aborted while the client listens
        task.cancel()  # the client went away: starlette cancels the response task
        with pytest.raises(asyncio.CancelledError):
            await task
        return got

    got = asyncio.run(main())
    assert len(got) == 2
    assert engine.aborted == ["r0", "r2"] and reg.client_aborts == 2


def test_stream_guard_aborts_unfinished_on_error():
    engine, reg = StubEngine(), RequestRegistry()

    async def main():
        h = make_handles(engine, reg, 2)
        group = HandleGroup(h, reg)
        engine_thread([(h[1], "b", FinishReason.STOP), (h[0], "a", None)])
        got = []
        with pytest.raises(RuntimeError, match="broken reply"):
            async for piece in stream_guard(group, lambda: _sse_body(group, fail_after=2)):
                got.append(piece)
        return got

    got = asyncio.run(asyncio.wait_for(main(), BOUND_S))
    assert len(got) == 2
    assert engine.aborted == ["r0"] and reg.client_aborts == 1


# ------------------------------------------------------------------------------------------------ SSE


def test_sse_text_is_exact():
    assert sse({"text": "héllo ✓ 日本", "n": [1, None, True]}) == \
        'data: {"text": "héllo ✓ 日本", "n": [1, null, true]}\n\n'
    assert sse("x") == 'data: "x"\n\n'
    assert json.loads(sse({"a": "\n"})[len("data: "):]) == {"a": "\n"}  # newlines escaped: one SSE line
    assert SSE_DONE == "data: [DONE]\n\n"


def test_sse_response_headers_and_body():
    async def body():
        yield sse({"k": "ü"})
        yield SSE_DONE

    response = sse_response(body())
    assert response.media_type == "text/event-stream"
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    sent = []

    async def receive():
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "path": "/generate", "headers": []}
    asyncio.run(asyncio.wait_for(response(scope, receive, send), BOUND_S))
    start = sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"cache-control"] == b"no-cache" and headers[b"x-accel-buffering"] == b"no"
    assert headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    body_bytes = b"".join(m.get("body", b"") for m in sent[1:])
    assert body_bytes.decode() == 'data: {"k": "ü"}\n\ndata: [DONE]\n\n'
