"""Role markers for `with s.user():` and friends, taken from the model's own chat template.

Rather than keeping a table of templates per model family, we render probe conversations with the
tokenizer's `apply_chat_template` and cut the text around a marker: what precedes the marker is the role's
prefix, what follows it the suffix. The prefix may depend on the history (first message, alternation), so
it is computed for the roles seen so far and cached.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

_MARK = "\x1fJSGL-PROBE\x1f"
_MARK_SYS = "\x1fJSGL-SYSTEM\x1f"
_FILLER = "x"  # content of earlier probe messages; its exact value does not matter for the markers


class ChatTemplate:
    """Fixed role markers, and the base for templates derived from a tokenizer."""

    def __init__(
        self,
        name: str = "plain",
        role_markers: dict[str, tuple[str, str]] | None = None,
        default_system_prompt: str | None = None,
        stop_str: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.role_markers = role_markers or {
            "system": ("", "\n\n"),
            "user": ("USER: ", "\n"),
            "assistant": ("ASSISTANT: ", "\n"),
        }
        # Inserted as a system message before the first non-system message, as the template itself would.
        self.default_system_prompt = default_system_prompt
        self.stop_str = list(stop_str)
        self.image_token = "<image>"

    def get_prefix_and_suffix(self, role: str, history: Sequence[dict[str, Any]]) -> tuple[str, str]:
        if role not in self.role_markers:
            raise ValueError(f"unknown role {role!r}; expected one of {sorted(self.role_markers)}")
        return self.role_markers[role]

    def __repr__(self) -> str:
        return f"ChatTemplate({self.name!r})"


class TokenizerChatTemplate(ChatTemplate):
    """Role markers of a Hugging Face tokenizer's `chat_template`, found by rendering probes."""

    def __init__(self, tokenizer: Any, name: str | None = None) -> None:
        super().__init__(name=name or getattr(tokenizer, "name_or_path", "") or "tokenizer")
        self.tokenizer = tokenizer
        self.default_system_prompt = self._find_default_system_prompt()

    def _render(self, messages: list[dict[str, str]]) -> str:
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)

    def _find_default_system_prompt(self) -> str | None:
        """The system text the template inserts when a conversation opens without one, if any."""
        try:
            sys_only = self._render([{"role": "system", "content": _MARK_SYS}])
            with_sys = self._render([{"role": "system", "content": _MARK_SYS}, {"role": "user", "content": _MARK}])
            user_only = self._render([{"role": "user", "content": _MARK}])
        except Exception:  # template without a system role, or one that rejects lone messages
            return None
        if not with_sys.startswith(sys_only) or _MARK_SYS not in sys_only:
            return None
        user_part = with_sys[len(sys_only):]
        head = user_only[: user_only.find(user_part)] if user_part and user_part in user_only else ""
        sys_prefix, sys_suffix = sys_only.split(_MARK_SYS, 1)
        if head and head.startswith(sys_prefix) and head.endswith(sys_suffix) and len(head) > len(sys_prefix):
            return head[len(sys_prefix): len(head) - len(sys_suffix)] or None
        return None

    def get_prefix_and_suffix(self, role: str, history: Sequence[dict[str, Any]]) -> tuple[str, str]:
        return self._markers(role, tuple(m["role"] for m in history))

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one template object per backend, lives as long
    def _markers(self, role: str, history_roles: tuple[str, ...]) -> tuple[str, str]:
        history = [{"role": r, "content": _FILLER} for r in history_roles]
        try:
            before = self._render(history)
            after = self._render(history + [{"role": role, "content": _MARK}])
        except Exception as exc:
            if history_roles:  # e.g. a template that insists on alternation: use the markers without history
                return self._markers(role, ())
            warnings.warn(f"chat template cannot render role {role!r} ({exc}); using plain markers",
                          stacklevel=2)
            return ChatTemplate().get_prefix_and_suffix(role, ())
        if _MARK not in after:
            raise ValueError(f"chat template {self.name!r} drops the content of {role!r} messages")
        # Normally `before` is a prefix of `after`; if the template rewrites earlier text, keep what is common.
        common = 0
        limit = min(len(before), len(after))
        while common < limit and before[common] == after[common]:
            common += 1
        segment = after[common:]
        prefix, suffix = segment.split(_MARK, 1)
        return prefix, suffix


def get_chat_template_from_tokenizer(tokenizer: Any) -> ChatTemplate:
    """The tokenizer's template if it has one, else plain `USER:`/`ASSISTANT:` markers."""
    if getattr(tokenizer, "chat_template", None):
        return TokenizerChatTemplate(tokenizer)
    return ChatTemplate()
