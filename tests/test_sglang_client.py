"""The real SGLang frontend (sglang 0.5.23's `sglang.lang`, installed from PyPI) runs programs against a
jsgl server: gen with stop / regex / json_schema / min_tokens / stop_regex, select, fork with both join
modes, run_batch, and streaming with per-chunk meta data (SGLang's own invariants).

The client is installed once into the jsgl cache (`<cache>/sglang-client-0.5.23-<hash of the package list>`,
JSGL_CACHE_DIR moves it) with `pip install --no-deps --target`: sglang itself plus what `import sglang` needs
beside the torch and transformers this environment has (triton, 285 MB, is imported unconditionally by
sglang.srt.utils). Measured on the 2-core machine: 21 s to install (download included), 1.3 GB on disk;
`import sglang` ~12 s.
It runs in a subprocess (tests/sglang_client_programs.py) so sglang never loads into this process. The
server is this process's engine behind a ServerThread, so every greedy answer the client got is checked
against the same engine called directly.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import pypi_reachable

from jsgl.paths import cache_dir

SGLANG_VERSION = "0.5.23"
# What `import sglang` and its frontend need beyond jsgl's own dependencies (no deps: torch etc. stay the
# installed ones). Found by importing it in a fresh venv holding only `pip install -e ".[test,bench]"`.
CLIENT_PACKAGES = [f"sglang=={SGLANG_VERSION}", "pybase64", "triton", "msgspec", "pyzmq", "aiohttp", "multidict",
                   "yarl", "propcache", "aiohappyeyeballs", "aiosignal", "frozenlist", "orjson", "ipython",
                   "traitlets"]
# What the programs import (tests/sglang_client_programs.py); checked right after the install.
CLIENT_IMPORTS = "import sglang, sglang.lang.interpreter, sglang.lang.backend.runtime_endpoint"
SCRIPT = Path(__file__).with_name("sglang_client_programs.py")


def _install_client() -> Path:
    """The sglang client's --target dir, installed on first use (into a temp dir renamed into place, so an
    interrupted install is never mistaken for a finished one)."""
    # The package list is part of the name: an install made from an older list is never reused.
    digest = hashlib.sha256(" ".join(CLIENT_PACKAGES).encode()).hexdigest()[:8]
    target = cache_dir() / f"sglang-client-{SGLANG_VERSION}-{digest}"
    if (target / ".complete").exists():
        return target
    if not pypi_reachable():
        pytest.skip("PyPI is unreachable: cannot install the sglang client to test against")
    staging = Path(tempfile.mkdtemp(prefix=f".sglang-client-{SGLANG_VERSION}-", dir=cache_dir()))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
                           "--target", str(staging), *CLIENT_PACKAGES], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        if not pypi_reachable():
            pytest.skip("PyPI became unreachable while installing the sglang client")
        pytest.fail(f"pip could not install the sglang client:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    missing = _missing_module(staging)
    if missing:
        shutil.rmtree(staging, ignore_errors=True)
        pytest.fail(f"the sglang client cannot be imported: module {missing!r} is missing; add its package to "
                    "CLIENT_PACKAGES in tests/test_sglang_client.py")
    (staging / ".complete").write_text(f"installed in {time.monotonic() - start:.1f} s\n")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def _missing_module(site: Path) -> str | None:
    """The module `import sglang` fails on with `site` on the path (as the programs run), or None."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-c", CLIENT_IMPORTS], capture_output=True, text=True, timeout=600,
                          env=env, cwd=tempfile.gettempdir())
    if proc.returncode == 0:
        return None
    found = re.search(r"No module named '([^']+)'", proc.stderr)
    if found:
        return found.group(1)
    pytest.fail(f"the sglang client cannot be imported:\n{proc.stderr[-3000:]}")


@pytest.fixture(scope="module")
def sglang_site() -> Path:
    return _install_client()


@pytest.fixture(scope="module")
def served():
    from jsgl.engine.engine import Engine
    from jsgl.server.launch import ServerThread

    engine = Engine(model="smollm2-135m", kv_cache_gb=0.25, max_running_requests=32, chunked_prefill_size=256)
    try:
        with ServerThread(engine) as srv:
            yield engine, srv.url
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def report(sglang_site, served) -> dict[str, Any]:
    _, url = served
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(sglang_site)
    # Run outside the repo so nothing but the installed client and site-packages is importable as sglang.
    proc = subprocess.run([sys.executable, str(SCRIPT), url], capture_output=True, text=True, timeout=900,
                          env=env, cwd=tempfile.gettempdir())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT: ")]
    assert proc.returncode == 0 and lines, f"client failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n" \
                                           f"{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("REPORT: "):])


def _greedy(engine, prompt: str, **params: Any) -> Any:
    return engine.generate(prompt, {"temperature": 0, **params})


def _program(report: dict[str, Any], name: str) -> dict[str, Any]:
    result = report["programs"][name]
    assert result["ok"], f"{name} failed in the sglang client: {result['error']}\n{result['traceback']}"
    return result


