"""Shared fixtures: one engine and one transformers reference model per test session (both are slow to build)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every compiled program into XLA's persistent cache, not only those past 0.5 s: many engines of a session (and
# the commands test_cli starts) compile the same small programs (7% of two slow modules' compile time).
os.environ.setdefault("JSGL_JAX_CACHE_MIN_SECS", "0")
# Engines compile as before (XLA's persistent cache; executable_store auto = off); test_executable_store's: on.
os.environ.setdefault("JSGL_EXECUTABLE_STORE", "off")


# What jsgl builds from its own code (FSM indexes, the CPU kernels, params checkpoints padded and cast for an
# engine): built afresh in each test session.
PER_SESSION_CACHES = frozenset({"fsm", "kernels", "checkpoints"})


def _session_cache_dir() -> tuple[Path, Path]:
    """A per-session JSGL_CACHE_DIR (inherited by the servers and commands tests start), so FSM indexes, CPU
    kernels and engines' params checkpoints are built by the code under test, never loaded from what older code
    left behind. Everything else stays shared with the user's cache, linked in: the converted model weights
    (models/: a 0.5 GB orbax checkpoint, ~7 s to convert, keyed by the GGUF file's identity and
    jsgl.model.checkpoint.FORMAT), XLA's compilation cache (jax/, keyed by the program) and third-party
    installs (the sglang client); what a session adds there moves to the shared cache at the end."""
    shared = Path(os.environ.get("JSGL_CACHE_DIR") or Path.home() / ".cache" / "jsgl")
    (shared / "models").mkdir(parents=True, exist_ok=True)
    session = Path(tempfile.mkdtemp(prefix="jsgl-test-cache-"))
    for entry in shared.iterdir():
        # .secret: the key the shared executable store's files are sealed with (jsgl/cache_security.py)
        if entry.name not in PER_SESSION_CACHES and (not entry.name.startswith(".") or entry.name == ".secret"):
            (session / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    os.environ["JSGL_CACHE_DIR"] = str(session)
    return session, shared


SESSION_CACHE_DIR, SHARED_CACHE_DIR = _session_cache_dir()

# Tests that load the model (through these fixtures) take seconds each: `pytest -m "not slow"` skips them
# for a quick loop; CI runs everything.
# test_cli's `results` runs `jsgl` commands that load it (its parser checks are quick).
MODEL_FIXTURES = frozenset({"engine", "hf_model", "server", "http", "oai", "runtime", "solo", "results"})
# Modules that build their own engines, servers or reference models.
SLOW_MODULES = frozenset({"test_radix_engine", "test_lang", "test_loader", "test_tensor_parallel",
                          "test_server_launch", "test_model", "test_cpu_kernels", "test_soak", "test_engine",
                          "test_constrained_engine", "test_openai_tools",
                          "test_grammar_backend", "test_sglang_client", "test_model_families",
                          "test_schedule_policies", "test_precompile", "test_memory", "test_gpu_lowering", "test_hub"})


def pypi_reachable() -> bool:
    """Whether PyPI answers (tests that install or resolve from it skip without it)."""
    import socket

    try:
        with socket.create_connection(("pypi.org", 443), timeout=5):
            return True
    except OSError:
        return False


QUICK = False  # the quick loop (-m "not slow"): set before the test modules are imported


def pytest_configure(config: pytest.Config) -> None:
    global QUICK
    QUICK = "not slow" in (config.getoption("markexpr") or "")


def examples(n: int) -> int:
    """Hypothesis examples of a state machine: all of them in the full suite (CI), a quarter in the quick
    loop, which keeps `pytest -m "not slow"` under a minute."""
    return max(n // 4, 10) if QUICK else n


# The end-to-end runs CI's command leaves out (`-m "not heavy"`; `pytest -m heavy` runs them): every `jsgl` command
# and benchmark (test_cli's `results`), the notebooks, the TPU benchmark's smoke part, pip's resolution of the
# accelerator extras, replicas on a Ray cluster of their own. On a 2-core AVX2 machine they were ~27 of the suite's
# ~85 minutes, which with the install and the Python 3.12 job passed CI's 90 (docs/reproducing.md).
HEAVY_FIXTURES = frozenset({"results"})
HEAVY_MODULES = frozenset({"test_install", "test_ray_cluster"})
HEAVY_TESTS = frozenset({"test_the_notebook_runs_top_to_bottom", "test_tpu_part_at_smoke_size"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(item, "module", None)
        module_name = module.__name__.rsplit(".", 1)[-1] if module is not None else ""
        fixtures = set(getattr(item, "fixturenames", ()))
        name = getattr(item, "originalname", item.name)  # (without its parameters)
        if MODEL_FIXTURES & fixtures or module_name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        if HEAVY_FIXTURES & fixtures or module_name in HEAVY_MODULES or name in HEAVY_TESTS:
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.heavy)


@pytest.fixture(scope="session", autouse=True)
def session_cache_dir():
    yield SESSION_CACHE_DIR
    for entry in SESSION_CACHE_DIR.iterdir():
        if entry.is_symlink():
            entry.unlink()  # the link only: what it points to stays shared
        elif entry.name not in PER_SESSION_CACHES and not entry.name.startswith(".") \
                and not (SHARED_CACHE_DIR / entry.name).exists():
            shutil.move(entry, SHARED_CACHE_DIR / entry.name)
    shutil.rmtree(SESSION_CACHE_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def engine():
    from jsgl.engine.engine import Engine

    eng = Engine(model="smollm2-135m", kv_cache_gb=0.25, max_running_requests=32, chunked_prefill_size=256)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def hf_model():
    """SmolLM2 loaded by transformers from the same GGUF: the numerical reference."""
    import torch
    from transformers import AutoModelForCausalLM

    from jsgl.model.registry import resolve_model_path

    torch.set_num_threads(2)
    path = resolve_model_path("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def tokenizer():
    from jsgl.model.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def server(engine):
    """A ServerThread over the module's `engine` (the session's, unless the module defines its own)."""
    from jsgl.server.launch import ServerThread

    with ServerThread(engine) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    """The official OpenAI client pointed at the module's server."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    """An HTTP client of the module's `server` fixture (a ServerThread)."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def wait_idle(engine, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not engine.idle():
        if time.monotonic() > deadline:
            raise TimeoutError("engine did not become idle")
        time.sleep(0.01)


# Prompts of several lengths and kinds for engine behaviour tests (test_engine, test_overlap).
ENGINE_PROMPTS = [
    "The quick brown fox",
    "In 1492, Christopher Columbus sailed across the Atlantic Ocean and reached the islands of the",
    "Python is a programming language that",
    "1, 1, 2, 3, 5, 8,",
    "Dear Sir or Madam, I am writing to you because I recently bought one of your vacuum cleaners and",
]


def assert_no_leak(engine, timeout: float = 60.0) -> None:
    """Once idle, every KV slot is either free or held by the prefix cache."""
    wait_idle(engine, timeout)
    assert engine.allocator.num_free() + engine.prefix_cache.total_size() == engine.allocator.capacity


def assert_server_no_leak(http, timeout: float = 60.0) -> None:
    """The same through a server's /get_server_info: nothing running, no slot lost."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        info = http.get("/get_server_info").json()
        if info["idle"] and info["active_requests"] == 0:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.05)
    assert info["free_slots"] + info["cache_tokens"] == info["total_slots"], info
