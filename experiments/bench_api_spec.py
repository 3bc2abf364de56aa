"""API speculative execution (paper §5): API calls and tokens saved on a multi-field extraction workload.

The same extraction template (a few examples, then one `gen` per field) runs over a set of short
biographies through the DSL's `OpenAI` backend, once normally (one call per field) and once with
`num_api_spec_tokens` (the first call speculates the remaining fields). Reported: calls, prompt and
completion tokens, wall time, how many gens speculation served, and whether the extracted values agree.

    python experiments/bench_api_spec.py                  # launches `jsgl serve`, completion API
    python experiments/bench_api_spec.py --chat           # chat API: speculation per assistant turn
    python experiments/bench_api_spec.py --base-url https://api.openai.com/v1 --model gpt-3.5-turbo-instruct
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import jsgl.lang as sgl
from jsgl.lang.openai_backend import OpenAI

FIELDS = ("name", "age", "city", "job")
EXAMPLES = [("Alice", 30, "Paris", "teacher"), ("Bob", 45, "Berlin", "baker")]
NAMES = ["Carol", "Dan", "Eve", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Mallory", "Niaj", "Olivia", "Peggy",
         "Rupert", "Sybil", "Trent", "Victor", "Walter", "Yara", "Zoe", "Quentin"]
CITIES = ["Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Madrid", "Dublin", "Vienna", "Quito", "Seoul"]
JOBS = ["nurse", "pilot", "farmer", "lawyer", "painter", "chef", "plumber", "writer", "dentist", "singer"]


def biography(name: str, age: int, city: str, job: str) -> str:
    return f"{name} is a {age}-year-old {job} who lives in {city}."


def make_people(n: int, seed: int) -> list[tuple[str, int, str, str]]:
    rng = random.Random(seed)
    return [(NAMES[i % len(NAMES)], rng.randint(20, 70), rng.choice(CITIES), rng.choice(JOBS)) for i in range(n)]


def _card(person: tuple[str, int, str, str]) -> str:
    return "".join(f"{f.capitalize()}: {v}\n" for f, v in zip(FIELDS, person, strict=True))


def completion_program(num_spec: int | None) -> Any:
    def extract(s, bio):
        s += "Extract the person's name, age, city and job.\n\n"
        for ex in EXAMPLES:
            s += "Text: " + biography(*ex) + "\n" + _card(ex) + "\n"
        s += "Text: " + bio + "\n"
        for field in FIELDS:
            # No blank before the gen: the model's text starts with it, so speculated and called text
            # tokenize the same way.
            s += field.capitalize() + ":" + sgl.gen(field, stop="\n", max_tokens=12, temperature=0) + "\n"

    return sgl.function(extract, num_api_spec_tokens=num_spec)


def chat_program(num_spec: int | None) -> Any:
    def extract(s, bio):
        s += sgl.system("Extract the person's name, age, city and job, one field per line.")
        for ex in EXAMPLES:
            s += sgl.user(biography(*ex))
            s += sgl.assistant(_card(ex).strip())
        s += sgl.user(bio)
        with s.assistant():
            for i, field in enumerate(FIELDS):
                s += ("\n" if i else "") + field.capitalize() + ":"
                s += sgl.gen(field, stop="\n", max_tokens=12, temperature=0)

    return sgl.function(extract, num_api_spec_tokens=num_spec)


def run(backend: OpenAI, program: Any, people: list[tuple[str, int, str, str]], threads: int) -> dict[str, Any]:
    backend.reset_usage()
    t0 = time.perf_counter()
    states = program.run_batch([{"bio": biography(*p)} for p in people], backend=backend, num_threads=threads)
    values = []
    for st in states:
        st.text()  # wait for every gen
        values.append(None if st.error() is not None else tuple(st[f].strip() for f in FIELDS))
    wall = time.perf_counter() - t0
    correct = sum(v is not None and v == tuple(str(x) for x in p) for v, p in zip(values, people, strict=True))
    return {**backend.usage.as_dict(), "wall_s": round(wall, 2), "programs": len(people),
            "failed": sum(v is None for v in values), "exact_match": correct, "values": values}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="an OpenAI-compatible /v1 (default: launch jsgl serve)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--chat", action="store_true", help="use the chat API (speculation per assistant turn)")
    parser.add_argument("--num-programs", type=int, default=16)
    parser.add_argument("--num-api-spec-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    server = None
    base_url = args.base_url
    if base_url is None:
        from jsgl.server.launch import launch_server_process

        server = launch_server_process(model=args.model, kv_cache_gb=0.25)
        base_url = server.url + "/v1"
    try:
        people = make_people(args.num_programs, args.seed)
        make = chat_program if args.chat else completion_program
        results = {}
        for label, num_spec in (("normal", None), ("speculative", args.num_api_spec_tokens)):
            # The backend-wide setting is a fallback for interpreters that do not pass the program's own.
            backend = OpenAI(args.model, base_url=base_url, api_key=args.api_key, is_chat_model=args.chat,
                             num_api_spec_tokens=num_spec, continue_final_message=server is not None)
            results[label] = run(backend, make(num_spec), people, args.threads)
        normal, spec = results["normal"], results["speculative"]
        agree = sum(a == b for a, b in zip(normal.pop("values"), spec.pop("values"), strict=True))
        summary = {
            "api": "chat" if args.chat else "completion", "model": args.model, "normal": normal, "speculative": spec,
            "call_reduction": round(1 - spec["api_calls"] / max(normal["api_calls"], 1), 3),
            "prompt_token_reduction": round(1 - spec["prompt_tokens"] / max(normal["prompt_tokens"], 1), 3),
            "programs_with_same_values": agree,
        }
        print(json.dumps(summary, indent=2))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(summary, f, indent=2)
    finally:
        if server is not None:
            server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