def test_client_is_the_real_sglang(report, sglang_site):
    assert report["sglang_version"] == SGLANG_VERSION
    assert report["sglang_file"].startswith(str(sglang_site))
    assert report["server_info_keys"]  # /server_info answered


def test_no_http_errors(report):
    assert report["http_errors"] == [], json.dumps(report["http_errors"], indent=1)


def test_gen_with_stop(report, served):
    r = _program(report, "stop")
    assert "\n" not in r["answer"] and r["answer"].strip()
    assert r["answer"] == _greedy(served[0], r["prompt"], max_new_tokens=12, stop="\n").text


def test_gen_with_regex(report, served):
    r = _program(report, "regex")
    assert re.fullmatch(r["regex"], r["answer"])
    assert r["answer"] == _greedy(served[0], r["prompt"], max_new_tokens=24, regex=r["regex"]).text


def test_gen_with_json_schema(report, served):
    import jsonschema

    r = _program(report, "json_schema")
    jsonschema.validate(json.loads(r["answer"]), r["schema"])
    expected = _greedy(served[0], r["prompt"], max_new_tokens=48, json_schema=json.dumps(r["schema"])).text
    assert r["answer"] == expected


def test_select(report, served):
    """SGLang's client scores each choice from two tokens before the choice (its token healing) by the
    prompt logprobs /generate returns; those must be the engine's own, and the pick their argmax."""
    r = _program(report, "select")
    scores = r["normalized_prompt_logprobs"]
    assert r["answer"] == r["choices"][max(range(len(scores)), key=scores.__getitem__)]
    engine = served[0]
    tok = engine.tokenizer
    for choice, triples in zip(r["choices"], r["input_token_logprobs"], strict=True):
        ids = tok(r["prompt"] + choice, add_special_tokens=False).input_ids
        start = len(ids) - len(triples)
        out = engine.generate(ids, {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": start})
        assert [t[1] for t in triples] == out.input_token_ids
        for (lp, _, _), ref in zip(triples, out.input_logprobs, strict=True):
            assert (lp is None and ref is None) or lp == pytest.approx(ref, abs=1e-4)


def test_fork_gather_variable(report, served):
    r = _program(report, "fork_gather_variable")
    assert r["tips"] == [_greedy(served[0], r["head"] + f"{i + 1}.", max_new_tokens=8, stop="\n").text
                         for i in range(2)]
    assert all(tip.strip() for tip in r["tips"])
    assert r["text"] == r["head"]  # gather_variable leaves the parent's text alone


def test_fork_concate_and_append(report, served):
    r = _program(report, "fork_concate_and_append")
    statements = "".join(f"Statement {i}: {c}\n" for i, c in enumerate(r["contexts"]))
    assert r["prompt"] == ("Read the statements.\n" + statements
                           + "Question: Who is the father of Julian?\nAnswer:")
    assert r["answer"] == _greedy(served[0], r["prompt"], max_new_tokens=6, stop="\n").text


def test_run_batch(report, served):
    r = _program(report, "run_batch")
    assert len(r["answers"]) == 3
    for answer, prompt in zip(r["answers"], r["prompts"], strict=True):
        assert answer == _greedy(served[0], prompt, max_new_tokens=12, stop="\n").text


def test_streaming_meta_data(report, served):
    r = _program(report, "stream_meta")  # the client already asserted SGLang's per-chunk invariants
    chunks = r["chunks"]
    assert len(chunks) > 1
    prev = 0
    for c in chunks:
        assert c["text"] and c["completion_tokens"] == c["output_token_logprobs_length"]
        assert len(c["token_ids"]) == c["completion_tokens"] - prev
        prev = c["completion_tokens"]
    out = _greedy(served[0], r["prompt"], max_new_tokens=16)
    assert r["answer"] == out.text
    assert [t for c in chunks for t in c["token_ids"]] == out.token_ids[:prev]


def test_min_tokens(report, served):
    r = _program(report, "min_tokens")
    engine = served[0]
    plain = _greedy(engine, r["prompt"], max_new_tokens=r["max_tokens"])
    assert plain.finish_reason == "stop" and plain.completion_tokens < r["min_tokens"]  # EOS comes early...
    assert r["completion_tokens"] >= r["min_tokens"]  # ...and is ignored until min_tokens
    expected = _greedy(engine, r["prompt"], max_new_tokens=r["max_tokens"], min_new_tokens=r["min_tokens"])
    assert r["answer"] == expected.text


def test_stop_regex(report, served):
    r = _program(report, "stop_regex")
    engine = served[0]
    assert re.search(r["stop_regex"], _greedy(engine, r["prompt"], max_new_tokens=12).text)  # digits follow
    assert not re.search(r["stop_regex"], r["answer"]) and r["finish_reason"]["type"] == "stop"
    assert r["answer"] == _greedy(engine, r["prompt"], max_new_tokens=12, stop_regex=r["stop_regex"]).text
