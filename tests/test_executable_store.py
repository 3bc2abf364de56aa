"""The executable store: compiled steps saved under a fingerprint of what they were compiled against and loaded on
the next start; an engine whose planned steps are all stored loads them before its first request and serves the
same greedy tokens without compiling."""

from __future__ import annotations

import errno
import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsgl.engine import executable_store
from jsgl.engine.executable_store import ExecutableStore, prune
from jsgl.engine.model_runner import step_name


@pytest.fixture
def store_root(tmp_path, monkeypatch):
    monkeypatch.setattr(executable_store, "cache_dir", lambda: tmp_path)
    return tmp_path / "executables"


def _lowered(n: int):
    return jax.jit(lambda x: jnp.cumsum(x * 3.0) + 1.0).lower(jax.ShapeDtypeStruct((n,), jnp.float32))


def test_a_stored_executable_loads_and_computes_as_compiled(store_root):
    x = jnp.arange(16, dtype=jnp.float32)
    compiled = ExecutableStore("config-a").compile(_lowered(16), "f16")
    again = ExecutableStore("config-a")
    assert again.holds("f16") and not again.holds("f32")
    loaded = again.load("f16")
    assert loaded is not None and again.loaded == 1
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(compiled(x)))


def test_another_fingerprint_holds_nothing_and_a_broken_file_is_compiled_again(store_root):
    first = ExecutableStore("config-a")
    first.compile(_lowered(8), "f8")
    other = ExecutableStore("config-b")
    assert other.directory != first.directory and other.load("f8") is None
    (first.directory / "f8.bin").write_bytes(b"not an executable")
    assert ExecutableStore("config-a").load("f8") is None


# Each thing a step is compiled against, changed (the module docstring's list): (name, how to change it).
FINGERPRINT_CHANGES = {
    "jsgl sources": lambda mp: mp.setattr(executable_store, "source_digest", lambda: "an edited checkout"),
    "jax version": lambda mp: mp.setattr(jax, "__version__", jax.__version__ + ".post1"),
    "jaxlib version": lambda mp: mp.setattr(executable_store, "_jaxlib_version", lambda: "0.0.0"),
    "devices": lambda mp: mp.setattr(jax, "devices", lambda: [SimpleNamespace(platform="tpu", device_kind="v5e")]),
    "process count": lambda mp: mp.setattr(jax, "process_count", lambda: 1000),  # (no test runs 1000 processes)
    "XLA_FLAGS": lambda mp: mp.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_dump_to=/tmp/x"),
    "host CPU": lambda mp: mp.setattr(executable_store, "cpu_signature", lambda: "another CPU"),
}


@pytest.mark.parametrize("change", sorted(FINGERPRINT_CHANGES))
def test_every_fingerprint_component_changes_the_store_directory(store_root, monkeypatch, change):
    """A step compiled against other sources, jax, devices, processes, XLA flags or CPU is never loaded: each is
    in the fingerprint, so a store under it has a directory of its own."""
    before = ExecutableStore("config-a").directory
    with monkeypatch.context() as patched:
        FINGERPRINT_CHANGES[change](patched)
        assert ExecutableStore("config-a").directory != before
    assert ExecutableStore("config-a").directory == before  # (nothing else in it moved meanwhile)


def test_prune_removes_the_least_recently_used_fingerprints(tmp_path):
    for i, name in enumerate(["old", "middle", "new"]):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "step.bin").write_bytes(b"x" * 1000)
        os.utime(directory, (1000 + i, 1000 + i))
    prune(tmp_path, keep=tmp_path / "old", max_bytes=2000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "old"]  # kept: in use, and the most recent


