"""A fresh in-process engine's start-up and first runs, per precompile mode: what a notebook's first cell, an
experiment or a benchmark meets (`Engine()` defaults to ``precompile="background"``).

    python experiments/bench_startup.py            # or: jsgl bench startup
    python experiments/bench_startup.py --quick    # tiny sizes: a smoke test

Every row is a fresh process (spawned) that builds `Engine(precompile=MODE, kv_cache_gb=0.5)` and runs two
workloads, each twice with the prefix cache flushed between: decode at batch 16 (bench_decode's prompts, 64 greedy
tokens each) and 16 JSON-by-regex requests (bench_serve's; greedy). What each figure includes:

- cache: XLA's persistent compilation cache and jsgl's executable store. "cold": new empty folders
  (``JSGL_JAX_CACHE``, ``JSGL_EXECUTABLE_STORE_DIR``), so every shape compiles; "warm": the same folders again, in
  a new process, so compiles are loads (with every planned shape stored, ``background`` loads them at start).
  Weights come from jsgl's checkpoint cache and the regex's token index from its disk cache in both (after their
  first build ever).
- startup s: constructing the engine: model load, pool, and with ``common`` the precompile itself.
- ready s: from the start of construction until the background precompile is done (an idle engine).
- ``background`` runs twice: "at once" starts the workloads as soon as `Engine()` returns, "when ready" after
  `engine.wait_compiled()`.
- first s, second s: wall seconds of a workload's first and second run (its whole `generate`: prefill, decode,
  for JSON the regex's index load on the first); ratio first / second, the median of ``--rounds`` processes.
- compiles: XLA compiles during the first run on any thread but the background precompile's (a stall on the
  request path: step shapes, the sampler and small jits, loads from the persistent cache included), the most
  any round met; a second run compiled nothing in any row unless flagged.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

ROWS = [("off", False), ("background", False), ("background", True), ("common", False)]


def child(mode: str, when_ready: bool, cache: str, quick: bool) -> dict[str, Any]:
    """One fresh engine in this (spawned) process: its start-up and both runs of each workload."""
    os.environ["JSGL_JAX_CACHE"] = cache
    os.environ["JSGL_EXECUTABLE_STORE_DIR"] = cache + "-executables"  # cold and warm as XLA's cache is
    from jsgl.experiments.bench_decode import PROMPTS
    from jsgl.experiments.bench_serve import JSON_PROMPT, JSON_REGEX, XlaCompiles

    from jsgl.engine.engine import Engine
    from jsgl.engine.precompiler import BACKGROUND_THREAD

    compiles = XlaCompiles()
    t0 = time.perf_counter()
    engine = Engine(precompile=mode, kv_cache_gb=0.5)
    result: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "ready_s": None, "workloads": {}}
    try:
        if when_ready:
            engine.wait_compiled()
            result["ready_s"] = time.perf_counter() - t0
        n, new = (4, 8) if quick else (16, 64)
        chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": JSON_PROMPT}], tokenize=False,
                                                    add_generation_prompt=True)
        workloads = {"decode b16": (PROMPTS[:n], {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}),
                     "json regex": ([chat] * n, {"regex": JSON_REGEX, "max_new_tokens": 64, "temperature": 0})}
        for name, (prompts, params) in workloads.items():
            runs, texts = [], []
            for _ in range(2):
                engine.flush_cache()
                mark = len(compiles)
                start = time.perf_counter()
                texts.append([o.text for o in engine.generate(prompts, params, progress=False)])
                runs.append({"wall_s": time.perf_counter() - start,
                             "compiled": [fn for fn, thread in compiles.since(mark, with_threads=True)
                                          if thread != BACKGROUND_THREAD]})
            result["workloads"][name] = {"runs": runs, "same_text": texts[0] == texts[1], "text": texts[0]}
        stats = engine.stats()
        result["stats"] = {k: stats[k] for k in ("compiles", "compiled_at_start", "compiled_in_background",
                                                 "compiled_on_request_path", "background_compile_s")}
    finally:
        engine.shutdown()
        compiles.close()
    return result


def run_row(mode: str, when_ready: bool, cache: str, quick: bool) -> dict[str, Any]:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(child, mode, when_ready, cache, quick).result()


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds of one row."""
    def med(xs: list[float | None]) -> float | None:
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    out: dict[str, Any] = {"startup_s": med([r["startup_s"] for r in results]),
                           "ready_s": med([r["ready_s"] for r in results]), "workloads": {}}
    for name in results[0]["workloads"]:
        ws = [r["workloads"][name] for r in results]
        first = [w["runs"][0]["wall_s"] for w in ws]
        second = [w["runs"][1]["wall_s"] for w in ws]
        out["workloads"][name] = {
            "first_s": med(first), "second_s": med(second),
            "ratio": med([f / s for f, s in zip(first, second)]),
            "ratios": [f / s for f, s in zip(first, second)],
            "first_compiles": max(len(w["runs"][0]["compiled"]) for w in ws),
            "second_compiles": max(len(w["runs"][1]["compiled"]) for w in ws),
            "same_text": all(w["same_text"] for w in ws)}
    return out


