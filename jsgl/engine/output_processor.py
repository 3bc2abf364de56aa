"""Between the scheduler's batch and the model runner: build each request's share of a step, and fold
the step's sampled tokens back into request state (logprobs, FSM, stop checks, jump-forward).

Runs on the engine thread only. It finishes requests by setting ``finish_reason``; releasing their KV
and waking callers stays with the engine.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jsgl.engine.constrained import ConstraintManager
from jsgl.engine.model_runner import StepOutput
from jsgl.engine.request import AbortReason, FinishReason, InvalidRequestError
from jsgl.engine.sequence import Sequence
from jsgl.engine.speculative import Draft
from jsgl.engine.step_inputs import ForwardItem


class OutputProcessor:
    def __init__(self, constraints: ConstraintManager, vocab_size: int, max_context: int):
        self.constraints = constraints
        self.vocab_size = vocab_size
        self.max_context = max_context

    # ------------------------------------------------------------------------------- step inputs
    def forward_item(self, seq: Sequence, chunk: int, samples: bool) -> ForwardItem:
        """The next ``chunk`` uncomputed tokens of ``seq``; with ``samples``, how to sample after them."""
        tokens = seq.token_ids
        start = seq.num_computed
        item = self._item(seq, tokens[start: start + chunk], start)
        if seq.wants_prompt_logprobs:
            nxt = tokens[start + 1: start + chunk + 1]
            item.target_ids = np.asarray(nxt + [0] * (chunk - len(nxt)), np.int32)
        if samples:
            self._sample_as(item, seq, seq.output_ids,
                            seq.constraint.allowed_token_bitmask() if seq.constraint is not None else None)
        return item

    def verify_items(self, seq: Sequence, draft: Draft | None) -> list[ForwardItem]:
        """One-token rows of a verify step: ``seq``'s uncomputed tokens (one, or a jump-forward's run; the last
        samples), then each draft token, sampled as ``seq`` would be with the draft before it in its output."""
        tokens = seq.token_ids
        rows = [self._item(seq, [t], p) for p, t in enumerate(tokens[seq.num_computed:], seq.num_computed)]
        drafted = draft.tokens if draft is not None else []
        rows += [self._item(seq, [t], p) for p, t in enumerate(drafted, seq.num_tokens)]
        # Under a grammar a draft carries the mask before each of its tokens (grammar_cut); without one, no masks.
        masks = draft.masks if draft is not None and draft.masks is not None else \
            [seq.constraint.allowed_token_bitmask() if seq.constraint is not None else None] * (len(drafted) + 1)
        for i, row in enumerate(rows[len(rows) - len(drafted) - 1:]):
            self._sample_as(row, seq, seq.output_ids + drafted[:i], masks[i])
        return rows

    def _item(self, seq: Sequence, tokens: list[int], start: int) -> ForwardItem:
        p = seq.params
        return ForwardItem(token_ids=np.asarray(tokens, np.int32), start_pos=start, slots=seq.slots,
                           temperature=0.0 if p.greedy else p.temperature, top_p=p.top_p, top_k=p.top_k,
                           min_p=p.min_p, seed=seq.seed, step=len(seq.output_ids))

    def _sample_as(self, item: ForwardItem, seq: Sequence, output_ids: list[int], mask: np.ndarray | None) -> None:
        """Sample ``item``'s next token as ``seq`` would after ``output_ids``: its noise step, penalties, mask."""
        item.step = len(output_ids)
        item.logit_bias = self._logit_bias(seq, output_ids)
        item.repetition_scale = self._repetition_scale(seq, output_ids)
        item.bitmask = mask

    def _logit_bias(self, seq: Sequence, output_ids: list[int]) -> np.ndarray | None:
        """Additive: frequency/presence penalties over the output so far, the request's logit_bias, and
        -inf on EOS and stop tokens until min_new_tokens (as SGLang's penalizers)."""
        p = seq.params
        penalize = bool(p.frequency_penalty or p.presence_penalty) and bool(output_ids)
        too_short = len(output_ids) < p.min_new_tokens and bool(seq.stop_ids)
        if not (penalize or too_short or p.logit_bias):
            return None
        bias = self._request_bias(seq).copy()
        if penalize:
            counts = np.bincount(np.asarray(output_ids), minlength=self.vocab_size)[: self.vocab_size]
            bias -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if too_short:
            bias[[t for t in seq.stop_ids if t < self.vocab_size]] = -np.inf
        return bias

    def _request_bias(self, seq: Sequence) -> np.ndarray:
        """The request's own logit_bias as a row, built once (a whole vocabulary's dict cost ~20 ms a step)."""
        if seq.bias_row is None:
            bias = seq.params.token_bias()
            row = np.zeros(self.vocab_size, np.float32)
            if bias:
                tokens = np.fromiter(bias.keys(), np.int64, len(bias))
                np.add.at(row, tokens, np.fromiter(bias.values(), np.float32, len(bias)))
            seq.bias_row = row
        return seq.bias_row

    def _repetition_scale(self, seq: Sequence, output_ids: list[int]) -> np.ndarray | None:
        """Multiplicative repetition penalty on tokens already generated (SGLang's: the output only;
        transformers' processor also counts the prompt)."""
        penalty = seq.params.repetition_penalty
        if penalty == 1.0 or not output_ids:
            return None
        scale = np.ones(self.vocab_size, np.float32)
        scale[np.asarray(output_ids)] = penalty
        return scale

    # ------------------------------------------------------------------------------ step outputs
    def absorb(self, seq: Sequence, chunk: int, samples: bool, out: StepOutput, i: int) -> bool:
        """Fold row ``i`` of a step into ``seq``; True when the caller should publish (a token or a finish)."""
        start = seq.num_computed
        if out.prompt_logprobs is not None and seq.wants_prompt_logprobs:
            self._collect_prompt_logprobs(seq, start, chunk, out, i)
        seq.num_computed += chunk
        if seq.finished or not samples:
            return False
        if len(seq.output_ids) >= seq.max_new_tokens:  # prefill-only request (max_new_tokens == 0)
            seq.finish_reason = FinishReason.LENGTH
            return True
        self._emit(seq, int(out.tokens[i]), out, i)
        return True

    def absorb_verified(self, seq: Sequence, draft: list[int], out: StepOutput, first_row: int) -> int:
        """Fold a verify step's rows (from ``first_row``: ``seq``'s uncomputed tokens, then ``draft``'s) into ``seq``:
        the first sampled token, and after it each sampled token while the draft token before it was accepted.
        Stops at a finish or a jump-forward (its forced tokens were not what the later rows saw). Returns how many draft
        tokens the model agreed with (the last one may end the request or start a jump: the rows after it are not
        used); the caller frees the slots past the tokens kept."""
        uncomputed = seq.num_tokens - seq.num_computed
        seq.num_computed += uncomputed
        row = first_row + uncomputed - 1
        accepted = 0
        while not seq.finished:
            token = int(out.tokens[row])
            output_len = len(seq.output_ids)
            self._emit(seq, token, out, row)
            jumped = len(seq.output_ids) != output_len + 1 or seq.output_ids[-1] != token
            if accepted == len(draft) or token != draft[accepted]:
                break
            accepted += 1
            if seq.finished or jumped:
                break
            seq.num_computed += 1  # the next row computed this very token at this position
            row += 1
        return accepted

    def _emit(self, seq: Sequence, token: int, out: StepOutput, i: int) -> None:
        """Append a sampled token: its logprobs, the grammar's advance, stops and limits, then jump-forward."""
        seq.output_ids.append(token)
        if seq.params.return_logprob:
            seq.output_logprobs.append(float(out.logprobs[i]))
            if out.top_logprobs is not None and seq.params.top_logprobs_num:
                k = seq.params.top_logprobs_num
                vals, ids = out.top_logprobs
                seq.output_top_logprobs.append([(float(v), int(t)) for v, t in zip(vals[i][:k], ids[i][:k])])
        if seq.constraint is not None and token not in seq.stop_ids:
            seq.constraint.advance(token)
        # Both detokenize (the jump's forced tokens too), so a stop_regex too slow to search can surface in
        # either: it is this request's fault, never the step's.
        try:
            self._check_finish(seq, token)
            if not seq.finished and seq.constraint is not None:
                self.constraints.maybe_jump(seq, self.max_context)
                if seq.detok.matched_stop is not None:
                    seq.finish_reason, seq.matched_stop = FinishReason.STOP, seq.detok.matched_stop
        except InvalidRequestError as exc:
            seq.finish_reason, seq.abort_reason, seq.error = FinishReason.ABORT, AbortReason.INVALID_REQUEST, str(exc)

    def _collect_prompt_logprobs(self, seq: Sequence, start: int, chunk: int, out: Any, i: int) -> None:
        """Logprob of prompt token j comes from position j-1; keep those with j >= logprob_start_len."""
        p = seq.params
        if not seq.input_logprobs and p.logprob_start_len == 0:
            seq.input_logprobs.append(None)
            seq.input_top_logprobs.append(None)
        first = max(p.logprob_start_len, 1)
        values = out.prompt_logprobs[i]
        for off in range(chunk):
            j = start + off + 1  # the prompt token this position predicts
            if j < first or j >= len(seq.prompt_ids) or j - p.logprob_start_len < len(seq.input_logprobs):
                continue
            seq.input_logprobs.append(float(values[off]))
            if out.prompt_top_logprobs is not None and p.top_logprobs_num:
                vals, ids = out.prompt_top_logprobs[i]
                k = p.top_logprobs_num
                seq.input_top_logprobs.append([(float(v), int(t)) for v, t in zip(vals[off][:k], ids[off][:k])])
            else:
                seq.input_top_logprobs.append(None)

    def _check_finish(self, seq: Sequence, token: int) -> None:
        p = seq.params
        reached_min = len(seq.output_ids) >= p.min_new_tokens
        seq.detok.check_stops = reached_min
        if token in seq.stop_ids and reached_min:
            seq.finish_reason, seq.matched_stop = FinishReason.STOP, token
            seq.detok.add(seq.output_ids if p.no_stop_trim else seq.output_ids[:-1])
            return
        if seq.detok.add(seq.output_ids):
            seq.finish_reason, seq.matched_stop = FinishReason.STOP, seq.detok.matched_stop
        elif seq.constraint is not None and seq.constraint.is_terminated():
            seq.finish_reason = FinishReason.STOP
        elif len(seq.output_ids) >= seq.max_new_tokens or seq.num_tokens >= self.max_context:
            seq.finish_reason = FinishReason.LENGTH
