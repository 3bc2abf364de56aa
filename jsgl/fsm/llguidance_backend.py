"""llguidance as a grammar backend: regex, JSON schema, SGLang's `ebnf` (GBNF) and legacy `structural_tag`.

llguidance (pip install llguidance; no dependencies) computes each mask lazily from an Earley parser over
a lexer, so there is no per-grammar token index to build: compiling a grammar takes milliseconds, a mask
tens of microseconds. Compiled grammars are kept as pristine template matchers (LRU) and each request
deep-copies one. The llguidance tokenizer is built once per HF tokenizer (~0.5 s) and cached.

EOS is the engine's business, as on the jsgl path: llguidance's own EOS bits are cleared from its masks
and the request's stop tokens are allowed exactly where the grammar accepts.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from jsgl.errors import InvalidRequestError, MissingExtraError
from jsgl.fsm.grammar_backend import GRAMMAR_FIELDS, ForcedTail, GrammarBackend, GrammarSpec, eos_bitmask

INSTALL_HINT = "the llguidance grammar backend needs the llguidance package: pip install llguidance"
TEMPLATES = 128  # compiled grammars kept (a template is the grammar plus lexer state: ~100 KB-1 MB)
SYNC_WAIT_S = 0.05  # most grammars compile within this: their errors are the submit's own 400
MAX_ERROR_CHARS = 600
# jsgl's JSON layout (", " and ": ", no other whitespace): the layout small models follow best, and the
# same output as the jsgl backend for the same schema.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Keywords whose values are subschemas (maps of them, lists of them): where closed_objects looks.
_SCHEMA_KEYS = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
                "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")

_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def llguidance_module() -> Any:
    """The llguidance package, imported on first use (it is an optional dependency)."""
    try:
        import llguidance
        import llguidance.hf  # noqa: F401  (from_tokenizer lives there)
    except ImportError as exc:
        raise MissingExtraError(INSTALL_HINT) from exc
    return llguidance


def ll_tokenizer(tokenizer: Any) -> Any:
    """llguidance's tokenizer for an HF fast tokenizer, built once per tokenizer object."""
    llg = llguidance_module()
    with _tokenizers_lock:
        cached = _tokenizers.get(tokenizer)
        if cached is None:
            cached = llg.hf.from_tokenizer(tokenizer)
            _tokenizers[tokenizer] = cached
    return cached


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` where objects with declared properties take no others unless additionalProperties
    says so: what jsgl's regex conversion (and xgrammar, SGLang's default) do. JSON Schema's own default is
    open, and a small model then rambles on in made-up keys until max_new_tokens."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_KEYS:
        if isinstance(out.get(key), dict | list):
            out[key] = closed_objects(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def structural_tag_grammar(text: str, special_tokens: set[str]) -> str:
    """SGLang's structural_tag `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}` as an
    llguidance grammar: free text, where each trigger starts its structure's JSON. xgrammar's newer
    `{"format": ...}` tags have no llguidance equivalent and are refused."""
    from llguidance import StructTag

    try:
        tag = json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(f"structural_tag is not valid JSON: {exc}") from None
    if not isinstance(tag, dict) or "structures" not in tag or "triggers" not in tag:
        raise InvalidRequestError('structural_tag: only SGLang\'s {"structures": [...], "triggers": [...]} form is '
                                  'supported by the llguidance backend (not xgrammar\'s {"format": ...})')
    triggers, structures = tag["triggers"], tag["structures"]
    if not (isinstance(triggers, list) and triggers and all(isinstance(t, str) and t for t in triggers)):
        raise InvalidRequestError("structural_tag: triggers must be a non-empty list of non-empty strings")
    if not (isinstance(structures, list) and structures):
        raise InvalidRequestError("structural_tag: structures must be a non-empty list")
    tags = []
    for s in structures:
        if not isinstance(s, dict) or not {"begin", "schema", "end"} <= set(s):
            raise InvalidRequestError("structural_tag: each structure needs begin, schema and end")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise InvalidRequestError(f"structural_tag: no trigger starts the begin {s['begin']!r}")
        tags.append(StructTag(trigger=trigger, begin=s["begin"], grammar=s["schema"], end=s["end"]))
    # A trigger written <...> is matched as one special token only when the tokenizer really has it as one.
    angle = [t for t in triggers if t.startswith("<") and t.endswith(">")]
    return StructTag.to_grammar(tags, assume_special=bool(angle) and all(t in special_tokens for t in angle))


class LlguidanceConstraint:
    """Per-request state over one llguidance matcher (the engine's TokenConstraint protocol)."""

    def __init__(self, matcher: Any, backend: LlguidanceBackend, eos_ids: Iterable[int]) -> None:
        self.matcher = matcher
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self._valid = backend.valid_mask
        self._eos_mask = eos_bitmask(self.eos_ids, backend.vocab_size)
        self._mask: np.ndarray | None = None  # of the current state (the engine may ask twice)
        self._eos_taken = False

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ValueError(f"llguidance: {self.matcher.get_error()[:MAX_ERROR_CHARS]}")

    def allowed_token_bitmask(self) -> np.ndarray:
        """Packed uint32 [ceil(V/32)]: llguidance's mask on the model's vocabulary, EOS where it accepts."""
        if self._eos_taken:
            return self._eos_mask
        if self._mask is None:
            raw = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32)
            self._check()
            mask = np.zeros_like(self._valid)
            n = min(len(raw), len(mask))
            np.bitwise_and(raw[:n], self._valid[:n], out=mask[:n])
            if self.matcher.is_accepting():
                mask |= self._eos_mask
            mask.setflags(write=False)
            self._mask = mask
        return self._mask

    def advance(self, token_id: int) -> None:
        token_id = int(token_id)
        if self._eos_taken:
            raise ValueError("constraint already terminated by EOS")
        if token_id in self.eos_ids:
            if not self.matcher.is_accepting():
                raise ValueError(f"EOS token {token_id} sampled where the grammar does not accept")
            self._eos_taken = True
            return
        if not self.matcher.consume_token(token_id):
            raise ValueError(f"token {token_id} is not allowed: {self.matcher.get_error()[:MAX_ERROR_CHARS]}")
        self._mask = None

    def is_terminated(self) -> bool:
        """EOS taken, or the grammar admits no further token."""
        return self._eos_taken or self.matcher.is_stopped()

    def is_accepting(self) -> bool:
        return self._eos_taken or self.matcher.is_accepting()

    def copy(self) -> LlguidanceConstraint:
        """An independent state at the same point (its own matcher)."""
        other = object.__new__(LlguidanceConstraint)
        other.__dict__.update(self.__dict__)
        other.matcher = self.matcher.deep_copy()
        return other

    def forced_tokens(self) -> list[int]:
        """Tokens every continuation starts with (llguidance leaves out a last token a longer one could
        replace, so the result keeps the tokenizer's own splits)."""
        if self._eos_taken or self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens())

    def consume_forced(self, tokens: list[int]) -> None:
        if not self.matcher.consume_tokens(tokens):
            raise ValueError(f"forced tokens rejected: {self.matcher.get_error()[:MAX_ERROR_CHARS]}")
        self._mask = None


class LlguidanceBackend(GrammarBackend):
    name = "llguidance"
    kinds = frozenset(GRAMMAR_FIELDS)
    jump_forward = True

    def __init__(self, tokenizer: Any, vocab_size: int, *, compile_threads: int = 2) -> None:
        super().__init__(tokenizer, vocab_size)
        self.llg = llguidance_module()
        self.ll_tokenizer = ll_tokenizer(tokenizer)
        # Tokens the model may emit through llguidance: ids both vocabularies have (a model vocabulary padded
        # past the tokenizer's gets 0 bits there), minus llguidance's EOS (the request's own stop ids go back
        # in where the grammar accepts).
        usable = min(self.ll_tokenizer.vocab_size, vocab_size)
        valid = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)
        valid[: usable >> 5] = np.uint32(0xFFFFFFFF)
        if usable & 31:
            valid[usable >> 5] = np.uint32((1 << (usable & 31)) - 1)
        valid &= ~eos_bitmask(self.ll_tokenizer.eos_tokens, vocab_size)
        valid.setflags(write=False)
        self.valid_mask = valid
        self._special = set(getattr(tokenizer, "all_special_tokens", ()))
        self._special |= set(getattr(tokenizer, "get_added_vocab", dict)())
        # LLMatcher construction releases the GIL: compiles run beside the engine thread.
        self._pool = ThreadPoolExecutor(compile_threads, thread_name_prefix="jsgl-llguidance")
        self._templates: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------ compiling
    def grammar(self, spec: GrammarSpec) -> str:
        """llguidance's grammar text for `spec` (caller thread; conversion errors are InvalidRequestError)."""
        self.check(spec)
        try:
            if spec.kind == "regex":  # \d, \w, \s as ASCII classes, as jsgl's FSM (and Rust's default is Unicode)
                return self.llg.LLMatcher.grammar_from_lark(f"start: /{self.llg.regex_to_lark(spec.value, 'dws')}/")
            if spec.kind == "json_schema":
                schema = json.loads(spec.value) if isinstance(spec.value, str) else spec.value
                return self.llg.LLMatcher.grammar_from_json_schema(closed_objects(schema), defaults=JSON_OPTIONS)
            if spec.kind == "ebnf":
                return self.llg.grammar_from("ebnf", spec.value)
            return structural_tag_grammar(spec.value, self._special)
        except InvalidRequestError:
            raise
        except (ValueError, TypeError, AssertionError) as exc:
            raise InvalidRequestError(f"invalid {spec.kind}: {str(exc)[:MAX_ERROR_CHARS]}") from None

    def compile(self, spec: GrammarSpec) -> Future:
        grammar = self.grammar(spec)
        with self._lock:
            future = self._templates.get(grammar)
            if future is not None:
                self._templates.move_to_end(grammar)
            else:
                future = self._pool.submit(self._build, spec.kind, grammar)
                self._templates[grammar] = future
                future.add_done_callback(lambda f, g=grammar: self._forget_failed(g, f))
                while len(self._templates) > TEMPLATES:
                    self._templates.popitem(last=False)
        try:
            future.result(timeout=SYNC_WAIT_S)  # a bad grammar is usually known by now: fail the submit
        except FutureTimeout:
            pass  # a large one: the engine waits for it (bounded by constraint_timeout_s)
        return future

    def _build(self, kind: str, grammar: str) -> Any:
        matcher = self.llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {kind}: {matcher.get_error()[:MAX_ERROR_CHARS]}")
        return matcher

    def _forget_failed(self, grammar: str, future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                if self._templates.get(grammar) is future:
                    del self._templates[grammar]

    def clear_cache(self) -> None:
        with self._lock:
            self._templates.clear()

    # --------------------------------------------------------------------------- per request
    def new_constraint(self, compiled: Any, eos_ids: Iterable[int]) -> LlguidanceConstraint:
        return LlguidanceConstraint(compiled.deep_copy(), self, eos_ids)

    def forced_tail(self, constraint: LlguidanceConstraint, output_ids: list[int]) -> ForcedTail | None:
        tokens = constraint.forced_tokens()
        return ForcedTail(tokens, 0) if tokens else None

    def commit_tail(self, constraint: LlguidanceConstraint, tail: ForcedTail) -> None:
        constraint.consume_forced(tail.tokens)
