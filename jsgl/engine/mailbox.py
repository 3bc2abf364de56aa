"""What crosses the engine's thread boundary: new requests, aborts, cache flushes and shutdown.

Callers' threads post here (``Engine``); the engine thread takes everything posted in one go at the top of each
loop iteration (``EngineLoop``). The live requests are indexed by id here too, under the same lock: an id is
unique among them, and an abort finds its request by it.
"""

from __future__ import annotations

import dataclasses
import threading

from jsgl.engine.request import InvalidRequestError
from jsgl.engine.sequence import Sequence


@dataclasses.dataclass
class FlushRequest:
    """A caller waiting for the prefix cache to be emptied; ``ok`` is False when requests were running."""

    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    ok: bool = False


@dataclasses.dataclass
class Delivery:
    """Everything posted since the engine thread last took: handled in this order."""

    requests: list[Sequence]
    flushes: list[FlushRequest]
    aborts: set[str]
    stopped: bool


class Mailbox:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: list[Sequence] = []
        self._aborts: set[str] = set()
        self._flushes: list[FlushRequest] = []
        self._stopped = False
        self._live: dict[str, Sequence] = {}  # every request posted and not yet retired
        self._wake = threading.Event()

    # -------------------------------------------------------------------------- callers' threads
    def post(self, seqs: list[Sequence]) -> None:
        """Hand requests to the engine thread, all or none. Raises when the engine is shut down, or when an id is
        already live or repeated (checked under the lock: two requests never share an id)."""
        with self._lock:
            if self._stopped:
                raise RuntimeError("the engine is shut down")
            rids = [seq.rid for seq in seqs]
            taken = [r for r in rids if r in self._live] or sorted({r for r in rids if rids.count(r) > 1})
            if taken:
                raise InvalidRequestError(f"request id {taken[0]!r} is already in use")
            self._requests.extend(seqs)
            self._live.update((seq.rid, seq) for seq in seqs)
        self._wake.set()

    def abort(self, rid: str) -> None:
        with self._lock:
            self._aborts.add(rid)
        self._wake.set()

    def flush(self, timeout: float) -> bool:
        """Ask the engine thread to empty the prefix cache and wait; refused (False) while requests are queued."""
        request = FlushRequest()
        with self._lock:
            if self._requests:
                return False
            self._flushes.append(request)
        self._wake.set()
        request.done.wait(timeout)
        return request.ok

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        self._wake.set()

    def queued(self) -> bool:
        """Requests posted that the engine thread has not taken yet."""
        return self.num_queued() > 0

    def num_queued(self) -> int:
        """How many requests were posted that the engine thread has not taken yet."""
        with self._lock:
            return len(self._requests)

    def get(self, rid: str) -> Sequence | None:
        with self._lock:
            return self._live.get(rid)

    def wake(self) -> None:
        self._wake.set()

    # ------------------------------------------------------------------------------ engine thread
    def take(self) -> Delivery:
        with self._lock:
            delivery = Delivery(self._requests, self._flushes, self._aborts, self._stopped)
            self._requests, self._flushes, self._aborts = [], [], set()
        return delivery

    def has_news(self) -> bool:
        """Something posted that would change the next step's batch (an overlapped step is not dispatched then)."""
        with self._lock:
            return bool(self._requests or self._aborts or self._flushes or self._stopped)

    def wait(self, timeout: float) -> None:
        self._wake.wait(timeout=timeout)
        self._wake.clear()

    def retire(self, rid: str) -> None:
        with self._lock:
            self._live.pop(rid, None)

    def untaken_or_live(self) -> tuple[list[Sequence], list[Sequence]]:
        """(requests posted and not taken, every live request): a failed step's orphans are live ones in no queue."""
        with self._lock:
            return list(self._requests), list(self._live.values())