def print_table(table: dict[str, dict[str, Any]], rounds: int) -> None:
    names = list(next(iter(table.values()))["workloads"])
    print(f"\nmedians of {rounds} fresh process(es) a row; compiles: XLA compiles on the request path in a first run "
          "(the most in any round)")
    head = f"{'precompile':<22} {'cache':<5} {'startup s':>9} {'ready s':>8}"
    for name in names:
        head += f" | {name:>10}: first s second s ratio compiles"
    print(head)
    for label, r in table.items():
        mode, cache = label.rsplit(" ", 1)
        ready = f"{r['ready_s']:8.2f}" if r["ready_s"] is not None else f"{'-':>8}"
        line = f"{mode:<22} {cache:<5} {r['startup_s']:9.2f} {ready}"
        for name in names:
            w = r["workloads"][name]
            flag = "" if w["second_compiles"] == 0 and w["same_text"] else " (!)"
            line += f" | {'':>10}  {w['first_s']:7.2f} {w['second_s']:8.2f} {w['ratio']:5.2f} {w['first_compiles']:8d}"
            line += flag
        print(line)
    print("(!): a second run compiled, or its greedy text differed from the first's")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=None, help="fresh processes a row (default 3; --quick: 1)")
    ap.add_argument("--modes", nargs="+", default=None, choices=["off", "background", "common"],
                    help="precompile modes to run (default: all three)")
    ap.add_argument("--quick", action="store_true", help="tiny workloads, one round: a smoke test")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    rows = [(mode, ready) for mode, ready in ROWS if args.modes is None or mode in args.modes]
    table: dict[str, dict[str, Any]] = {}
    texts: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="jsgl-xla-cache-") as scratch:
        for mode, when_ready in rows:
            label = mode + (" when ready" if when_ready else " at once" if mode == "background" else "")
            per_cache: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
            for i in range(rounds):
                cache = os.path.join(scratch, f"{mode}-{when_ready}-{i}")  # empty: cold; then the same: warm
                for state in ("cold", "warm"):
                    result = run_row(mode, when_ready, cache, args.quick)
                    per_cache[state].append(result)
                    texts.add(json.dumps({k: w["text"] for k, w in result["workloads"].items()}))
                    print(f"{label} {state} round {i + 1}: startup {result['startup_s']:.1f} s, "
                          + ", ".join(f"{k} {w['runs'][0]['wall_s']:.2f}/{w['runs'][1]['wall_s']:.2f} s"
                                      for k, w in result["workloads"].items()), flush=True)
            for state, results in per_cache.items():
                table[f"{label} {state}"] = summarize(results)
    print_table(table, rounds)
    print(f"greedy outputs the same in every row and round: {len(texts) == 1}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rounds, "rows": table, "same_outputs": len(texts) == 1}, f, indent=2)
    return 0 if len(texts) == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
