"""Models by Hub id (jsgl.model.hub): resolved from a local folder laid out as the Hugging Face cache is (built here
from a tiny checkpoint; no test reaches a hub), revisions, a local path winning over an id, and the message when an
offline cache lacks the model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from huggingface_hub import constants
from test_model_families import build_checkpoint

from jsgl.engine.engine import Engine
from jsgl.model.hub import HUB_PATTERNS, is_hub_id, resolve_hub_model
from jsgl.model.registry import resolve_model_path

REPO = "jsgl-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root, repo: str = REPO, commit: str = COMMIT, ref: str = "main"):
    """A Hugging Face cache under ``root`` holding ``repo`` at ``commit`` (files as blobs, snapshot links to them, the
    ref naming the commit), as `hf download` leaves it."""
    import hashlib

    repo_dir = root / f"models--{repo.replace('/', '--')}"
    source = root / "source"
    build_checkpoint("llama3", source)
    (repo_dir / "blobs").mkdir(parents=True)
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in source.iterdir():
        data = file.read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    resolve_hub_model.cache_clear()
    yield tmp_path / "hub"
    resolve_hub_model.cache_clear()


def test_hub_ids_are_told_from_paths():
    assert is_hub_id("Qwen/Qwen2.5-1.5B-Instruct") and is_hub_id("meta-llama/Llama-3.1-8B@main")
    assert is_hub_id("org/name@0123abc")
    assert not is_hub_id("smollm2-135m") and not is_hub_id("/models/llama") and not is_hub_id("a/b/c")
    assert not is_hub_id("../x") and not is_hub_id("./model.gguf") and not is_hub_id("org/..")


def test_an_id_resolves_to_its_cached_snapshot_offline(offline_cache):
    snapshot = hub_cache(offline_cache)
    assert resolve_model_path(REPO) == snapshot
    assert resolve_model_path(f"{REPO}@{COMMIT}") == snapshot
    assert resolve_model_path(f"{REPO}@main") == snapshot
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache"):
        resolve_model_path(f"{REPO}@v2")  # a revision the cache does not hold


def test_an_engine_by_id_generates_what_the_folder_does(offline_cache):
    snapshot = hub_cache(offline_cache)
    greedy = {"max_new_tokens": 8, "temperature": 0}
    texts = []
    for model in (REPO, str(snapshot)):
        engine = Engine(model=model, kv_cache_gb=0.05, precompile="off", weights_cache="off")
        try:
            texts.append(engine.generate("The capital of France is", greedy).text)
        finally:
            engine.shutdown()
    assert texts[0] == texts[1] and texts[0]


def test_a_local_folder_named_like_an_id_wins(offline_cache, tmp_path, monkeypatch):
    hub_cache(offline_cache)
    local = tmp_path / "work" / REPO
    build_checkpoint("qwen2", local)
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_model_path(REPO) == local.relative_to(tmp_path / "work")


def test_offline_without_the_model_says_what_to_download(offline_cache):
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_path("Qwen/Qwen2.5-1.5B-Instruct")
    message = str(info.value)
    assert "HF_HUB_OFFLINE is set" in message and str(offline_cache) in message
    assert "hf download Qwen/Qwen2.5-1.5B-Instruct" in message and "--include '*.safetensors'" in message
    assert "*.safetensors" in HUB_PATTERNS and "*.bin" not in HUB_PATTERNS


def test_the_cli_takes_an_id_with_the_environment_offline(tmp_path):
    """As a user runs it: HF_HUB_OFFLINE and HF_HUB_CACHE in the environment, `jsgl generate --model org/name`."""
    hub_cache(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "jsgl.cli", "generate", "Hello", "--model", REPO,
                          "--max-new-tokens", "4", "--temperature", "0", "--precompile", "off",
                          "--kv-cache-gb", "0.05"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    missing = subprocess.run([sys.executable, "-m", "jsgl.cli", "generate", "Hello", "--model", "org/absent"],
                             env=env, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "hf download org/absent" in missing.stderr, missing.stderr[-2000:]
    assert "Traceback" not in missing.stderr, missing.stderr[-2000:]  # a refusal: one line (tests/test_cli_errors.py)


def test_a_memory_plan_by_id_fetches_the_config_alone(tmp_path, monkeypatch):
    """`jsgl serve --dry-run --model org/name` reads config.json only: the weights are not downloaded for it."""
    import huggingface_hub

    from jsgl.engine.memory import load_config

    source = tmp_path / "source"
    build_checkpoint("qwen2", source)
    asked = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None):
        asked.append((repo_id, allow_patterns))
        snapshot = tmp_path / "snapshot"
        snapshot.mkdir(exist_ok=True)
        for pattern in allow_patterns:
            for file in source.glob(pattern):
                (snapshot / file.name).write_bytes(file.read_bytes())
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    resolve_hub_model.cache_clear()
    try:
        config = load_config("jsgl-test/tiny-qwen")
        assert asked == [("jsgl-test/tiny-qwen", ["config.json"])] and config.architecture
        assert not list((tmp_path / "snapshot").glob("*.safetensors"))
        resolve_model_path("jsgl-test/tiny-qwen")  # the engine's load asks for everything
        assert asked[1] == ("jsgl-test/tiny-qwen", HUB_PATTERNS)
    finally:
        resolve_hub_model.cache_clear()
