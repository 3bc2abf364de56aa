"""Splitting a reasoning model's output into its reasoning and its answer (`separate_reasoning`).

Covers the think-tag formats of SGLang's `ReasoningParser` (srt/parser/reasoning_parser.py): the text
between a start tag (`<think>`) and an end tag (`</think>`) is the reasoning, what follows the end tag is
the answer. Keyed by SGLang's names. `force_reasoning`: the model starts reasoning without emitting the
start tag (DeepSeek-R1's template opens it in the prompt), so everything before the end tag is reasoning.
`tool_start`: a tool call that opens before the end tag ends the reasoning too (Qwen3, GLM-4.5).
Formats that are not think tags (gpt-oss's harmony channels, Kimi K2's, ...) are not implemented.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    force_reasoning: bool = False
    tool_start: str | None = None


_THINK = ("<think>", "</think>")
_DEEPSEEK_R1 = ReasoningFormat(*_THINK, force_reasoning=True)
_QWEN3 = ReasoningFormat(*_THINK, tool_start="<tool_call>")
_QWEN3_FORCED = ReasoningFormat(*_THINK, force_reasoning=True, tool_start="<tool_call>")

# SGLang's --reasoning-parser names whose detector is a plain think-tag split.
REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "deepseek-r1": _DEEPSEEK_R1,
    "step3": _DEEPSEEK_R1,
    "step3p5": _DEEPSEEK_R1,
    "gigachat35": _DEEPSEEK_R1,
    "qwen3": _QWEN3,
    "dots": _QWEN3,
    "nanbeige": _QWEN3,
    "interns1": _QWEN3,
    "qwen3-thinking": _QWEN3_FORCED,  # SGLang forces reasoning for these three
    "minimax": _QWEN3_FORCED,
    "glm45": _QWEN3,
    "kimi": ReasoningFormat("◁think▷", "◁/think▷"),
    "mistral": ReasoningFormat("[THINK]", "[/THINK]"),
}


class ReasoningParser:
    """`ReasoningParser("qwen3").parse_non_stream(text) -> (reasoning, answer)`, as SGLang's."""

    def __init__(self, model_type: str | None) -> None:
        if not model_type:
            raise ValueError("separate_reasoning needs model_type, the reasoning parser's name "
                             f"(one of {sorted(REASONING_FORMATS)})")
        fmt = REASONING_FORMATS.get(model_type.lower())
        if fmt is None:
            raise ValueError(f"unsupported reasoning parser {model_type!r}: jsgl implements the think-tag "
                             f"formats {sorted(REASONING_FORMATS)}")
        self.model_type = model_type
        self.format = fmt

    def parse_non_stream(self, text: str) -> tuple[str, str]:
        fmt = self.format
        if not fmt.force_reasoning and fmt.start not in text:
            return "", text
        body = text
        stripped = body.lstrip()
        if stripped.startswith(fmt.start):  # the model opened the block itself (possibly after blanks)
            body = stripped
            while body.startswith(fmt.start):
                body = body[len(fmt.start):]
        if fmt.end in body:
            reasoning, answer = body.split(fmt.end, 1)
            return reasoning, answer
        if fmt.tool_start and fmt.tool_start in body:  # a tool call ends the reasoning; it stays in the answer
            at = body.index(fmt.tool_start)
            return body[:at], body[at:]
        return body, ""  # cut off (max_tokens) before the end tag: all of it is reasoning
