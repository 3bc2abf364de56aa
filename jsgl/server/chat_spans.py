"""A chat template rendered so that the special-token strings the client wrote are known: they become plain spans.

Before the template sees them, every string of the request (message contents, tool calls, tool definitions,
chat_template_kwargs) has each special token's string wrapped in two private-use characters. After rendering,
the wrappers are removed and what they wrapped becomes a plain span of the `SpannedPrompt`, tokenized as text;
the template's own markers carry no wrapper and stay control tokens. (transformers 5 does the same in
`apply_chat_template(sanitize_control_tokens=True)`; jsgl also runs on transformers 4.) Dict keys are not
marked: they are field names, not text the template writes out.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from jsgl.engine.spanned_prompt import SpannedPrompt, special_token_pattern

# Supplementary Private Use Area-A: in no tokenizer's text, and stripped from the client's strings first.
OPEN, CLOSE = "\U000f0000", "\U000f0001"


def mark_special_tokens(value: Any, pattern: re.Pattern[str]) -> Any:
    """``value`` (a string, or lists and dicts of them) with each special token's string wrapped."""
    if isinstance(value, str):
        value = value.replace(OPEN, "").replace(CLOSE, "")  # a client's own wrapper could forge a plain span
        return pattern.sub(f"{OPEN}\\g<0>{CLOSE}", value)
    if isinstance(value, dict):
        return {key: mark_special_tokens(item, pattern) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [mark_special_tokens(item, pattern) for item in value]
    return value


@functools.lru_cache(maxsize=8)
def _wrapped(pattern: re.Pattern[str]) -> re.Pattern[str]:
    return re.compile(f"{OPEN}({pattern.pattern}){CLOSE}|[{OPEN}{CLOSE}]")


def unmark(rendered: str, pattern: re.Pattern[str]) -> SpannedPrompt:
    """The rendered text without wrappers, each wrapped token a plain span. A lone wrapper (a template that cut a
    wrapped token apart) leaves an empty span: no special token may form across the cut either."""
    pieces: list[str] = []
    plain: list[tuple[int, int]] = []
    length = last = 0
    for match in _wrapped(pattern).finditer(rendered):
        pieces.append(rendered[last:match.start()])
        length += match.start() - last
        token = match.group(1) or ""
        plain.append((length, length + len(token)))
        pieces.append(token)
        length += len(token)
        last = match.end()
    pieces.append(rendered[last:])
    return SpannedPrompt("".join(pieces), tuple(plain))


def render_chat_spans(tokenizer: Any, messages: list[dict[str, Any]], **template_kwargs: Any) -> SpannedPrompt:
    """``tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)``, the client's special-token
    strings as plain spans. Without any, the text is exactly the plain render and has no spans."""
    pattern = special_token_pattern(tokenizer)
    rendered = tokenizer.apply_chat_template(mark_special_tokens(messages, pattern), tokenize=False,
                                             **mark_special_tokens(template_kwargs, pattern))
    return unmark(rendered, pattern)
