"""Ablation configs as files (`experiments/configs/*.toml`), run with `jsgl bench --config FILE`.

A config names the workloads, the model, the engine options every run shares, and the grid: one
`[[runs]]` entry per system configuration, each with its own engine options and frontend switches.

    title = "Fig. 8(c): ablations"
    figure = "fig8c"                    # which figure `jsgl figures` draws from it
    workloads = ["mmlu", "llm_judge"]   # or "all"
    [engine]                            # EngineConfig fields (the `jsgl serve` flags), shared
    max_running_requests = 64
    [[runs]]
    label = "no cache"
    engine = { prefix_cache = "none" }
    [[runs]]
    label = "no frontend hint"
    frontend = { prefix_hint = false }  # also: parallelism = false
    [[runs]]
    label = "vLLM"
    system = "vllm"                     # a peer system (experiments/baselines/) instead of a jsgl engine
    programs = 16                       # this run's batch per workload (a slow baseline's smaller batch)

Runs with the same engine options share one engine (its compiled steps carry over); every workload
starts from a flushed cache. A peer system that is not installed is skipped, with the reason and the
install command in the results, never approximated.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import tomllib
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from jsgl.experiments.baselines import Target, get_system
from jsgl.experiments.bench_workloads import describe_machine, frontend_switches, print_table, run_workload
from jsgl.experiments.workloads import get_workload, workload_names
from tqdm import tqdm

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
TOP_KEYS = {"title", "figure", "workloads", "quick_workloads", "model", "programs", "quick_programs",
            "latency_programs", "engine", "runs", "note"}
RUN_KEYS = {"label", "engine", "frontend", "system", "programs"}
FRONTEND_KEYS = {"parallelism", "prefix_hint"}


class ConfigError(ValueError):
    """A config file that names something jsgl does not have."""


def load_config(path: str | Path) -> dict[str, Any]:
    """Read and check a config: unknown keys, workloads or engine options are refused by name."""
    from jsgl.engine.config import EngineConfig

    path = Path(path)
    if not path.exists() and (CONFIG_DIR / path).exists():
        path = CONFIG_DIR / path
    try:
        cfg = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    cfg.setdefault("title", path.stem)
    cfg.setdefault("figure", path.stem)
    cfg.setdefault("model", "smollm2-135m")
    cfg.setdefault("engine", {})
    if set(cfg) - TOP_KEYS:
        raise ConfigError(f"{path}: unknown keys {sorted(set(cfg) - TOP_KEYS)}; known: {sorted(TOP_KEYS)}")
    for key in ("workloads", "quick_workloads"):
        names = cfg.get(key, "all" if key == "workloads" else [])
        cfg[key] = workload_names() if names == "all" else list(names)
        for name in cfg[key]:
            get_workload(name)  # KeyError names the choices
    if not cfg.get("runs"):
        raise ConfigError(f"{path}: no [[runs]]")
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    for run in cfg["runs"]:
        if set(run) - RUN_KEYS or "label" not in run:
            raise ConfigError(f"{path}: a run needs a label and may have only {sorted(RUN_KEYS)}: {run}")
        engine = {**cfg["engine"], **run.get("engine", {})}
        if set(engine) - fields:
            raise ConfigError(f"{path}: run {run['label']!r}: unknown engine options {sorted(set(engine) - fields)}")
        if "system" in run:
            if "engine" in run:
                raise ConfigError(f"{path}: run {run['label']!r}: engine options are jsgl's; a {run['system']} run "
                                  "takes none")
            get_system(run["system"])  # KeyError names the choices
        if set(run.get("frontend", {})) - FRONTEND_KEYS:
            raise ConfigError(f"{path}: run {run['label']!r}: frontend switches are {sorted(FRONTEND_KEYS)}")
        EngineConfig(model=cfg["model"], **engine)  # its own checks (ranges, choices)
        run["engine_options"] = {} if "system" in run else engine
    return cfg


def release_memory() -> None:
    """Hand a shut-down engine's memory back before the next one loads: without this a grid of 12 engines
    peaked at 17 GB of RSS (freed buffers kept by the allocator), with it each switch returns to ~1.7 GB."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the allocator keeps what it keeps
        pass


def _run_workloads(label: str, target: Target, workloads: list[str], frontend: dict[str, bool], cfg: dict[str, Any],
                   quick: bool, programs: int | None, bar: Any,
                   record: Callable[[dict[str, Any]], None]) -> None:
    for name in workloads:
        w = get_workload(name)
        batch = programs or cfg.get("quick_programs" if quick else "programs") or (
            w.quick_programs if quick else w.programs)
        latency = 1 if quick else cfg.get("latency_programs", w.latency_programs)
        print(f"[{label}] {w.title}: {batch} programs, {latency} alone", flush=True)
        with frontend_switches(frontend.get("parallelism", True), frontend.get("prefix_hint", True)):
            res = run_workload(w, target, batch, latency)
        print("  " + json.dumps({k: v for k, v in res.items() if k != "title"}), flush=True)
        # Each result says which code measured it: a resumed grid may span commits.
        record({**res, "commit": describe_machine()["commit"], "date": datetime.date.today().isoformat()})
        bar.update(1)


