"""`jsgl figures`: run the paper's evaluation (§6) and write one PNG per figure plus `results.md`.

    jsgl figures --quick --out figures/        # each workload's small batch, the configs' quick workloads
    jsgl figures --out docs/figures/           # the full run (see docs/figures/results.md for its time)
    jsgl figures --only fig8c --out docs/figures/   # one figure again; results.md keeps the others' results
    jsgl figures --replot --out docs/figures/  # redraw from the saved JSON, running nothing
    jsgl figures --only fig5 --resume --out docs/figures/   # go on where a stopped run left off
    jsgl figures --only fig5 --resume --redo tree_of_thought --out docs/figures/   # one workload again, after a fix

The figures come from the ablation configs in experiments/configs/ (each also runs alone with
`jsgl bench --config FILE`): Figs. 5/6/13 from fig5_end_to_end.toml, Fig. 8(a)(b) from
fig8ab_hit_rate.toml, Fig. 8(c) from fig8c_ablations.toml. Every config's raw results are saved as JSON
beside the figures, and results.md puts jsgl's numbers next to what the paper reports.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from jsgl.experiments import micro_benchmarks, plots
from jsgl.experiments.bench_workloads import describe_machine
from jsgl.experiments.config_runner import load_config, run_config
from jsgl.experiments.workloads import workload_names

CONFIGS = {"fig5": "fig5_end_to_end.toml", "fig8ab": "fig8ab_hit_rate.toml", "fig8c": "fig8c_ablations.toml"}
FIGURES = (*CONFIGS, "micro")  # micro: the §3/§4/§5 tables (micro_benchmarks.py)

# What the paper reports, for results.md. Fig. 13's bars carry no printed values: these are read off the
# published figure by eye (approximate); the other two are the paper's text.
PAPER_CLAIMS = {
    "fig5": "SGLang: up to 6.4x higher throughput than vLLM, Guidance and LMQL (Llama-7B on an A10G and larger "
            "models; abstract and Fig. 5), and lower latency on the same workloads (Fig. 6).",
    "fig13": "Cache hit rates from 50% to 99%, 96% of the optimum on average (§6.3).",
}
PAPER_FIG13 = {  # workload title -> (achieved %, optimal %), approximate
    "MMLU (5-shot)": (85, 85), "ReAct agents": (94, 94), "Generative agents": (91, 91),
    "Tree-of-thought (GSM8K)": (98, 99), "Skeleton-of-thought": (92, 95), "LLM judges (branch-solve-merge)": (72, 73),
    "HellaSwag (20-shot)": (98, 98), "JSON decoding (regex)": (88, 88), "Multi-turn chat (short)": (50, 60),
    "Multi-turn chat (long)": (57, 74), "DSPy RAG pipeline": (90, 93),
}


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ran(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs that ran (a peer system that is not installed has no results)."""
    return [run for run in runs if not run.get("skipped")]


