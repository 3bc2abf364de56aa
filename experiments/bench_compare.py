"""Before and after, side by side in one run: the serving workloads on this tree and on another commit.

    jsgl bench compare --rev HEAD~3            # alternating rounds, each tree in a fresh process
    jsgl bench compare --rev 12ed8a2 --rounds 3 --quick

The other commit is checked out in a temporary git worktree; each round runs this file's workloads once per
tree, alternating, each in its own process that imports that tree's `jsgl` (so the machine's slow and fast
phases hit both alike). Only the engine API both commits have is used: `Engine(...)`, `generate`,
`flush_cache`, `stats()`; `precompile` is passed where the engine has it (`--precompile`, default common).

Per tree: startup s (constructing the engine: load, and precompile where there is one); for each workload its
first run on the fresh engine (compiles included) and its second (cache flushed between): wall s and step
shapes compiled; for MMLU 5-shot also the computed prompt tokens per second of extend-step time (prompt
tokens the radix cache did not hold, over the seconds spent in extend steps). Ratios are current / other,
medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUBJECTS = ["high_school_geography", "marketing", "nutrition", "sociology"]


def child(quick: bool, precompile: str) -> dict:
    """Runs in the tree under test (its `jsgl` first on sys.path)."""
    import dataclasses

    from jsgl.experiments.bench_decode import PROMPTS
    from jsgl.experiments.datasets import mmlu_five_shot

    import jsgl
    from jsgl.engine.config import EngineConfig
    from jsgl.engine.engine import Engine

    kwargs = {"kv_cache_gb": 0.5}
    if "precompile" in {f.name for f in dataclasses.fields(EngineConfig)}:
        kwargs["precompile"] = precompile
    t0 = time.perf_counter()
    engine = Engine(**kwargs)
    result = {"jsgl": str(Path(jsgl.__file__).parent), "startup_s": time.perf_counter() - t0}
    new = 8 if quick else 64
    decode = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
    mmlu = [p for s in SUBJECTS[: 1 if quick else 4] for p, _ in mmlu_five_shot(s, 4 if quick else 16)]
    workloads = {"decode b1": (PROMPTS[:1], decode), "decode b16": (PROMPTS[:16], decode),
                 "mmlu 5-shot": (mmlu, {"temperature": 0, "max_new_tokens": 1})}
    try:
        for name, (prompts, params) in workloads.items():
            for run in ("first", "second"):
                engine.flush_cache()
                before = engine.stats()
                t0 = time.perf_counter()
                engine.generate(prompts, params, progress=False)
                wall = time.perf_counter() - t0
                after = engine.stats()
                entry = {"wall_s": wall, "compiles": after["compiles"] - before["compiles"]}
                extend_s = after["extend_time_s"] - before["extend_time_s"]
                computed = after["computed_prefill_tokens"] - before["computed_prefill_tokens"]
                entry["prefill_tok_per_s"] = computed / extend_s if extend_s else 0.0
                result[f"{name} {run}"] = entry
    finally:
        engine.shutdown()
    return result


def run_child(tree: Path, quick: bool, precompile: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--out", out.name, "--precompile", precompile]
        if quick:
            cmd.append("--quick")
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the run in {tree} failed:\n{proc.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="HEAD~1", help="the other commit (default HEAD~1)")
    ap.add_argument("--repo", default=".", help="the git repository of this tree (default: the current folder)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--precompile", choices=["off", "common", "all"], default="common")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.child:
        Path(args.out).write_text(json.dumps(child(args.quick, args.precompile)))
        return 0

    repo = Path(subprocess.run(["git", "-C", args.repo, "rev-parse", "--show-toplevel"], capture_output=True,
                               text=True, check=True).stdout.strip())
    commit = subprocess.run(["git", "-C", repo, "rev-parse", "--short", args.rev], capture_output=True, text=True,
                            check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="jsgl-compare-") as tmp:
        other = Path(tmp) / commit
        subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", str(other), commit], check=True,
                       capture_output=True)
        try:
            trees = {commit: other, "current": repo}
            rounds: dict[str, list[dict]] = {name: [] for name in trees}
            for i in range(args.rounds):
                for name, tree in trees.items():
                    rounds[name].append(run_child(tree, args.quick, args.precompile))
                    print(f"round {i + 1}: {name} done", flush=True)
        finally:
            subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", str(other)], capture_output=True)
    for name, runs in rounds.items():  # the imports really came from each tree
        assert all(Path(r["jsgl"]).parent.resolve() == trees[name].resolve() for r in runs), (name, runs[0]["jsgl"])

    def med(name: str, key: str, field: str | None = None) -> float:
        return statistics.median(r[key][field] if field else r[key] for r in rounds[name])

    metrics = [("startup s", "startup_s", None)]
    for workload in ("decode b1", "decode b16", "mmlu 5-shot"):
        for run in ("first", "second"):
            metrics.append((f"{workload} {run} s", f"{workload} {run}", "wall_s"))
            metrics.append((f"{workload} {run} compiles", f"{workload} {run}", "compiles"))
    metrics.append(("mmlu prefill tok/s (second)", "mmlu 5-shot second", "prefill_tok_per_s"))
    print(f"\nmedians of {args.rounds} alternating rounds ({'quick' if args.quick else 'full'} sizes, precompile "
          f"{args.precompile} where the engine has it)")
    print(f"{'metric':<30} {commit:>10} {'current':>10} {'current/' + commit:>16}")
    table = {}
    for label, key, field in metrics:
        a, b = med(commit, key, field), med("current", key, field)
        table[label] = {commit: a, "current": b}
        ratio = f"{b / a:16.2f}" if a else f"{'-':>16}"
        print(f"{label:<30} {a:10.2f} {b:10.2f} {ratio}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rev": commit, "rounds": rounds, "table": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
