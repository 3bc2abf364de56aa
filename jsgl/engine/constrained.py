"""Constrained decoding in the engine: FSM index builds, masks, and jump-forward with retokenization.

A regex/json_schema request is validated on the caller's thread (an invalid pattern is that request's
InvalidRequestError), its token index builds on a background pool, and the request waits outside the
scheduler until its own index is ready — the engine keeps stepping everything else meanwhile.

Jump-forward (paper §4): when the FSM reaches a state whose continuation is forced (``{"name": "``),
the forced string is appended at once. The last sampled token has no KV yet, so we retokenize
``its text + forced string`` and replace that token with the result: the model then sees the
tokenization it was trained on, and the new tokens are computed as an extend step of this request
inside the running batch (no request leaves the batch; nothing already cached is invalidated).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from jsgl.engine.request import InvalidRequestError, SamplingParams
from jsgl.engine.sequence import Sequence
from jsgl.fsm import RegexConstraint, get_index_async, json_schema_to_regex, start_build_workers, validate_regex

MIN_JUMP_CHARS = 2  # a one-character jump saves nothing over a masked decode step


def request_regex(params: SamplingParams) -> str | None:
    """The regex a request is constrained by (json_schema converted), or None."""
    if params.regex is not None:
        return params.regex
    if params.json_schema is not None:
        return json_schema_to_regex(params.json_schema)
    return None


class ConstraintManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: set[int], jump_forward: bool):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self.jump_forward = jump_forward
        self.jumped_tokens = 0  # tokens appended by jump-forward, engine-wide
        self.jumps = 0
        start_build_workers()

    def prepare(self, seq: Sequence) -> Future | None:
        """Validate and start building the request's index (caller thread). Raises InvalidRequestError."""
        regex = request_regex(seq.params)
        if regex is None:
            return None
        validate_regex(regex)
        seq.constraint_ready = get_index_async(regex, self.tokenizer, self.vocab_size)
        return seq.constraint_ready

    def activate(self, seq: Sequence, token_limit: int) -> None:
        """Engine thread, once the index is built: attach the constraint, jump over a forced start."""
        future, seq.constraint_ready = seq.constraint_ready, None
        try:
            index = future.result()
        except InvalidRequestError:
            raise
        except Exception as exc:  # a build failure is this request's error, not the engine's
            raise InvalidRequestError(f"could not compile the constraint: {exc}") from exc
        eos = set(self.stop_ids) if not seq.params.ignore_eos else set()
        seq.constraint = RegexConstraint(index, eos | set(seq.params.stop_token_ids or []))
        if self._jump_enabled(seq):
            forced = seq.constraint.jump_forward_text()
            if len(forced) >= MIN_JUMP_CHARS:
                tokens = self.tokenizer(forced, add_special_tokens=False).input_ids
                # Within the request's budget and the scheduler's token limit (past it, the request could
                # never be scheduled: the pool cannot hold it).
                if len(tokens) <= seq.max_new_tokens and len(seq.prompt_ids) + len(tokens) < token_limit:
                    seq.output_ids.extend(tokens)
                    self._account(seq, forced, len(tokens))

    def _jump_enabled(self, seq: Sequence) -> bool:
        p = seq.params
        # Jumped tokens have no sampled logprob; requests asking for logprobs decode token by token.
        enabled = self.jump_forward if p.jump_forward is None else p.jump_forward
        return enabled and not p.return_logprob

    def _account(self, seq: Sequence, forced: str, num_new_tokens: int) -> None:
        seq.constraint.advance_text(forced)
        seq.detok.append_forced(forced, len(seq.output_ids))
        seq.jump_forward_tokens += num_new_tokens
        self.jumped_tokens += num_new_tokens
        self.jumps += 1

    def maybe_jump(self, seq: Sequence, max_context: int) -> None:
        """After a sampled token: append the forced continuation, retokenizing the boundary."""
        if seq.constraint is None or not self._jump_enabled(seq) or not seq.output_ids:
            return
        forced = seq.constraint.jump_forward_text()
        if len(forced) < MIN_JUMP_CHARS:
            return
        last = seq.output_ids[-1]
        last_text = self.tokenizer.decode([last])
        if "\ufffd" in last_text:  # the last token ends a multi-byte character: keep it as is
            tail = [last] + self.tokenizer(forced, add_special_tokens=False).input_ids
        else:
            tail = self.tokenizer(last_text + forced, add_special_tokens=False).input_ids
            if self.tokenizer.decode(tail) != last_text + forced:
                tail = [last] + self.tokenizer(forced, add_special_tokens=False).input_ids
        new_len = len(seq.output_ids) - 1 + len(tail)
        if new_len > seq.max_new_tokens or len(seq.prompt_ids) + new_len >= max_context:
            return  # no room: let masked decoding produce what fits
        seq.output_ids[-1:] = tail
        self._account(seq, forced, len(tail) - 1)
