"""Grammar backends: the seam between the engine and whatever compiles a request's grammar into token masks.

A backend turns a request's constraint (one of GRAMMAR_FIELDS) into a compiled grammar off the engine
thread (`compile` returns a Future), and a compiled grammar into per-request state with `new_constraint`
(the engine's TokenConstraint protocol: packed uint32 mask, advance, is_terminated), so every backend's
masks go through the same batched sampler. Jump-forward is optional: `forced_tail` says which tokens are
forced next, `commit_tail` moves the constraint over them.

Two backends:
  * JsglGrammarBackend -- jsgl's own compressed FSM (regex, JSON schema; text jump-forward with
    retokenization of the last sampled token; builds in child processes, cached in memory and on disk).
  * LlguidanceBackend (llguidance_backend.py, optional dependency) -- also SGLang's `ebnf` grammars
    and `structural_tag`; forced tokens from llguidance's own fast-forward.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Protocol

import numpy as np

from jsgl.errors import InvalidRequestError
from jsgl.fsm.cache import get_index_async, release_index, start_build_workers
from jsgl.fsm.constraint import RegexConstraint
from jsgl.fsm.json_schema import json_schema_to_regex
from jsgl.fsm.regex_fsm import validate_regex
from jsgl.fsm.token_index import TokenIndex
from jsgl.fsm.vocab import vocab_bytes

GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")
BACKENDS = ("jsgl", "llguidance")
MIN_JUMP_CHARS = 2  # a one-character jump saves nothing over a masked decode step
# Output tokens before the last sampled one that jump-forward decodes with it, to read the text it adds there.
RETOKENIZE_CONTEXT_TOKENS = 4


@dataclass(frozen=True)
class GrammarSpec:
    """A request's constraint: which field it came in (`kind`) and its value (a dict only for json_schema)."""

    kind: str
    value: str | dict

    def text(self) -> str:
        """The value as text (a schema dict serialized in its own key order: the order is the output's)."""
        return self.value if isinstance(self.value, str) else json.dumps(self.value, ensure_ascii=False)


def grammar_spec(params: Any) -> GrammarSpec | None:
    """The constraint a request's sampling params carry, or None. InvalidRequestError for more than one."""
    given = [(name, getattr(params, name, None)) for name in GRAMMAR_FIELDS]
    given = [(name, value) for name, value in given if value is not None]
    if len(given) > 1:
        raise InvalidRequestError(f"give at most one of {', '.join(GRAMMAR_FIELDS)} (got {[n for n, _ in given]})")
    if not given:
        return None
    kind, value = given[0]
    if not isinstance(value, str) and not (kind == "json_schema" and isinstance(value, dict)):
        raise InvalidRequestError(f"{kind} must be a string{' or an object' if kind == 'json_schema' else ''}")
    return GrammarSpec(kind, value)


class GrammarConstraint(Protocol):
    """Structural twin of jsgl.engine.request.TokenConstraint (the fsm layer cannot import the engine)."""

    def allowed_token_bitmask(self) -> np.ndarray: ...

    def advance(self, token_id: int) -> None: ...

    def is_terminated(self) -> bool: ...

    def copy(self) -> GrammarConstraint: ...


@dataclass
class ForcedTail:
    """A jump-forward: replace the last `drop` output tokens (0, or 1 when the last sampled token was
    retokenized together with the forced text) by `tokens`. `text` is the forced text when the backend
    tracks it (the detokenizer appends it as is); None means: decode the tokens like sampled ones."""

    tokens: list[int]
    drop: int
    text: str | None = None


def eos_bitmask(eos_ids: Iterable[int], vocab_size: int) -> np.ndarray:
    """Read-only packed mask of `eos_ids` (ids outside the vocabulary ignored)."""
    mask = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)
    for i in eos_ids:
        if 0 <= i < vocab_size:
            mask[i >> 5] |= np.uint32(1 << (i & 31))
    mask.setflags(write=False)
    return mask


class GrammarBackend(ABC):
    """Compiles grammars for one tokenizer and model vocabulary size (masks are ceil(vocab_size/32) words)."""

    name: ClassVar[str]
    kinds: ClassVar[frozenset[str]]  # the GRAMMAR_FIELDS it compiles
    jump_forward: ClassVar[bool]  # whether forced_tail can ever return something

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def check(self, spec: GrammarSpec) -> None:
        """InvalidRequestError when this backend cannot compile `spec.kind` at all."""
        if spec.kind not in self.kinds:
            raise InvalidRequestError(f"{spec.kind} constraints are not supported by the {self.name} grammar backend")

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Future:
        """Caller thread: check `spec` (InvalidRequestError when it is bad on its face) and start compiling it
        off the engine thread. The Future resolves to the compiled grammar, or fails with InvalidRequestError."""

    @abstractmethod
    def new_constraint(self, compiled: Any, eos_ids: Iterable[int]) -> GrammarConstraint:
        """Fresh per-request state over a compiled grammar. `eos_ids` are allowed exactly where the grammar
        accepts (the request's stop tokens: none under ignore_eos)."""

    def release(self, future: Future) -> None:  # noqa: B027  (optional hook: most backends hold nothing)
        """The request no longer needs `future` (an unshared build may stop)."""

    def warm(self) -> None:  # noqa: B027  (optional hook)
        """Do now, at engine start, the per-tokenizer work a first grammar would otherwise wait for."""

    def forced_tail(self, constraint: Any, output_ids: list[int]) -> ForcedTail | None:
        """The tokens every continuation starts with, or None (no jump-forward by default)."""
        return None

    def commit_tail(self, constraint: Any, tail: ForcedTail) -> None:
        """Move `constraint` over a tail from forced_tail (before the engine appends its tokens)."""
        raise NotImplementedError(f"the {self.name} backend has no jump-forward")


