"""How the `jsgl` command fails (jsgl/cli_errors.py): each kind of refusal jsgl raises on purpose is one line on
stderr naming the problem, exit status 2, no traceback, for generate, chat and serve (with and without --dry-run);
a bug is its traceback, a line saying so and exit status 1.

The refusals run as the command does, in a subprocess (a model's config written to a temporary folder: no weight
is loaded), two at a time, each test waiting for its own; the bug path runs in this process.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jsgl import cli
from jsgl.cli_errors import BUG_LINE, run_reporting
from jsgl.errors import ConfigError, MissingExtraError, ModelNotFoundError, RefusedError
from jsgl.model.config import LLAMA3_8B, UnsupportedModelError

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300
# A device JAX does not see here (a CPU machine asks for a TPU; a TPU machine for a GPU).
ABSENT_DEVICE = "gpu" if jax.default_backend() == "tpu" else "tpu"

# The model configs the refusals read, one folder each.
CONFIGS = {
    "gemma2": {**LLAMA3_8B, "model_type": "gemma2"},
    "yarn": {**LLAMA3_8B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    "llama3-8b": LLAMA3_8B,
}

# name: (arguments, what the one line says; {dir} is the folder of the configs above)
REFUSALS: dict[str, tuple[list[str], list[str]]] = {
    "unsupported model_type": (["serve", "--dry-run", "--model", "{dir}/gemma2"],
                               ["model_type='gemma2' is not supported", "jsgl runs llama, mistral, qwen2, qwen3"]),
    "unsupported RoPE": (["serve", "--dry-run", "--model", "{dir}/yarn"],
                         ["rope_scaling.rope_type='yarn' is not supported", "default, linear, llama3"]),
    "config not JSON": (["serve", "--dry-run", "--model", "{dir}/not-json"], ["config.json is not valid JSON"]),
    "missing model": (["serve", "--dry-run", "--model", "{dir}/absent"], ["unknown model", "not an alias"]),
    "no room": (["serve", "--dry-run", "--model", "{dir}/llama3-8b", "--device-gb", "8"],
                ["leaves no room for a KV pool", "raise --mem-fraction"]),
    "absent device": (["serve", "--dry-run", "--device", ABSENT_DEVICE],
                      [f"device '{ABSENT_DEVICE}' was asked for", "or drop --device"]),
    "invalid option": (["serve", "--dry-run", "--chunked-prefill-size", "8"],
                       ["chunked_prefill_size must be at least 16, not 8"]),
    "flags that do not fit": (["serve", "--dp", "2", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:5000"],
                              ["--dp and --nnodes together are not supported"]),
    "offline hub": (["generate", "hi", "--model", "someorg/somemodel"],
                    ["someorg/somemodel is not in the Hugging Face cache", "Unset HF_HUB_OFFLINE",
                     "hf download someorg/somemodel"]),
    "chat unsupported model": (["chat", "--model", "{dir}/gemma2"], ["model_type='gemma2' is not supported"]),
    "serve unsupported model": (["serve", "--model", "{dir}/yarn", "--port", "0"],
                                ["rope_scaling.rope_type='yarn' is not supported"]),
}


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # The checkout's jsgl (PYTHONPATH), with the Hub offline and an empty cache: no test reaches the Hub.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cwd / "hub"),
           "JSGL_CPU_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "jsgl.cli", *args], cwd=cwd, env=env, input="",
                          capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def refused(request, tmp_path_factory):
    """name -> future of its command's CompletedProcess; the selected tests' commands start at once."""
    root = tmp_path_factory.mktemp("cli-errors")
    for name, config in CONFIGS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    (root / "not-json").mkdir()
    (root / "not-json" / "config.json").write_text("{not json")
    selected = {item.callspec.params.get("name") for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two at a time, as tests/test_cli.py
        futures = {name: pool.submit(run, [a.format(dir=root) for a in args], root)
                   for name, (args, _) in REFUSALS.items() if name in selected}
        yield futures
        for future in futures.values():
            future.cancel()


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_refusal_is_one_line_and_exit_status_2(refused, name):
    args, said = REFUSALS[name]
    proc = refused[name].result()
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith(f"jsgl {args[0]}: "), proc.stderr[-3000:]
    for words in said:
        assert words in lines[0], lines[0]


def test_a_bad_flag_is_argparse_usage_and_exit_status_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "hi", "--prefix-cache", "trie"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "invalid choice: 'trie'" in err and "Traceback" not in err


def test_a_bug_prints_its_traceback_and_says_so(monkeypatch, capsys):
    def broken(args):
        raise RuntimeError("an invariant broke")

    monkeypatch.setattr(cli, "cmd_serve", broken)
    assert cli.main(["serve"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "RuntimeError: an invariant broke" in err, err
    assert err.splitlines()[-1] == BUG_LINE


def test_a_refusal_of_several_lines_is_one_and_an_interrupt_is_130(capsys):
    def refuse() -> int:
        raise ConfigError("first line\n  second line\n")

    assert run_reporting("bench", refuse) == 2
    assert capsys.readouterr().err == "jsgl bench: first line; second line\n"

    def interrupted() -> int:
        raise KeyboardInterrupt

    assert run_reporting("chat", interrupted) == 130
    assert capsys.readouterr().err == ""


def test_each_refusal_keeps_the_builtin_base_its_callers_catch():
    from jsgl.errors import InvalidRequestError
    from jsgl.server.replicas import ClusterJoinError

    for refusal, base in ((ConfigError, ValueError), (UnsupportedModelError, ValueError),
                          (ModelNotFoundError, FileNotFoundError), (MissingExtraError, ImportError),
                          (InvalidRequestError, ValueError), (ClusterJoinError, ConnectionError)):
        assert issubclass(refusal, RefusedError) and issubclass(refusal, base), refusal


def test_an_absent_optional_package_is_a_refusal(monkeypatch):
    import builtins

    from jsgl.fsm.llguidance_backend import llguidance_module

    real_import = builtins.__import__

    def without_llguidance(name, *args, **kwargs):
        if name.startswith("llguidance"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_llguidance)
    with pytest.raises(MissingExtraError, match="pip install llguidance"):
        llguidance_module()