def _jsgl_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first jsgl run (Fig. 13's hit rates are jsgl's: peer systems report none)."""
    return next(run for run in _ran(runs) if run.get("system", "jsgl") == "jsgl")


def _run_table(runs: list[dict[str, Any]], metric: str, digits: int = 3) -> list[str]:
    runs = _ran(runs)
    workloads = [r["title"] for r in runs[0]["results"]]
    lines = ["| workload | " + " | ".join(run["label"] for run in runs) + " |",
             "|---|" + "---|" * len(runs)]
    for w in workloads:
        cells = [_fmt(next((r.get(metric) for r in run["results"] if r["title"] == w), None), digits) for run in runs]
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    return lines


def draw(results: dict[str, dict[str, Any]], out: Path) -> dict[str, Path]:
    """Every figure the results allow: {figure name: PNG path}."""
    pngs: dict[str, Path] = {}
    if "fig5" in results:
        runs = _ran(results["fig5"]["runs"])
        pngs["fig5"] = plots.grouped_bars(runs, "throughput", "Normalized throughput (higher is better)",
                                          "Fig. 5: throughput of the workloads", out / "fig5_throughput.png")
        pngs["fig6"] = plots.grouped_bars(runs, "latency_s", "Normalized latency (lower is better)",
                                          "Fig. 6: latency of one program", out / "fig6_latency.png",
                                          higher_is_better=False)
        pngs["fig13"] = plots.achieved_vs_optimal(_jsgl_run(runs), "Fig. 13: achieved and optimal cache hit rates",
                                                  out / "fig13_hit_rates.png")
    if "fig8ab" in results:
        pngs["fig8ab"] = plots.hit_rate_sweep(results["fig8ab"]["runs"],
                                              "Fig. 8(a)(b): performance against cache hit rate",
                                              out / "fig8ab_hit_rate.png")
    if "fig8c" in results:
        pngs["fig8c"] = plots.grouped_bars(_ran(results["fig8c"]["runs"]), "throughput",
                                           "Normalized throughput (higher is better)", "Fig. 8(c): ablations",
                                           out / "fig8c_ablations.png")
    return pngs


def _provenance(name: str, result: dict[str, Any]) -> str:
    p = result.get("provenance", {})
    wall = f"{p['wall_s'] / 60:.1f} min" if "wall_s" in p else "not recorded"
    if p.get("parts", 1) > 1:
        wall += f" in {p['parts']} parts"
    if result.get("partial"):
        wall += " (stopped: partial results)"
    command = f"`{p['command']}`" if "command" in p else "not recorded"
    # A resumed figure's results may come from several commits: each result records its own.
    commits = sorted({r["commit"] for run in result.get("runs", []) for r in run["results"] if "commit" in r})
    commit = ", ".join(commits) or result.get("commit", p.get("commit", "-"))
    return (f"| {name} | {command} | {commit} | {p.get('date', '-')} | {wall} | "
            f"{'yes' if result.get('quick', p.get('quick')) else 'no'} |")


def results_markdown(results: dict[str, dict[str, Any]], pngs: dict[str, Path], micro: dict[str, Any] | None = None,
                     machine: dict[str, Any] | None = None) -> str:
    """results.md from every figure's saved results (each with how, when and on which commit it ran)."""
    any_result = next(iter(results.values()), None) or machine or {}
    lines = ["# jsgl: the paper's evaluation, reproduced", "",
             f"- machine: {any_result.get('machine', '-')}, Python {any_result.get('python', '-')}",
             f"- model: {any_result.get('model', '-')}", "",
             "| figure | command | commit | date | wall time | quick |", "|---|---|---|---|---|---|",
             *(_provenance(name, res) for name, res in results.items()),
             *([_provenance("micro", micro)] if micro else []), "",
             "Throughput: programs/s with the whole batch submitted at once; latency: mean seconds of one "
             "program alone on a server that has served the workload; hit rate: cached / prompt tokens of the "
             "batch, beside the optimum of Theorem 3.1 (prompt tokens whose prefix no earlier prompt or output "
             "contained must be computed). Workload sources and deviations: experiments/workloads/.", ""]
    if "fig5" in results:
        runs = results["fig5"]["runs"]
        systems = [f"{run['label']}: {run['system']}" + (f" {run['version']}" if run.get("version") else "")
                   for run in _ran(runs) if run.get("system", "jsgl") != "jsgl"]
        lines += ["## Fig. 5: throughput (programs/s)", "", f"![Fig. 5]({pngs['fig5'].name})", "",
                  *_run_table(runs, "throughput"), "", f"Peer systems: {'; '.join(systems) or 'none installed'}.",
                  "", f"Paper: {PAPER_CLAIMS['fig5']}", "",
                  "## Fig. 6: latency (s)", "", f"![Fig. 6]({pngs['fig6'].name})", "",
                  *_run_table(runs, "latency_s", 2), "",
                  "## Fig. 13: achieved vs optimal cache hit rate", "", f"![Fig. 13]({pngs['fig13'].name})", "",
                  "| workload | jsgl achieved | jsgl optimal | achieved / optimal | paper achieved (approx.) "
                  "| paper optimal (approx.) |", "|---|---|---|---|---|---|"]
        for r in _jsgl_run(runs)["results"]:
            paper = PAPER_FIG13.get(r["title"], (None, None))
            ratio = r["hit_rate"] / r["optimal_hit_rate"] if r["optimal_hit_rate"] else None
            lines.append(f"| {r['title']} | {100 * r['hit_rate']:.1f}% | {100 * r['optimal_hit_rate']:.1f}% | "
                         f"{_fmt(ratio)} | {paper[0] if paper[0] else '-'}% | {paper[1] if paper[1] else '-'}% |")
        lines += ["", f"Paper: {PAPER_CLAIMS['fig13']}", ""]
    if "fig8ab" in results:
        runs = results["fig8ab"]["runs"]
        lines += ["## Fig. 8(a)(b): performance against cache hit rate", "", f"![Fig. 8ab]({pngs['fig8ab'].name})",
                  "", "Hit rate:", "", *_run_table(runs, "hit_rate"), "", "Throughput (programs/s):", "",
                  *_run_table(runs, "throughput"), "", "Latency (s):", "", *_run_table(runs, "latency_s", 2), "",
                  "Mean batch size:", "", *_run_table(runs, "mean_batch_size", 1), ""]
    if "fig8c" in results:
        runs = results["fig8c"]["runs"]
        lines += ["## Fig. 8(c): ablations (throughput, programs/s)", "", f"![Fig. 8c]({pngs['fig8c'].name})", "",
                  *_run_table(runs, "throughput"), "", "Hit rate:", "", *_run_table(runs, "hit_rate"), ""]
    lines += micro_benchmarks.markdown(micro or {})
    skipped = [f"- {name} / {run['label']}: {run['skipped']}" for name, res in results.items() for run in res["runs"]
               if run.get("skipped")]
    lines += ["## Skipped", "", *skipped, ""] if skipped else []
    failed = [(name, run["label"], r["workload"]) for name, res in results.items() for run in res["runs"]
              for r in run["results"] if r.get("errors") or r.get("missing_outputs")]
    lines += ["## Failures", "", *(f"- {n} / {label} / {w}" for n, label, w in failed)] if failed else []
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jsgl figures", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("figures"), help="where the PNGs, JSON and results.md go")
    ap.add_argument("--quick", action="store_true", help="small batches and each config's quick workloads")
    ap.add_argument("--model", default=None, help="run every workload on this model instead of the configs'")
    ap.add_argument("--only", default="", help=f"comma list of figures to run (default: {', '.join(FIGURES)})")
    ap.add_argument("--programs", type=int, default=None, help="programs per workload (smoke tests)")
    ap.add_argument("--max-workloads", type=int, default=None, help="first K workloads of each config (smoke tests)")
    ap.add_argument("--replot", action="store_true", help="run nothing: redraw from the JSON results in --out")
    ap.add_argument("--resume", action="store_true",
                    help="keep the workloads an earlier run in --out finished (results are saved after each one) "
                         "and run only the rest")
    ap.add_argument("--redo", default="",
                    help="with --resume: comma list of workloads to measure again in every run (after a fix)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(FIGURES)
    unknown = set(names) - set(FIGURES)
    if unknown:
        ap.error(f"unknown figures {sorted(unknown)}; choose from {', '.join(FIGURES)}")
    redo = {w.strip() for w in args.redo.split(",") if w.strip()}
    if redo and not args.resume:
        ap.error("--redo goes with --resume")
    if redo - set(workload_names()):
        ap.error(f"unknown workloads {sorted(redo - set(workload_names()))}; choose from {', '.join(workload_names())}")
    args.out.mkdir(parents=True, exist_ok=True)
    command = "jsgl figures " + shlex.join(sys.argv[2:] if argv is None else argv)
    model = args.model or "smollm2-135m"

    def provenance(started: float, earlier: dict[str, Any]) -> dict[str, Any]:
        # A resumed figure's wall time adds up its parts.
        wall = time.perf_counter() - started + earlier.get("wall_s", 0.0)
        return {"command": command, **describe_machine(), "model": model, "quick": args.quick,
                "date": datetime.date.today().isoformat(), "wall_s": round(wall, 1),
                "parts": earlier.get("parts", 0) + 1}

    for name in ([] if args.replot else names):
        started, path = time.perf_counter(), args.out / f"{name}.json"
        saved = json.loads(path.read_text()) if args.resume and name != "micro" and path.exists() else None
        earlier = saved.get("provenance", {}) if saved else {}

        def checkpoint(partial: dict[str, Any], path: Path = path, started: float = started,
                       earlier: dict[str, Any] = earlier) -> None:
            path.write_text(json.dumps({**partial, "provenance": provenance(started, earlier)}, indent=2))

        if name == "micro":
            print("== §3/§4/§5 measurements", flush=True)
            result = micro_benchmarks.run_all(args.quick, model, args.programs)
        else:
            cfg = load_config(CONFIGS[name])
            print(f"== {cfg['title']}", flush=True)
            result = run_config(cfg, quick=args.quick, model=args.model, programs=args.programs,
                                max_workloads=args.max_workloads, resume=saved, checkpoint=checkpoint, redo=redo)
        checkpoint(result)
    # Every figure saved in --out, this run's and earlier ones' (results.md says which ran when).
    saved = {name: json.loads((args.out / f"{name}.json").read_text()) for name in FIGURES
             if (args.out / f"{name}.json").exists()}
    micro = saved.pop("micro", None)
    pngs = draw(saved, args.out)
    md = results_markdown(saved, pngs, micro, {**describe_machine(), "model": model})
    (args.out / "results.md").write_text(md)
    print(f"\nwrote {', '.join(p.name for p in pngs.values()) or 'no figure'} and results.md to {args.out}")
    return 1 if "## Failures" in md else 0


if __name__ == "__main__":
    raise SystemExit(main())