class JsglGrammarBackend(GrammarBackend):
    """jsgl's compressed FSM: regex and JSON schema (as a regex), text jump-forward + retokenization."""

    name = "jsgl"
    kinds = frozenset({"regex", "json_schema"})
    jump_forward = True

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
        start_build_workers()  # now, so the first constrained request does not wait for them

    def check(self, spec: GrammarSpec) -> None:
        if spec.kind not in self.kinds:
            raise InvalidRequestError(f"{spec.kind} needs the llguidance grammar backend: start the server with "
                                      "--grammar-backend llguidance, or Engine(grammar_backend=\"llguidance\") "
                                      "(pip install llguidance)")

    def compile(self, spec: GrammarSpec) -> Future[TokenIndex]:
        self.check(spec)
        regex = spec.value if spec.kind == "regex" else json_schema_to_regex(spec.value)
        validate_regex(regex)
        return get_index_async(regex, self.tokenizer, self.vocab_size)

    def new_constraint(self, compiled: TokenIndex, eos_ids: Iterable[int]) -> RegexConstraint:
        return RegexConstraint(compiled, eos_ids)

    def release(self, future: Future) -> None:
        release_index(future)

    def warm(self) -> None:
        vocab_bytes(self.tokenizer)  # every token's bytes: 0.3-0.6 s, which a first regex request waited for

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    @cached_property
    def _anchor(self) -> tuple[str, int] | None:
        """A special token (text, id) to encode after, or None. SentencePiece-style tokenizers (Metaspace)
        put a space before the start of what they encode, but not after a special token."""
        for text in (getattr(self.tokenizer, name, None) for name in ("bos_token", "eos_token", "unk_token")):
            if isinstance(text, str) and text:
                ids = self._encode(text)
                if len(ids) == 1:
                    return text, ids[0]
        return None

    def _continuation_ids(self, text: str) -> list[int]:
        """Tokens of `text` as it continues an output: with no space put before it."""
        if self._anchor is not None:
            anchor_text, anchor_id = self._anchor
            ids = self._encode(anchor_text + text)
            if ids[:1] == [anchor_id]:
                return ids[1:]
        return self._encode(text)

    def forced_tail(self, constraint: RegexConstraint, output_ids: list[int]) -> ForcedTail | None:
        """The forced text, tokenized together with the last sampled token (which has no KV yet): the model
        then sees the tokenization it was trained on. Kept apart where that would not give the same text
        after the tokens before it (a byte of a multi-byte character, a tokenizer whose encoding does not
        round-trip)."""
        forced = constraint.jump_forward_text()
        if len(forced) < MIN_JUMP_CHARS:
            return None
        if not output_ids:
            return ForcedTail(self._continuation_ids(forced), 0, forced)
        last = output_ids[-1]

        def kept_apart() -> ForcedTail:  # the sampled token as it is, the forced text after it
            return ForcedTail([last] + self._continuation_ids(forced), 1, forced)

        # The last token's text where it stands (decoded alone, a SentencePiece token loses its leading space).
        context = output_ids[-1 - RETOKENIZE_CONTEXT_TOKENS:-1] or ([self._anchor[1]] if self._anchor else [])
        before, through_last = self._decode(context), self._decode(context + [last])
        if not through_last.startswith(before) or through_last.endswith("\ufffd"):
            return kept_apart()  # the last token completes or starts a multi-byte character
        tail = self._continuation_ids(through_last[len(before):] + forced)
        if self._decode(context + tail) != through_last + forced:
            return kept_apart()
        return ForcedTail(tail, 1, forced)

    def commit_tail(self, constraint: RegexConstraint, tail: ForcedTail) -> None:
        constraint.advance_text(tail.text or "")


def make_grammar_backend(name: str, tokenizer: Any, vocab_size: int) -> GrammarBackend:
    """The backend `EngineConfig.grammar_backend` names. llguidance is imported only when chosen."""
    if name == "jsgl":
        return JsglGrammarBackend(tokenizer, vocab_size)
    if name == "llguidance":
        from jsgl.fsm.llguidance_backend import LlguidanceBackend

        return LlguidanceBackend(tokenizer, vocab_size)
    raise ValueError(f"unknown grammar backend {name!r}; known: {BACKENDS}")