@pytest.mark.slow
def test_an_engine_loads_its_stored_plan_at_start_and_serves_the_same_tokens(store_root):
    from jsgl.engine.engine import Engine
    from jsgl.engine.request import SamplingParams

    options = dict(max_running_requests=2, chunked_prefill_size=16, kv_cache_gb=0.05, executable_store="on")
    # Plain greedy (the forward's argmax), and through the sampler: a regex mask, a bias with a repetition penalty,
    # seeded sampling with logprobs.
    prompts = ["The capital of France is", "A person as JSON:", "List three colors:", "Once upon a time"]
    params = [SamplingParams(max_new_tokens=6, temperature=0),
              SamplingParams(max_new_tokens=12, temperature=0, regex=r'\{"name": "[A-Z][a-z]{1,8}"\}'),
              SamplingParams(max_new_tokens=6, temperature=0, repetition_penalty=1.3, logit_bias={"11": 2.0}),
              SamplingParams(max_new_tokens=6, temperature=0.8, sampling_seed=3, return_logprob=True)]
    first = Engine(precompile="common", **options)
    try:
        plan = first.runner.planned_signatures("common", 2, 16)
        expected = [out.token_ids for out in first.generate(prompts, params)]
        assert first.runner.store.stored > len(plan) and first.stats()["loaded_from_store"] == 0  # and samplers
    finally:
        first.shutdown()
    second = Engine(precompile="background", **options)  # every shape stored: loaded at start, not in a thread
    try:
        stats = second.stats()
        assert stats["compiled_at_start"] == len(plan) and stats["loaded_from_store"] == first.runner.store.stored
        assert stats["compiled_in_background"] == 0
        assert [out.token_ids for out in second.generate(prompts, params)] == expected
        assert second.stats()["compiled_on_request_path"] == 0
        missing = second.runner.store.directory / f"{step_name(plan[-1])}.bin"
    finally:
        second.shutdown()
    missing.unlink()
    third = Engine(precompile="background", **options)  # the stored shapes load at start, the other in a thread
    try:
        assert third.wait_compiled(timeout=120)
        stats = third.stats()
        assert stats["compiled_at_start"] == len(plan) - 1 and stats["loaded_from_store"] >= len(plan) - 1
        assert stats["compiled_in_background"] == 1 and missing.exists()
    finally:
        third.shutdown()


STORED_ENGINE = dict(max_running_requests=1, chunked_prefill_size=16, kv_cache_gb=0.05, executable_store="on")


def _fill_the_store(options: dict, greedy) -> tuple[list[int], object]:
    """A first engine's greedy tokens, and the store directory it filled."""
    from jsgl.engine.engine import Engine

    first = Engine(precompile="common", **options)
    try:
        return first.generate("The capital of France is", greedy).token_ids, first.runner.store.directory
    finally:
        first.shutdown()


@pytest.mark.slow
def test_a_stored_step_that_fails_to_run_is_dropped_and_compiled(store_root, monkeypatch):
    from jsgl.engine.engine import Engine
    from jsgl.engine.model_runner import ModelRunner
    from jsgl.engine.request import SamplingParams

    options, greedy = STORED_ENGINE, SamplingParams(max_new_tokens=4, temperature=0)
    expected, directory = _fill_the_store(options, greedy)
    run_padding = ModelRunner.run_padding

    def fails_once_loaded(self, signature, compiled):
        if self.store is not None and self.store.loaded:  # as a stored executable missing a kernel would
            self.kv = jax.tree.map(lambda x: x.delete() or x, self.kv)  # the donated pool is gone
            raise RuntimeError("Function wrapped_slice.1 not found")
        return run_padding(self, signature, compiled)

    monkeypatch.setattr(ModelRunner, "run_padding", fails_once_loaded)
    second = Engine(precompile="common", **options)
    try:
        assert second.runner.store is None and not directory.exists()  # dropped, compiled without the store
        assert second.runner.kv_intact()
        assert second.generate("The capital of France is", greedy).token_ids == expected
    finally:
        second.shutdown()


@pytest.mark.slow
def test_an_engine_starts_and_serves_from_a_read_only_store(store_root, monkeypatch):
    from test_cache_security import refuse_writes_under

    from jsgl.engine.engine import Engine
    from jsgl.engine.request import SamplingParams

    options, greedy = STORED_ENGINE, SamplingParams(max_new_tokens=4, temperature=0)
    expected, _ = _fill_the_store(options, greedy)
    refuse_writes_under(monkeypatch, store_root, errno.EROFS)  # as a read-only image of a warm cache would
    second = Engine(precompile="common", **options)
    try:
        assert second.stats()["loaded_from_store"] > 0  # on main, os.utime's EROFS stopped this start
        assert second.generate("The capital of France is", greedy).token_ids == expected
    finally:
        second.shutdown()
