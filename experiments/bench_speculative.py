"""Speculative decoding (n-gram drafts verified in one step) against plain decoding, side by side in one run.

    jsgl bench speculative                    # batch 1 and 16; JSON, extract, chat
    jsgl bench speculative --batches 1 --rounds 3 --workloads extract

Three workloads, greedy, each request from an empty prefix cache (flushed before every run, so no draft comes from
an earlier round's answer):
- json: W3-style extraction of a fixed schema from a paragraph about a city (bench_json's), constrained; without
  speculation each jump-forward is an extend step, with it the forced run rides the verify step;
- extract: quote the sentences of a Wikipedia paragraph (BoolQ's passages) that answer its question: answers copy
  the prompt, which prompt lookup finds;
- chat: ShareGPT first turns (free text: drafts rarely right).

With ``--fold``, a third engine has speculation on but proposes no draft: jump-forward's forced runs ride decode steps
as rows and nothing else changes (the JSON workload's "folded" column).

Per workload and batch size: output tokens/s (wall time of the batch from submit to the last result, prefill
included), the speedup, the acceptance length (tokens per drafted request-step: accepted drafts + 1), the share of
decode steps that verified drafts, and whether the outputs equal plain decoding's. Batch 1 runs its requests one
after another; batch 16 submits them together. Medians over rounds, after an untimed warm-up run of each cell
(compiles).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from jsgl.experiments.bench_json import SCHEMA, city_prompts
from jsgl.experiments.datasets import boolq_rows, sharegpt_first_turns

WORKLOADS = ("json", "extract", "chat")
QUOTE = "Quote, word for word, the sentences of this passage that answer the question \"{q}?\"\n\n{p}"


def prompts_for(workload: str, n: int, tokenizer: Any) -> tuple[list[str], dict[str, Any]]:
    """``n`` chat-formatted prompts of ``workload`` and its sampling parameters."""
    if workload == "json":
        return city_prompts(n, tokenizer), {"json_schema": SCHEMA, "max_new_tokens": 160}
    if workload == "extract":
        rows = [r for r in boolq_rows() if len(r["passage"]) < 900][:n]
        texts = [QUOTE.format(q=r["question"], p=r["passage"]) for r in rows]
    else:
        texts = [t for t in sharegpt_first_turns(4 * n) if len(t) < 600][:n]
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
            for t in texts]
    return chat, {"max_new_tokens": 128}


def run(engine: Any, prompts: list[str], params: dict[str, Any], batch: int) -> dict[str, Any]:
    """One timed run: ``prompts`` in groups of ``batch`` submitted together, each group after the last finished."""
    engine.flush_cache()
    before = engine.stats()
    params = {"temperature": 0.0, **params}
    outputs = []
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch):
        group = prompts[start: start + batch]
        outputs += [h.result() for h in engine.submit_batch(group, [params] * len(group))]
    wall = time.perf_counter() - t0
    after = engine.stats()
    tokens = sum(o.completion_tokens for o in outputs)
    spec0, spec1 = before["speculative"], after["speculative"]
    decode_steps = after["decode_steps"] - before["decode_steps"]
    result = {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "ids": [o.token_ids for o in outputs],
              "decode_steps": decode_steps, "extend_steps": after["extend_steps"] - before["extend_steps"]}
    if spec1 is not None:
        drafted = spec1["drafted_requests"] - spec0["drafted_requests"]
        accepted = spec1["accepted"] - spec0["accepted"]
        result.update(acceptance_length=accepted / drafted + 1 if drafted else 0.0,
                      verify_share=(spec1["verify_steps"] - spec0["verify_steps"]) / max(decode_steps, 1))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--requests-b1", type=int, default=4, help="requests of a batch-1 run (one after another)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=None, help="--speculative-max-batch (default: the platform's)")
    ap.add_argument("--fold", action="store_true",
                    help="also an engine that folds jump-forward into decode steps but proposes no drafts")
    ap.add_argument("--precompile", default="background", choices=["background", "common", "off"],
                    help="the engines' precompile (background: waited for before the first run)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    from jsgl.engine.engine import Engine

    common = dict(kv_cache_gb=0.5, max_running_requests=max(64, max(args.batches)), precompile=args.precompile)
    engines = {"off": Engine(**common),
               "on": Engine(**common, speculative_algorithm="ngram", speculative_num_draft_tokens=args.draft_tokens,
                            speculative_max_batch=args.max_batch)}
    if args.fold:
        from jsgl.engine.speculative import DraftProposer

        class NoDrafts(DraftProposer):
            def propose(self, seq: Any, num_tokens: int) -> list[int]:
                return []

        engines["fold"] = Engine(**common, speculative_algorithm="ngram", speculative_max_batch=args.max_batch)
        engines["fold"].loop.speculator.proposer = NoDrafts()
    for engine in engines.values():
        if args.precompile != "off":
            engine.wait_compiled()
    rows = []
    for workload in args.workloads:
        for batch in args.batches:
            n = args.requests_b1 if batch == 1 else batch
            prompts, params = prompts_for(workload, n, engines["off"].tokenizer)
            cells: dict[str, list[dict[str, Any]]] = {mode: [] for mode in engines}
            for round_ in range(args.rounds + 1):  # round 0: warm-up (compiles), not counted
                for mode, engine in engines.items():
                    result = run(engine, prompts, params, batch)
                    if round_:
                        cells[mode].append(result)
            off, on = cells["off"], cells["on"]
            med = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
            row = {"workload": workload, "batch": batch, "requests": n, "tokens": off[0]["tokens"],
                   "off_tok_s": med(off, "tok_s"), "on_tok_s": med(on, "tok_s"),
                   "acceptance_length": med(on, "acceptance_length"), "verify_share": med(on, "verify_share"),
                   "off_extend_steps": med(off, "extend_steps"), "on_extend_steps": med(on, "extend_steps"),
                   "same_outputs": all(a["ids"] == b["ids"] for a, b in zip(off, on))}
            row["speedup"] = row["on_tok_s"] / row["off_tok_s"]
            if "fold" in cells:
                row["fold_tok_s"] = med(cells["fold"], "tok_s")
                row["fold_speedup"] = row["fold_tok_s"] / row["off_tok_s"]
                row["fold_extend_steps"] = med(cells["fold"], "extend_steps")
                row["same_outputs"] &= all(a["ids"] == b["ids"] for a, b in zip(off, cells["fold"]))
                print(f"{workload:<8} b{batch:<3} folded, no drafts: {row['fold_tok_s']:7.1f} tok/s "
                      f"({row['fold_speedup']:.2f}x), extend steps {row['fold_extend_steps']:g}", flush=True)
            rows.append(row)
            print(f"{workload:<8} b{batch:<3} {row['off_tok_s']:7.1f} -> {row['on_tok_s']:7.1f} tok/s "
                  f"({row['speedup']:.2f}x), acceptance length {row['acceptance_length']:.2f}, verify steps "
                  f"{row['verify_share']:.0%}, extend steps {row['off_extend_steps']:g} -> "
                  f"{row['on_extend_steps']:g}, same outputs {row['same_outputs']}", flush=True)
    for engine in engines.values():
        engine.shutdown()

    print("\n| workload | batch | tokens | off tok/s | on tok/s | speedup | acceptance length | verify steps | "
          "extend steps off/on | same outputs |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['batch']} | {r['tokens']} | {r['off_tok_s']:.1f} | {r['on_tok_s']:.1f} | "
              f"**{r['speedup']:.2f}x** | {r['acceptance_length']:.2f} | {r['verify_share']:.0%} | "
              f"{r['off_extend_steps']:g}/{r['on_extend_steps']:g} | {r['same_outputs']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