def _reusable(prior: dict[str, Any] | None, entry: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A saved run's finished results, by workload, when it ran the same system with the same options (a run
    that failed or was skipped is run again: the system may be installed by now)."""
    if not prior or prior.get("skipped") or any(prior.get(k) != entry[k] for k in ("system", "engine", "frontend")):
        return {}
    return {r["workload"]: r for r in prior["results"] if not (r.get("errors") or r.get("missing_outputs"))}


def run_config(cfg: dict[str, Any], quick: bool = False, model: str | None = None, programs: int | None = None,
               max_workloads: int | None = None, resume: dict[str, Any] | None = None,
               checkpoint: Callable[[dict[str, Any]], None] | None = None,
               redo: Collection[str] = ()) -> dict[str, Any]:
    """Every run of the grid over the config's workloads (`quick`: its `quick_workloads` and each workload's
    small batch; `programs`, `max_workloads`: smaller still, for smoke tests).

    `resume`: an earlier (possibly interrupted) result of this config; its finished workloads are kept and
    only the rest run, and the workloads named in `redo` (measured again after a fix). `checkpoint` is called
    with the results so far after every workload, so a run of hours can be stopped and resumed."""
    import jsgl.lang as sgl

    model = model or cfg["model"]
    workloads = (cfg.get("quick_workloads") or cfg["workloads"]) if quick else cfg["workloads"]
    workloads = workloads[:max_workloads] if max_workloads else workloads
    if resume and (resume.get("model") != model or bool(resume.get("quick")) != quick):
        raise ConfigError(f"cannot resume {cfg['figure']}: the saved results are for model {resume.get('model')}, "
                          f"quick={resume.get('quick')}")
    prior_runs = {run["label"]: run for run in (resume or {}).get("runs", [])}
    runs: list[dict[str, Any]] = []
    rt, rt_options = None, None
    # On stderr, and only on a terminal (disable=None): logs keep the per-workload lines printed below.
    bar = tqdm(total=len(cfg["runs"]) * len(workloads), desc=cfg["figure"], unit="workload", disable=None)

    def output(partial: bool) -> dict[str, Any]:
        return {"title": cfg["title"], "figure": cfg["figure"], "model": model, "quick": quick,
                "note": cfg.get("note", ""), **describe_machine(), "partial": partial, "runs": runs}

    def close_engine() -> None:
        nonlocal rt
        if rt is not None:
            rt.shutdown()
            rt = None
            release_memory()

    try:
        for run in cfg["runs"]:
            label, frontend = run["label"], run.get("frontend", {})
            entry = {"label": label, "system": run.get("system", "jsgl"), "engine": run["engine_options"],
                     "frontend": frontend, "results": []}
            done = {w: res for w, res in _reusable(prior_runs.get(label), entry).items() if w not in redo}
            if done:
                entry["version"] = prior_runs[label].get("version")
            todo = [w for w in workloads if w not in done]
            bar.update(len(workloads) - len(todo))
            runs.append(entry)

            def record(result: dict[str, Any], entry: dict[str, Any] = entry) -> None:
                entry["results"].append(result)
                entry["results"].sort(key=lambda r: workloads.index(r["workload"]))
                if checkpoint:
                    checkpoint(output(partial=True))

            for name in workloads:
                if name in done:
                    record(done[name])
            if not todo:
                continue
            run_programs = programs or (None if quick else run.get("programs"))
            if "system" in run:
                close_engine()  # a peer system gets the whole machine
                system = get_system(run["system"])
                reason = system.unavailable() or system.refuses(model)
                entry["version"] = system.version() if not reason else None
                if reason:
                    print(f"[{label}] skipped: {reason}", flush=True)
                    entry["skipped"] = reason
                    bar.update(len(todo))
                    continue
                try:
                    with system.start(model) as target:
                        _run_workloads(label, target, todo, frontend, cfg, quick, run_programs, bar, record)
                except RuntimeError as exc:  # it did not start or died: the grid's other runs still count
                    how = "stopped" if len(entry["results"]) > len(done) else "did not start"
                    print(f"[{label}] {how}: {exc}", flush=True)
                    entry["skipped"] = f"{how}: {str(exc)[:500]}"
                    continue
                finally:
                    release_memory()
                continue
            options = run["engine_options"]
            if rt is None or options != rt_options:
                close_engine()
                rt, rt_options = sgl.Runtime(model=model, **options), options
            _run_workloads(label, Target.of_runtime(rt), todo, frontend, cfg, quick, run_programs, bar, record)
    finally:
        bar.close()
        close_engine()
    return output(partial=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jsgl bench --config", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help=f"a TOML file (or the name of one in {CONFIG_DIR})")
    ap.add_argument("--quick", action="store_true", help="each workload's small batch, one latency program")
    ap.add_argument("--model", default=None, help="override the config's model")
    ap.add_argument("--programs", type=int, default=None, help="programs per workload (smoke tests)")
    ap.add_argument("--max-workloads", type=int, default=None, help="only the first K workloads (smoke tests)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except (ConfigError, KeyError) as exc:
        ap.error(str(exc))
    out = run_config(cfg, quick=args.quick, model=args.model, programs=args.programs,
                     max_workloads=args.max_workloads)
    for run in out["runs"]:
        print(f"\n{run['label']} ({run['system']}, {json.dumps(run['engine'])}, "
              f"frontend {json.dumps(run['frontend'])})")
        if run.get("skipped"):
            print(f"skipped: {run['skipped']}")
        print_table(run["results"])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    failed = [r for run in out["runs"] for r in run["results"] if r.get("errors") or r.get("missing_outputs")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
