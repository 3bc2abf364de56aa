"""Overlap scheduling: a decode step's successor over the same requests, planned before the step is read back.

The scheduler plans a step from what the host knows; this plans the one after a decode step while that step still
runs: its input tokens are the running step's outputs, taken on device (``previous_row``, step_inputs.py), so the
host folds one step in while the device computes the next. It extends the ``Scheduler`` (grows each request's
slots, counts the step) and is asked only when nothing the host would learn could change the step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np

from jsgl.engine.config import EngineConfig
from jsgl.engine.model_runner import ModelRunner, PendingStep, bucket
from jsgl.engine.scheduler import Batch, Scheduler
from jsgl.engine.sequence import Sequence
from jsgl.engine.step_inputs import ForwardItem

log = logging.getLogger("jsgl.engine")

# On CPU the device's work runs on the host's own cores, so overlapping pays only while a step leaves them idle
# part of the time (docs/performance.md: a 16-row step keeps both cores busy).
CPU_OVERLAP_MAX_BATCH = 8


@dataclasses.dataclass
class Overlapped:
    """A decode step dispatched behind the one before it, not yet read back."""

    batch: Batch  # every request of the step before, in the same rows
    items: list[ForwardItem]
    rows: list[int]  # the rows that compute a request's next token (the others are padding)
    pending: PendingStep


class OverlapScheduler:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, config: EngineConfig, max_batch: int):
        self.scheduler = scheduler
        self.runner = runner
        self.config = config  # overlap_schedule is read at each step: it may be switched while running
        self.max_batch = max_batch
        self.steps = 0  # decode steps dispatched before the step they follow was read back

    def follow(self, batch: Batch, items: list[ForwardItem], pending: PendingStep,
               dispatch: Callable[..., PendingStep]) -> Overlapped | None:
        """Dispatch the next decode step of ``batch``'s requests behind ``pending`` (the caller has checked that
        no request waits to be admitted), unless a request's next sampling depends on this token (FSM masks,
        penalties, logit bias) or the step would change shape. A request that finishes on ``pending``'s token
        wastes its row (its KV write lands in a slot it has freed, before anyone can reuse it: steps run in
        order); one known to finish on it (length) gets a padding row, and too many of those end the overlap."""
        sched = self.scheduler
        if not (self.config.overlap_schedule and batch.is_decode) or sched.waiting or sched.prefilling \
                or len(batch.seqs) > self.max_batch:
            return None
        if any(it.bitmask is not None or it.logit_bias is not None or it.repetition_scale is not None
               for it in items):
            return None
        going = [self._goes_on(s) for s in batch.seqs]
        if not any(going) or bucket(sum(going)) < pending.layout.num_b:  # a smaller batch would do: schedule afresh
            return None
        # Where attention is padded, the attended length is a bucket: crossing one (64 -> 65 keys) changes the
        # step's shape, and the next step is scheduled afresh.
        longest = max(s.num_tokens + 1 if go else 1 for s, go in zip(batch.seqs, going))
        if self.runner.step_shape(len(items), len(items), 1, longest, True) != tuple(pending.layout[:4]):
            return None
        next_items = []
        for seq, item, go in zip(batch.seqs, items, going):
            if not go:
                next_items.append(ForwardItem(np.zeros(1, np.int32), 0, np.zeros(1, np.int32)))  # writes slot 0
                continue
            position = seq.num_tokens  # of the token `pending` samples
            if not sched.kv.grow(seq, position + 1):  # may evict from the cache
                return None
            next_items.append(dataclasses.replace(item, token_ids=np.zeros(1, np.int32), start_pos=position,
                                                  slots=seq.slots, step=len(seq.output_ids) + 1))
        try:
            following = dispatch(batch.seqs, next_items, True, after=pending)
        except Exception:  # not run: the requests go on through the scheduler
            if not self.runner.kv_intact():
                raise
            log.warning("an overlapped decode step could not be dispatched; continuing without", exc_info=True)
            return None
        sched.count_step(True, sum(going))
        self.steps += 1
        return Overlapped(Batch(True, list(batch.seqs), [1] * len(batch.seqs)), next_items,
                          [i for i, go in enumerate(going) if go], following)

    def _goes_on(self, seq: Sequence) -> bool:
        """Whether the request still runs after the token being sampled (else its row is padding)."""
        return not seq.finished and len(seq.output_ids) + 1 < seq.max_new_tokens \
            and seq.num_tokens + 1 < self.scheduler.token_limit
