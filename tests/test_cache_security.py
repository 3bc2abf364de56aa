"""The on-disk caches run code (issue #66): their directories are this user's alone, what loads code from them is
authenticated first, a load that crashed is not retried at every start, and a read-only or full cache still serves.

Tests run as root, where a chmod'ed directory does not stop writes: a read-only cache is simulated by the os calls
that write under it raising EROFS, a full one by the write raising ENOSPC."""

from __future__ import annotations

import builtins
import errno
import logging
import os
import pickle
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsgl import cache_security
from jsgl.cache_security import load_library, loading_guard, seal, unseal
from jsgl.engine import executable_store
from jsgl.engine.executable_store import ExecutableStore
from jsgl.errors import RefusedError, UnsafeCacheError
from jsgl.kernels import cpu
from jsgl.paths import cache_dir


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("JSGL_CACHE_DIR", str(root))
    monkeypatch.delenv("JSGL_EXECUTABLE_STORE_DIR", raising=False)
    monkeypatch.setattr(executable_store, "cache_dir", cache_dir)  # in case another test module patched it
    return root


def _lowered(n: int):
    return jax.jit(lambda x: jnp.cumsum(x * 3.0) + 1.0).lower(jax.ShapeDtypeStruct((n,), jnp.float32))


class _Planted:
    """A pickle that, unpickled, creates a file: the code a planted executable would run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def _shared_object(tmp_path: Path, source: str, name: str) -> bytes:
    c_file = tmp_path / f"{name}.c"
    c_file.write_text(source)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / f"{name}.so"), str(c_file)], check=True)
    return (tmp_path / f"{name}.so").read_bytes()


def _planted_library(tmp_path: Path, marker: Path) -> bytes:
    """A real shared object whose constructor (run by dlopen) creates ``marker``."""
    source = ('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) '
              f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    return _shared_object(tmp_path, source, "planted")


def test_a_fresh_cache_is_private_and_an_older_jsgls_0755_one_is_narrowed(cache):
    assert cache_dir() == cache and cache.stat().st_mode & 0o777 == 0o700
    seal(cache / "kernels.bin", b"payload")
    assert (cache / "kernels.bin").stat().st_mode & 0o777 == 0o600
    assert (cache / ".secret").stat().st_mode & 0o777 == 0o600 and len((cache / ".secret").read_bytes()) == 32
    os.chmod(cache, 0o755)
    cache_dir()
    assert cache.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("mode", [0o770, 0o757])
def test_a_cache_others_can_write_into_is_refused(cache, mode):
    cache.mkdir()
    os.chmod(cache, mode)
    with pytest.raises(UnsafeCacheError, match="writable by its group or by everyone") as refused:
        cache_dir()
    assert isinstance(refused.value, RefusedError) and not isinstance(refused.value, OSError)


def test_a_cache_owned_by_another_user_is_refused_and_so_are_its_code_subdirectories(cache):
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    cache.mkdir(mode=0o700)
    os.chown(cache, 12345, -1)
    with pytest.raises(UnsafeCacheError, match="belongs to uid 12345"):
        cache_dir()
    os.chown(cache, 0, -1)
    for sub in ("executables", "kernels"):
        (cache / sub).mkdir(mode=0o700)
        os.chown(cache / sub, 12345, -1)
    with pytest.raises(UnsafeCacheError, match="executables"):
        ExecutableStore("config-a")
    with pytest.raises(UnsafeCacheError, match="kernels"):
        cpu._load_library()


def test_a_planted_executable_is_refused_never_unpickled_and_removed(cache, tmp_path, caplog):
    store = ExecutableStore("config-a")
    store.directory.mkdir(parents=True)
    marker = tmp_path / "the-pickle-ran"
    (store.directory / "f8.bin").write_bytes(pickle.dumps(_Planted(marker)))
    with caplog.at_level(logging.WARNING):
        assert store.load("f8") is None
    assert not marker.exists() and not (store.directory / "f8.bin").exists()
    assert "no valid HMAC" in caplog.text
    # Sealed under another user's (or an old) secret: refused the same way.
    seal(store.directory / "f8.bin", pickle.dumps(_Planted(marker)))
    (cache / ".secret").write_bytes(os.urandom(32))
    assert store.load("f8") is None and not marker.exists()


def test_a_stored_executable_sealed_elsewhere_or_flipped_by_one_bit_is_refused(cache):
    store = ExecutableStore("config-a")
    store.compile(_lowered(8), "f8")
    path = store.directory / "f8.bin"
    data = bytearray(path.read_bytes())
    (store.directory / "f16.bin").write_bytes(data)  # authentic bytes, another name
    assert store.load("f16") is None and not (store.directory / "f16.bin").exists()
    data[len(data) // 2] ^= 0x10
    path.write_bytes(data)
    assert store.load("f8") is None and not path.exists()


def test_a_load_that_killed_its_process_drops_the_file_once(cache, caplog):
    store = ExecutableStore("config-a")
    store.compile(_lowered(8), "f8")
    path = store.directory / "f8.bin"
    (store.directory / "f8.bin.loading").touch()  # as a process killed while loading it leaves it
    with caplog.at_level(logging.WARNING):
        assert store.load("f8") is None
    assert "died loading" in caplog.text
    assert not path.exists() and not (store.directory / "f8.bin.loading").exists()
    store.compile(_lowered(8), "f8")  # compiled afresh and stored again: the next start loads it
    again = ExecutableStore("config-a")
    x = jnp.arange(8, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(again.load("f8")(x)), np.cumsum(np.arange(8) * 3.0) + 1.0)
    assert not (store.directory / "f8.bin.loading").exists()


def test_a_marker_held_by_a_live_load_is_waited_for_not_taken_as_a_crash(tmp_path):
    path = tmp_path / "f.bin"
    with loading_guard(path) as crashed:
        assert not crashed and (tmp_path / "f.bin.loading").exists()
    assert not (tmp_path / "f.bin.loading").exists()
    with loading_guard(path) as crashed:
        assert not crashed


def refuse_writes_under(monkeypatch, root: Path, error: int) -> None:
    """os calls that write under ``root`` raise OSError(error) (as root, a chmod'ed directory would not)."""
    under = lambda p: isinstance(p, (str, bytes, os.PathLike)) and os.fsdecode(p).startswith(str(root))

    def failing(real, path_arg=0, when=lambda *a, **k: True):
        def call(*args, **kwargs):
            if under(args[path_arg]) and when(*args, **kwargs):
                raise OSError(error, os.strerror(error), str(args[path_arg]))
            return real(*args, **kwargs)
        return call

    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT
    monkeypatch.setattr(os, "open", failing(os.open, when=lambda p, flags, *a, **k: flags & writes))
    for name in ("mkdir", "utime", "unlink", "rmdir", "replace", "rename", "link", "chmod"):
        monkeypatch.setattr(os, name, failing(getattr(os, name)))


def test_a_read_only_warm_cache_loads_what_it_holds_and_compiles_the_rest_unstored(cache, monkeypatch, caplog):
    ExecutableStore("config-a").compile(_lowered(8), "f8")
    refuse_writes_under(monkeypatch, cache, errno.EROFS)
    store = ExecutableStore("config-a")
    with caplog.at_level(logging.WARNING):
        assert store.load("f8") is not None and store.loaded == 1  # os.utime's EROFS no longer stops the start
        compiled = store.compile(_lowered(16), "f16")
    assert store.stored == 0 and not store.holds("f16") and "compiling without storing" in caplog.text
    x = jnp.arange(16, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(compiled(x)), np.cumsum(np.arange(16) * 3.0) + 1.0)


def test_a_read_only_cold_cache_compiles_unstored(cache, monkeypatch):
    cache.mkdir(mode=0o700)
    refuse_writes_under(monkeypatch, cache, errno.EROFS)
    store = ExecutableStore("config-a")
    assert store.load("f8") is None and store.compile(_lowered(8), "f8") is not None and store.stored == 0


def test_a_full_cache_leaves_no_partial_file_and_compiles_unstored(cache, monkeypatch, caplog):
    store = ExecutableStore("config-a")
    store.compile(_lowered(4), "f4")  # the directory and the secret exist; now the disk fills

    class FullDiskWriter:
        def __init__(self, fd):
            self.file = os.fdopen(fd, "wb")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            self.file.write(data[: len(data) // 2])
            self.file.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full_disk_open(file, mode="r", *args, **kwargs):
        return FullDiskWriter(file) if "w" in mode else builtins.open(file, mode, *args, **kwargs)

    monkeypatch.setattr(cache_security, "open", full_disk_open, raising=False)
    with caplog.at_level(logging.WARNING):
        assert store.compile(_lowered(8), "f8") is not None
    assert store.stored == 1 and not store.holds("f8") and "No space left" in caplog.text
    assert sorted(p.name for p in store.directory.iterdir()) == ["f4.bin"]  # no .tmp


def test_a_planted_kernel_library_is_refused_never_loaded(cache, tmp_path, monkeypatch, caplog):
    marker = tmp_path / "the-constructor-ran"
    _, key = cpu._build_command()
    planted = cache / "kernels" / f"jsgl_cpu_{key}.so"
    planted.parent.mkdir(parents=True, mode=0o700)
    planted.write_bytes(_planted_library(tmp_path, marker))

    def no_build(command, scratch_parent):  # the real build takes a minute: a failing compiler instead
        raise RuntimeError("no compiler in this test")

    monkeypatch.setattr(cpu, "_build", no_build)
    monkeypatch.setattr(cpu, "_status", {})
    with caplog.at_level(logging.WARNING):
        assert not cpu.available()
    assert not marker.exists() and not planted.exists() and "no valid HMAC" in caplog.text


def test_a_sealed_library_loads_from_its_verified_bytes(cache, tmp_path):
    library = _shared_object(tmp_path, "int jsgl_answer(void) { return 42; }\n", "answer")
    path = cache / "kernels" / "jsgl_cpu_test.so"
    path.parent.mkdir(parents=True, mode=0o700)
    seal(path, library)
    payload = unseal(path, "library")
    assert payload == library and load_library(payload, path.parent).jsgl_answer() == 42
    assert sorted(p.name for p in path.parent.iterdir()) == ["jsgl_cpu_test.so"]  # the scratch copy is gone


def test_a_secret_others_can_read_is_refused(cache):
    seal(cache / "x.bin", b"payload")
    os.chmod(cache / ".secret", 0o644)
    with pytest.raises(UnsafeCacheError, match="remove it"):
        unseal(cache / "x.bin", "x")


def test_fsm_index_files_are_private_and_a_failed_write_leaves_nothing(cache, monkeypatch, caplog):
    from test_fsm_index_unit import index_for

    from jsgl.fsm import cache as fsm_cache
    from jsgl.fsm.token_index import TokenIndex

    index = index_for("ab|cd")
    fsm_cache._save(index, "k1")
    mode = lambda path: path.stat().st_mode & 0o777
    assert mode(cache / "fsm") == 0o700 and mode(cache / "fsm" / "k1.npz") == 0o600

    def full_disk(self, file, joined, offsets):
        file.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(TokenIndex, "_write", full_disk)
    with caplog.at_level(logging.WARNING):
        fsm_cache._save(index, "k2")  # served, not cached
    assert sorted(p.name for p in (cache / "fsm").iterdir()) == ["k1.npz"] and "could not write" in caplog.text
