"""Keeping jsgl's on-disk caches its own user's: what it loads from them (pickled executables, the CPU kernels' shared
library) is code it runs.

* Directories are created 0700 (files 0600); an existing one owned by another user, or writable by its group or by
  everyone, is refused (:class:`~jsgl.errors.UnsafeCacheError`); one of ours readable by others is narrowed to 0700.
* What runs code is sealed: written with an HMAC-SHA256 of its bytes and its place (``<dir>/<name>``) under a
  per-user secret, ``cache_dir()/.secret`` (32 bytes of ``os.urandom``, 0600, made on first use). A file without a
  valid tag (planted, corrupt, or from a jsgl before sealing) is removed with a warning and never loaded.
* :func:`loading_guard`: a marker held while a sealed file loads, so a load that kills the process drops the file at
  the next start instead of crashing every start.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import hmac
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from jsgl.errors import UnsafeCacheError

log = logging.getLogger("jsgl.cache_security")

MAGIC = b"JSGLMAC1"  # a sealed file: MAGIC, the 32-byte tag, then the payload
TAG_BYTES = 32
SECRET_NAME = ".secret"


def ensure_private_dir(path: Path) -> Path:
    """``path``, created 0700 if absent (its parents as the umask makes them), or checked if present: owned by this
    user and writable by no one else (else UnsafeCacheError). A directory that cannot be created raises OSError."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:  # a read-only file system may answer EROFS for a directory that exists
        if not path.is_dir():
            raise
    check_private(path)
    return path


def check_private(path: Path) -> None:
    """Refuse a cache directory another user could write into (and so make jsgl run their code)."""
    st = path.stat()
    if st.st_uid != os.geteuid():
        raise UnsafeCacheError(f"the jsgl cache directory {path} belongs to uid {st.st_uid}, not to this user "
                               f"(uid {os.geteuid()}); it holds code jsgl runs: chown it to yourself, or set "
                               f"JSGL_CACHE_DIR to a directory of your own")
    if st.st_mode & 0o022:
        raise UnsafeCacheError(f"the jsgl cache directory {path} is writable by its group or by everyone (mode "
                               f"{st.st_mode & 0o777:o}); it holds code jsgl runs: chmod 700 it, or set "
                               f"JSGL_CACHE_DIR to a directory of your own")
    if st.st_mode & 0o077:  # made by an older jsgl (0755): it holds clients' regexes too
        with contextlib.suppress(OSError):
            os.chmod(path, 0o700)


def write_private(path: Path, data: bytes) -> None:
    """``data`` into ``path`` (0600), whole or not at all: written aside, then renamed (processes may race). On an
    OSError (read-only, full) the partial file is removed and the error raised."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
            out.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise


def _secret_path() -> Path:
    from jsgl.paths import cache_dir  # paths imports this module

    return cache_dir() / SECRET_NAME


def secret(create: bool = False) -> bytes | None:
    """This user's sealing key; None if there is none and ``create`` is False. Creating it may raise OSError."""
    path = _secret_path()
    try:
        with open(path, "rb") as file:
            st = os.fstat(file.fileno())
            key = file.read()
    except FileNotFoundError:
        return _create_secret(path) if create else None
    if st.st_uid != os.geteuid() or st.st_mode & 0o077 or len(key) != TAG_BYTES:
        raise UnsafeCacheError(f"{path} (the key that authenticates jsgl's cached code) is not this user's "
                               f"private {TAG_BYTES}-byte file (mode {st.st_mode & 0o777:o}, uid {st.st_uid}, "
                               f"{len(key)} bytes): remove it (jsgl makes a new one and recompiles what it caches)")
    return key


def _create_secret(path: Path) -> bytes | None:
    temporary = path.with_name(f"{SECRET_NAME}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
            out.write(os.urandom(TAG_BYTES))
        with contextlib.suppress(FileExistsError):  # another process made one first: both use that one
            os.link(temporary, path)
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink()
    return secret()


def _tag(key: bytes, path: Path, payload: bytes) -> bytes:
    # The place is signed too: a sealed file moved to another name or fingerprint does not load there.
    place = f"{path.parent.name}/{path.name}".encode()
    return hmac.new(key, place + b"\0" + payload, hashlib.sha256).digest()


def seal(path: Path, payload: bytes) -> None:
    """Write ``payload`` to ``path`` with its tag (0600, atomically). OSError where the cache is not writable."""
    key = secret(create=True)
    write_private(path, MAGIC + _tag(key, path, payload) + payload)


def unseal(path: Path, what: str) -> bytes | None:
    """The payload of the sealed file ``path``; None if absent, or if not authentic (then removed, with a warning
    naming ``what`` it should have been)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    key = secret()
    head, tag, payload = data[:len(MAGIC)], data[len(MAGIC):len(MAGIC) + TAG_BYTES], data[len(MAGIC) + TAG_BYTES:]
    if key is not None and head == MAGIC and hmac.compare_digest(tag, _tag(key, path, payload)):
        return payload
    discard(path, f"{what} {path} has no valid HMAC (planted, corrupt, or written by an older jsgl)")
    return None


def discard(path: Path, reason: str) -> None:
    """Remove a cached file jsgl will not load (a read-only cache keeps it; it is refused again next time)."""
    try:
        path.unlink(missing_ok=True)
        log.warning("%s: removed, not loaded", reason)
    except OSError as exc:
        log.warning("%s: not loaded (and not removed: %s)", reason, exc)


@contextlib.contextmanager
def loading_guard(path: Path) -> Iterator[bool]:
    """Hold ``<path>.loading`` while ``path`` loads; yields True where a process died loading it (a marker left,
    unlocked: drop the file). A load under way in another process is waited for (the marker is flock'ed). Without
    a writable cache the load goes on unguarded (yields False)."""
    marker = path.with_name(path.name + ".loading")
    try:
        fd, left_over = _take_marker(marker)
    except OSError as exc:
        log.warning("cannot mark %s as loading (%s): a crash while loading it would recur at each start", path, exc)
        yield False
        return
    try:
        yield left_over
    finally:
        with contextlib.suppress(OSError):
            marker.unlink()  # before the lock goes: a waiting process then sees a finished load, not a crash
        os.close(fd)


def _take_marker(marker: Path) -> tuple[int, bool]:
    while True:
        try:
            return _locked(os.open(marker, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)), False
        except FileExistsError:
            pass
        try:
            fd = os.open(marker, os.O_RDWR)
        except FileNotFoundError:  # removed meanwhile by a finished load: try again
            continue
        _locked(fd)
        with contextlib.suppress(FileNotFoundError):
            if os.fstat(fd).st_ino == os.stat(marker).st_ino:  # still there once its holder is gone: it crashed
                return fd, True
        os.close(fd)


def _locked(fd: int) -> int:
    fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel when the holder dies, however it dies
    return fd


def load_library(payload: bytes, scratch_parent: Path | None) -> ctypes.CDLL:
    """dlopen a shared library from verified bytes. dlopen reads its file again after the check (a TOCTOU window),
    so the verified bytes themselves are written into a fresh 0700 directory of ours (under ``scratch_parent``,
    else the system's temporary directory) and loaded from there: what runs is what was checked."""
    try:
        scratch = tempfile.mkdtemp(prefix="load-", dir=scratch_parent)
    except OSError:  # a read-only cache
        scratch = tempfile.mkdtemp(prefix="jsgl-load-")
    try:
        library = Path(scratch) / "library.so"
        with open(os.open(library, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
            out.write(payload)
        return ctypes.CDLL(str(library))  # mapped: the file can go
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
