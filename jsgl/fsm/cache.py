"""Getting a TokenIndex: memory cache -> disk cache -> build, with builds on a background pool.

Keys combine the regex, the vocabulary fingerprint (hash of every token's bytes, so two tokenizer
objects with the same vocab share entries and a changed vocab never hits a stale file) and the
padded vocab size. Concurrent requests for the same regex share one in-flight Future, so a burst
of identical JSON-schema requests compiles once while the engine keeps stepping other requests.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from jsgl.fsm.regex_fsm import compile_regex
from jsgl.fsm.token_index import FORMAT_VERSION, TokenIndex, build_token_index
from jsgl.fsm.vocab import vocab_bytes
from jsgl.model.registry import cache_dir

log = logging.getLogger(__name__)

MEMORY_ENTRIES = 64  # keep the recently used indexes...
MEMORY_BYTES = 512 << 20  # ...within this budget (a nested JSON schema index is ~10 MB)

_memory: OrderedDict[str, TokenIndex] = OrderedDict()
_inflight: dict[str, Future[TokenIndex]] = {}
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            # Two workers: builds are numpy-heavy (release the GIL in the gathers) and the host
            # also runs the engine loop; more threads would only fight over the cores.
            _pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="jsgl-fsm")
        return _pool


def disk_cache_enabled() -> bool:
    return os.environ.get("JSGL_FSM_DISK_CACHE", "1") not in ("0", "false", "no")


def index_key(regex: str, tokenizer: Any, vocab_size: int | None = None) -> str:
    fp = vocab_bytes(tokenizer).fingerprint
    payload = f"v{FORMAT_VERSION}\x00{fp}\x00{vocab_size or 0}\x00{regex}"
    return hashlib.sha256(payload.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def _disk_path(key: str) -> Path:
    return cache_dir() / "fsm" / f"{key}.npz"


def _build(regex: str, tokenizer: Any, vocab_size: int | None, key: str) -> TokenIndex:
    if disk_cache_enabled():
        path = _disk_path(key)
        if path.exists():
            try:
                index = TokenIndex.load(path)
                if index.pattern == regex:
                    return index
            except Exception as e:  # a corrupt/old file is just a cache miss
                log.warning("ignoring unreadable FSM cache file %s: %s", path, e)
    t0 = time.perf_counter()
    fsm = compile_regex(regex)
    index = build_token_index(fsm, vocab_bytes(tokenizer), vocab_size)
    index.build_seconds = time.perf_counter() - t0
    log.info("built FSM index for %d-char regex: %d states in %.3fs", len(regex), index.num_states,
             index.build_seconds)
    if disk_cache_enabled():
        try:
            path = _disk_path(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            index.save(path)
        except OSError as e:
            log.warning("could not write FSM cache file: %s", e)
    return index


def _remember(key: str, index: TokenIndex) -> None:
    with _lock:
        _memory[key] = index
        _memory.move_to_end(key)
        total = sum(i.nbytes for i in _memory.values())
        while len(_memory) > 1 and (len(_memory) > MEMORY_ENTRIES or total > MEMORY_BYTES):
            total -= _memory.popitem(last=False)[1].nbytes


def get_index_async(regex: str, tokenizer: Any, vocab_size: int | None = None) -> Future[TokenIndex]:
    """Future of the index for `regex` over `tokenizer`'s vocabulary (bitmask padded to
    `vocab_size` if larger). Invalid regexes resolve the Future with InvalidRequestError; call
    `validate_regex` first to reject them synchronously."""
    key = index_key(regex, tokenizer, vocab_size)
    with _lock:
        hit = _memory.get(key)
        if hit is not None:
            _memory.move_to_end(key)
            done: Future[TokenIndex] = Future()
            done.set_result(hit)
            return done
        pending = _inflight.get(key)
        if pending is not None:
            return pending

    def job() -> TokenIndex:
        try:
            index = _build(regex, tokenizer, vocab_size, key)
            _remember(key, index)
            return index
        finally:
            with _lock:
                _inflight.pop(key, None)

    pool = _executor()
    with _lock:
        pending = _inflight.get(key)  # another thread may have started it meanwhile
        if pending is not None:
            return pending
        fut = pool.submit(job)
        _inflight[key] = fut
    return fut


def get_index(regex: str, tokenizer: Any, vocab_size: int | None = None) -> TokenIndex:
    """Blocking variant of get_index_async (raises InvalidRequestError for bad regexes)."""
    return get_index_async(regex, tokenizer, vocab_size).result()


def clear_memory_cache() -> None:
    with _lock:
        _memory.clear()
