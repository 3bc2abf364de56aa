"""Constrained decoding in the engine: grammar compiles off-thread, masks, and jump-forward.

The grammar itself belongs to a backend (jsgl.fsm.grammar_backend): jsgl's compressed FSM (regex, JSON
schema) by default, llguidance with `--grammar-backend llguidance` (also SGLang's `ebnf` grammars and
structural tags). A request's grammar is checked on the caller's thread (a bad one is that request's
InvalidRequestError), compiles off the engine thread, and the request waits outside the scheduler until its
own grammar is ready -- the engine keeps stepping everything else meanwhile.

Jump-forward (paper §4): when every continuation starts with the same text (``{"name": "``), the backend
says which tokens are forced and they are appended at once. With jsgl's FSM the last sampled token has no
KV yet, so ``its text + forced string`` is retokenized and replaces it: the model then sees the
tokenization it was trained on. The new tokens are computed as an extend step of this request inside the
running batch (no request leaves the batch; nothing already cached is invalidated).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from jsgl.engine.request import InvalidRequestError, SamplingParams
from jsgl.engine.sequence import Sequence
from jsgl.fsm import json_schema_to_regex
from jsgl.fsm.grammar_backend import MIN_JUMP_CHARS, GrammarBackend, grammar_spec, make_grammar_backend

__all__ = ["MIN_JUMP_CHARS", "ConstraintManager", "request_regex"]


def request_regex(params: SamplingParams) -> str | None:
    """The regex a request is constrained by under the jsgl backend (json_schema converted), or None."""
    if params.regex is not None:
        return params.regex
    if params.json_schema is not None:
        return json_schema_to_regex(params.json_schema)
    return None


class ConstraintManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: set[int], jump_forward: bool,
                 grammar_backend: str | GrammarBackend = "jsgl"):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self.jump_forward = jump_forward
        self.backend = grammar_backend if isinstance(grammar_backend, GrammarBackend) else \
            make_grammar_backend(grammar_backend, tokenizer, vocab_size)
        self.jumped_tokens = 0  # tokens appended by jump-forward, engine-wide
        self.jumps = 0

    def prepare(self, seq: Sequence) -> Future | None:
        """Check the request's grammar and start compiling it (caller thread). Raises InvalidRequestError."""
        spec = grammar_spec(seq.params)
        if spec is None:
            return None
        self.backend.check(spec)
        seq.constraint_ready = self.backend.compile(spec)
        return seq.constraint_ready

    def activate(self, seq: Sequence, token_limit: int) -> None:
        """Engine thread, once the grammar is compiled: attach the constraint, jump over a forced start."""
        future, seq.constraint_ready = seq.constraint_ready, None
        try:
            compiled = future.result()
        except InvalidRequestError:
            raise
        except Exception as exc:  # a compile failure is this request's error, not the engine's
            raise InvalidRequestError(f"could not compile the constraint: {exc}") from exc
        # EOS where the grammar accepts: the same stop tokens that end the request (none under ignore_eos).
        eos = set(self.stop_ids) if not seq.params.ignore_eos else set()
        seq.constraint = self.backend.new_constraint(compiled, eos | set(seq.params.stop_token_ids or []))
        if self._jump_enabled(seq):
            # Within the request's budget and the scheduler's token limit (past it, the request could never
            # be scheduled: the pool cannot hold it).
            self._jump(seq, token_limit)

    def _jump_enabled(self, seq: Sequence) -> bool:
        p = seq.params
        # Jumped tokens have no sampled logprob; requests asking for logprobs decode token by token.
        enabled = self.jump_forward if p.jump_forward is None else p.jump_forward
        return enabled and self.backend.jump_forward and not p.return_logprob

    def maybe_jump(self, seq: Sequence, max_context: int) -> None:
        """After a sampled token: append the forced continuation (jsgl: retokenizing the boundary)."""
        if seq.constraint is None or not self._jump_enabled(seq) or not seq.output_ids:
            return
        self._jump(seq, max_context)

    def _jump(self, seq: Sequence, limit: int) -> None:
        tail = self.backend.forced_tail(seq.constraint, seq.output_ids)
        if tail is None:
            return
        new_len = len(seq.output_ids) - tail.drop + len(tail.tokens)
        if new_len > seq.max_new_tokens or len(seq.prompt_ids) + new_len >= limit:
            return  # no room: let masked decoding produce what fits
        self.backend.commit_tail(seq.constraint, tail)
        seq.output_ids[len(seq.output_ids) - tail.drop:] = tail.tokens
        if tail.text is not None:
            seq.detok.append_forced(tail.text, len(seq.output_ids))
        else:  # forced tokens only: decoded like sampled ones (stop strings included)
            seq.detok.add(seq.output_ids)
        num_new = len(tail.tokens) - tail.drop
        seq.jump_forward_tokens += num_new
        self.jumped_tokens += num_new
        self.jumps += 1
