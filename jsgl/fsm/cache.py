"""Getting a TokenIndex: memory cache -> disk cache -> build, with builds on a budgeted background queue.

Keys combine the regex, the vocabulary fingerprint (hash of every token's bytes, so two tokenizer
objects with the same vocab share entries and a changed vocab never hits a stale file) and the
padded vocab size. Concurrent requests for the same regex share one in-flight Future, so a burst
of identical JSON-schema requests compiles once while the engine keeps stepping other requests.
Each caller holds the shared build until it calls `release_index`; when no holder is left the
build is cancelled (see build_queue) and nothing is cached.

Builds run under a BuildBudget (budget.py): they are statically checked before being queued, and
stop with ConstraintBudgetError when they grow past it; only builds within budget are cached. The
disk cache (cache_dir()/fsm/*.npz) keeps at most JSGL_FSM_DISK_CACHE_BYTES (default 1 GiB),
evicting the least recently used files (a load touches the file's mtime). The files are plain arrays, loaded
with ``allow_pickle=False`` (no code runs), 0600 in a 0700 directory; a read-only or full disk skips the write.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jsgl.cache_security import ensure_private_dir
from jsgl.errors import InvalidRequestError, UnsafeCacheError
from jsgl.fsm.budget import DEFAULT_BUDGET, BuildBudget, BuildGuard, BuildPreempted
from jsgl.fsm.build_process import build_in_child, worker_process
from jsgl.fsm.build_queue import BuildJob, BuildQueue
from jsgl.fsm.regex_fsm import regex_cost
from jsgl.fsm.token_index import FORMAT_VERSION, TokenIndex
from jsgl.fsm.vocab import vocab_bytes
from jsgl.paths import cache_dir

log = logging.getLogger(__name__)

MEMORY_ENTRIES = 64  # keep the recently used indexes...
MEMORY_BYTES = 512 << 20  # ...within this budget (a nested JSON schema index is ~10 MB)
DISK_BYTES = 1 << 30  # default disk quota: ~100 typical schema indexes, 8 of the largest allowed

_memory: OrderedDict[str, TokenIndex] = OrderedDict()
_lock = threading.Lock()
_queue: BuildQueue | None = None


def disk_cache_enabled() -> bool:
    return os.environ.get("JSGL_FSM_DISK_CACHE", "1") not in ("0", "false", "no")


def disk_quota() -> int:
    """Bytes the disk cache may hold (env JSGL_FSM_DISK_CACHE_BYTES)."""
    raw = os.environ.get("JSGL_FSM_DISK_CACHE_BYTES")
    try:
        return max(int(raw), 0) if raw else DISK_BYTES
    except ValueError:
        log.warning("ignoring JSGL_FSM_DISK_CACHE_BYTES=%r (not an integer)", raw)
        return DISK_BYTES


def index_key(regex: str, tokenizer: Any, vocab_size: int | None = None) -> str:
    fp = vocab_bytes(tokenizer).fingerprint
    payload = f"v{FORMAT_VERSION}\x00{fp}\x00{vocab_size or 0}\x00{regex}"
    return hashlib.sha256(payload.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def _disk_path(key: str) -> Path:
    return cache_dir() / "fsm" / f"{key}.npz"


def _load(regex: str, key: str) -> TokenIndex | None:
    path = _disk_path(key)
    if not path.exists():
        return None
    try:
        index = TokenIndex.load(path)
    except Exception as e:  # a corrupt/old file is just a cache miss
        log.warning("ignoring unreadable FSM cache file %s: %s", path, e)
        return None
    if index.pattern != regex:
        return None
    try:
        os.utime(path)  # LRU: eviction goes by mtime
    except OSError:
        pass
    return index


def _save(index: TokenIndex, key: str) -> None:
    quota = disk_quota()
    approx = index.nbytes + 4 * (len(index.pattern) + sum(len(s) for s in index.jump_strings))
    if approx > quota:
        log.info("not caching a %d MB FSM index on disk (quota %d MB)", approx >> 20, quota >> 20)
        evict_disk_cache(quota)  # the quota may have shrunk since the last write
        return
    try:
        path = _disk_path(key)
        ensure_private_dir(path.parent)  # 0700: the files hold clients' regexes
        index.save(path)
    except (OSError, UnsafeCacheError) as e:  # read-only, full, or not ours: served, not cached
        log.warning("could not write FSM cache file: %s", e)
        return
    evict_disk_cache(quota)


def evict_disk_cache(quota: int | None = None) -> None:
    """Delete the least recently used index files until the folder holds at most `quota` bytes."""
    quota = disk_quota() if quota is None else quota
    files: list[tuple[float, int, Path]] = []
    for p in (cache_dir() / "fsm").glob("*.npz"):
        try:
            st = p.stat()
        except OSError:  # evicted by another process meanwhile
            continue
        files.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in files)
    for _, size, p in sorted(files):
        if total <= quota:
            break
        try:
            p.unlink()
        except OSError:
            pass
        total -= size


def _build(regex: str, tokenizer: Any, vocab_size: int | None, key: str, guard: BuildGuard) -> TokenIndex:
    if disk_cache_enabled():
        index = _load(regex, key)
        if index is not None:
            return index
    index = build_in_child(regex, vocab_bytes(tokenizer), vocab_size, guard.budget, guard)
    log.info("built FSM index for %d-char regex: %d states, %.1f MB in %.3fs", len(regex), index.num_states,
             index.nbytes / 1e6, index.build_seconds)
    # Released meanwhile: do not cache what nobody asked for any more. (Not guard.check(): the time limit
    # is the child's CPU, which it kept to; the parent's clock also counted the wait for a core.)
    guard.check_cancelled()
    if disk_cache_enabled():
        _save(index, key)
    return index


def _remember(key: str, index: TokenIndex) -> None:
    with _lock:
        _memory[key] = index
        _memory.move_to_end(key)
        total = sum(i.nbytes for i in _memory.values())
        while len(_memory) > 1 and (len(_memory) > MEMORY_ENTRIES or total > MEMORY_BYTES):
            total -= _memory.popitem(last=False)[1].nbytes


def _resolved(result: TokenIndex | None = None, error: BaseException | None = None) -> Future[TokenIndex]:
    fut: Future[TokenIndex] = Future()
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)  # type: ignore[arg-type]
    return fut


@dataclass(eq=False)
class _InFlight:
    key: str
    job: BuildJob
    holders: int = 1  # get_index_async calls not yet matched by release_index


_inflight: dict[str, _InFlight] = {}
_by_future: dict[Future, _InFlight] = {}


def get_index_async(regex: str, tokenizer: Any, vocab_size: int | None = None,
                    budget: BuildBudget | None = None) -> Future[TokenIndex]:
    """Future of the index for `regex` over `tokenizer`'s vocabulary (bitmask padded to
    `vocab_size` if larger), built within `budget` (default DEFAULT_BUDGET).

    The Future fails with InvalidRequestError for a bad or unsatisfiable regex and with
    ConstraintBudgetError (a subclass) for one over budget; call `validate_regex` first to reject
    those that a static check can catch synchronously. Raises OverloadedError (synchronously) when
    budget.max_queued builds are already waiting. Every call holds the returned (possibly shared)
    Future until `release_index(future)`; a build with no holder left is cancelled. Concurrent
    callers of the same regex share the first caller's build, and so its budget.
    """
    budget = budget or DEFAULT_BUDGET
    key = index_key(regex, tokenizer, vocab_size)
    with _lock:
        if (hit := _shared(key)) is not None:
            return hit
    try:
        cost = regex_cost(regex, budget)  # outside the lock: parsing a long pattern takes milliseconds
    except InvalidRequestError as e:
        return _resolved(error=e)
    if disk_cache_enabled() and _disk_path(key).exists():
        cost = 0  # a load, not a build: take it first, on any lane

    def build(guard: BuildGuard) -> TokenIndex:
        try:
            index = _build(regex, tokenizer, vocab_size, key, guard)
        except BuildPreempted:
            raise  # re-queued: still in flight
        except BaseException:
            _finished(entry)
            raise
        _remember(key, index)  # before leaving _inflight, so a new caller finds it in one or the other
        _finished(entry)
        return index

    entry = _InFlight(key, BuildJob(cost, budget, build))
    with _lock:
        if (hit := _shared(key)) is not None:  # another thread started it meanwhile
            return hit
        _build_queue().submit(entry.job)  # raises OverloadedError
        _inflight[key] = entry
        _by_future[entry.job.future] = entry
    return entry.job.future


def _shared(key: str) -> Future[TokenIndex] | None:
    """(Under _lock.) A memory hit, or the in-flight build of `key` with one more holder."""
    hit = _memory.get(key)
    if hit is not None:
        _memory.move_to_end(key)
        return _resolved(hit)
    entry = _inflight.get(key)
    if entry is None:
        return None
    entry.holders += 1
    return entry.job.future


def _build_queue() -> BuildQueue:
    """(Under _lock.) The process-wide queue, started on first use."""
    global _queue
    if _queue is None:
        _queue = BuildQueue(on_worker_start=worker_process)
    return _queue


def start_build_workers() -> None:
    """Start the build queue and its worker processes now (an engine does this when it starts, so the
    first constrained request does not wait ~0.5 s for them)."""
    with _lock:
        _build_queue()


def _finished(entry: _InFlight) -> None:
    with _lock:
        if _inflight.get(entry.key) is entry:
            del _inflight[entry.key]
        _by_future.pop(entry.job.future, None)


def release_index(future: Future[TokenIndex]) -> None:
    """The caller no longer needs `future` (from get_index_async). When every caller holding a
    shared build has released it, the build is cancelled: a queued one is dropped, a running one
    stops at its next budget check (within milliseconds) and caches nothing, and the Future is
    cancelled (`future.cancelled()`; `result()` raises concurrent.futures.CancelledError).
    Releasing a finished Future, or one more time than it was obtained, does nothing."""
    with _lock:
        entry = _by_future.get(future)
        if entry is None or future.done():
            return
        entry.holders -= 1
        if entry.holders > 0:
            return
        del _by_future[future]
        if _inflight.get(entry.key) is entry:
            del _inflight[entry.key]  # a new request for the same regex starts afresh
    entry.job.cancel()


def build_stats() -> dict[str, int]:
    """{"queued": builds waiting for a worker, "running": builds on a worker}."""
    with _lock:
        queue = _queue
    return queue.stats() if queue is not None else {"queued": 0, "running": 0}


def get_index(regex: str, tokenizer: Any, vocab_size: int | None = None,
              budget: BuildBudget | None = None) -> TokenIndex:
    """Blocking variant of get_index_async (raises InvalidRequestError / ConstraintBudgetError)."""
    return get_index_async(regex, tokenizer, vocab_size, budget).result()


def clear_memory_cache() -> None:
    with _lock:
        _memory.clear()
