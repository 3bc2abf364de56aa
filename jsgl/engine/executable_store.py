"""Compiled step executables kept on disk, so that a restart's precompile loads a step shape in ~0.04 s
(``jax.experimental.serialize_executable``) instead of tracing, lowering and reading XLA's persistent cache for it
(~0.18 s a shape on CPU; docs/performance.md, "The first run").

A store is one directory per fingerprint: jsgl's sources, jax's version, the devices, the host CPU, ``XLA_FLAGS``
and what the runner compiles against (model and forward config, backends, the pool's and the weights' shapes,
dtypes and placements). Anything that changes a step changes the fingerprint, so a stale executable is never
loaded; the least recently used fingerprints are removed beyond ``MAX_BYTES``.

Only fresh compiles are stored: an executable XLA:CPU loaded from its persistent cache serializes without some of
its kernels (jaxlib 0.10: "Function wrapped_slice.N not found" on its first run). So a step compiled for the
store neither reads that cache (a compile option at its default value gives it a key of its own) nor writes it
(so the key never exists there; a thread-local jax setting), and one that hit the cache all the same
(``jax.monitoring``'s hit event, seen on the compiling thread) is not stored.

A stored file is code this process runs: it is sealed (an HMAC under the user's secret, jsgl/cache_security.py) and
one without a valid tag is removed, never unpickled; a load that kills the process leaves a marker, so the next start
drops that file instead of crashing again. A read-only or full cache loads what it holds and compiles the rest
without storing it, with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import logging
import os
import pickle
import shutil
import threading
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

try:  # a thread-local setting (jax 0.10-0.12); without it the hit check below still keeps the store sound
    from jax._src.config import persistent_cache_min_compile_time_secs as _min_cache_write_secs
except ImportError:  # pragma: no cover
    _min_cache_write_secs = None

from jsgl.cache_security import discard, ensure_private_dir, loading_guard, seal, unseal
from jsgl.kernels.cpu import cpu_signature
from jsgl.paths import cache_dir

log = logging.getLogger("jsgl.engine.executable_store")

MAX_BYTES = 2 << 30  # all fingerprints together; the least recently used go first
# The default value, given explicitly: the same program, but a persistent-cache key of its own (see above).
FRESH_COMPILE_OPTIONS = {"xla_llvm_disable_expensive_passes": False}
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_hits = threading.local()


def _on_event(event: str, **_: Any) -> None:
    if event == _CACHE_HIT_EVENT:
        _hits.count = getattr(_hits, "count", 0) + 1


@functools.cache
def _listen_for_cache_hits() -> None:
    jax.monitoring.register_event_listener(_on_event)


def _jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:  # a source build
        return "unknown"


@functools.cache
def source_digest() -> str:
    """jsgl's own code (Python and the CPU kernels' C++): any edit is a new fingerprint."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cc", ".h")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def abstract(tree: Any) -> str:
    """A pytree's structure with each leaf's shape, dtype and placement."""
    leaves, treedef = jax.tree.flatten(tree)
    return repr((str(treedef), [(x.shape, str(x.dtype), str(getattr(x, "sharding", None))) for x in leaves]))


class ExecutableStore:
    """Serialized executables under one fingerprint (``JSGL_EXECUTABLE_STORE_DIR``, by default
    ``cache_dir()/executables``, ``/<fingerprint>``)."""

    def __init__(self, *parts: object, root: Path | None = None):
        digest = hashlib.sha256()
        devices = [(d.platform, d.device_kind) for d in jax.devices()]
        for part in (source_digest(), jax.__version__, _jaxlib_version(), devices, jax.process_count(),
                     os.environ.get("XLA_FLAGS", ""), cpu_signature(), *parts):
            digest.update(repr(part).encode() + b"\0")
        self.root = root or Path(os.environ.get("JSGL_EXECUTABLE_STORE_DIR") or cache_dir() / "executables")
        self.directory = self.root / digest.hexdigest()[:24]
        self.loaded = self.stored = 0
        self.writable = True  # until a write fails: then compiled steps are not stored (one warning)
        try:
            ensure_private_dir(self.root)
        except OSError as exc:
            self._stop_writing(exc)
        _listen_for_cache_hits()

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}.bin"

    def holds(self, name: str) -> bool:
        return self._path(name).exists()

    def load(self, name: str) -> Any | None:
        """The executable stored as ``name``, or None (not stored, not authentic, or unreadable: it is compiled
        again)."""
        path = self._path(name)
        if not path.exists():
            return None
        with loading_guard(path) as crashed_before:
            if crashed_before:
                discard(path, f"executable store: a process died loading {path}")
                return None
            payload = unseal(path, "executable store: stored executable")
            if payload is None:
                return None
            try:  # authentic: written by this user's jsgl
                compiled = serialize_executable.deserialize_and_load(*pickle.loads(payload))
            except Exception as exc:  # an executable this jax cannot load: recompiled and overwritten
                log.warning("executable store: %s unreadable (%s); compiling it", path, exc)
                return None
        with contextlib.suppress(OSError):  # a read-only cache
            os.utime(self.directory)  # recently used: pruned last
        self.loaded += 1
        return compiled

    def compile(self, lowered: Any, name: str) -> Any:
        """Compile ``lowered`` fresh (not from XLA's persistent cache) and store it as ``name``."""
        hits_before = getattr(_hits, "count", 0)
        unwritten = _min_cache_write_secs(float("inf")) if _min_cache_write_secs is not None \
            else contextlib.nullcontext()
        try:
            with unwritten:
                compiled = lowered.compile(compiler_options=FRESH_COMPILE_OPTIONS)
        except Exception as exc:  # an XLA without that option: compiled as without the store, not stored
            log.info("executable store: compiling %s without the store (%s)", name, exc)
            return lowered.compile()
        if getattr(_hits, "count", 0) == hits_before:
            self._save(name, compiled)
        return compiled

    def forget(self) -> None:
        """Remove this fingerprint's executables (one of them failed to run)."""
        shutil.rmtree(self.directory, ignore_errors=True)

    def _save(self, name: str, compiled: Any) -> None:
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as exc:  # e.g. a backend without serialization: the step still runs, unstored
            log.info("executable store: %s not stored (%s)", name, exc)
            return
        if not self.writable:
            return
        fresh = not self.directory.exists()
        try:
            ensure_private_dir(self.directory)
            seal(self._path(name), blob)  # whole or absent: processes and threads may race
        except OSError as exc:  # a read-only or full cache: the step runs, unstored
            self._stop_writing(exc)
            return
        self.stored += 1
        if fresh:
            prune(self.root, keep=self.directory)

    def _stop_writing(self, exc: OSError) -> None:
        self.writable = False
        log.warning("executable store: cannot write under %s (%s); compiling without storing", self.root, exc)


def prune(root: Path, keep: Path, max_bytes: int = MAX_BYTES) -> None:
    """Remove the least recently used fingerprints until the store fits ``max_bytes`` (``keep`` stays)."""
    entries = []
    for directory in root.iterdir():
        if directory.is_dir():
            size = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
            entries.append((directory.stat().st_mtime, directory, size))
    total = sum(size for _, _, size in entries)
    for _, directory, size in sorted(entries, key=lambda entry: entry[0]):
        if total <= max_bytes:
            break
        if directory != keep:
            shutil.rmtree(directory, ignore_errors=True)
            total -= size
            log.info("executable store: removed %s (least recently used; %.0f MB)", directory.name, size / 1e6)

