"""The engine loop without a model: ``HostRunner`` stands in for ``ModelRunner`` (the interface ``EngineLoop`` and
``OverlapScheduler`` use: ``dispatch``, ``step_shape``, ``kv_intact``), everything else is the engine's own
(Scheduler, SlotAllocator, prefix cache, OutputProcessor, Speculator, OverlapScheduler, EngineLoop).

Its "KV pool" holds the token written at each slot, and a row's logits are a hash of the tokens in its slots up to
its position: a row that attends to slots holding other tokens (freed, reused, or never written) gets other logits.
It samples as jsgl's sampler does: repetition scale, logit bias and the grammar's mask, then the argmax (greedy) or
Gumbel-max with noise keyed by the row's seed and step (no top-k/top-p/min-p filtering: the tests here use none).
Every row's K/V is written before any row attends, as every backend does (speculative rows see their drafts), and
an overlapped step (``after``) takes each row's token from the step it follows, as ``previous_row`` does on device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from jsgl.engine.config import EngineConfig
from jsgl.engine.constrained import ConstraintManager
from jsgl.engine.engine_loop import EngineLoop
from jsgl.engine.kv_pool import SlotAllocator
from jsgl.engine.mailbox import Mailbox
from jsgl.engine.model_runner import ModelRunner, StepOutput
from jsgl.engine.output_processor import OutputProcessor
from jsgl.engine.overlap import OverlapScheduler
from jsgl.engine.sampling_params import GREEDY_TEMPERATURE
from jsgl.engine.scheduler import Scheduler
from jsgl.engine.sequence import Sequence
from jsgl.engine.speculative import DraftProposer, Speculator
from jsgl.engine.step_inputs import ForwardItem, StepLayout
from jsgl.radix.no_cache import NoPrefixCache
from jsgl.radix.radix_cache import RadixCache


class HostPending:
    """A dispatched step (computed at once on the host): ``PendingStep``'s ``layout`` and ``result``."""

    def __init__(self, out: StepOutput, layout: StepLayout):
        self.out, self.layout = out, layout

    def result(self) -> StepOutput:
        return self.out


class HostRunner:
    length_free = False  # attention padded to buckets of 64 keys: the step shapes overlap compares
    table_width = 0
    channel = None  # one process
    step_shape = ModelRunner.step_shape  # the real one: it reads length_free and table_width only

    def __init__(self, num_slots: int, vocab_size: int, page_size: int = 1):
        self.kv = np.full(num_slots, -1, np.int64)  # the token whose K/V each slot holds (-1: never written)
        self.vocab_size, self.page_size = vocab_size, page_size
        self.steps: list[list[ForwardItem]] = []  # every dispatched step's rows, as run (overlapped: tokens filled)
        self.fail: Callable[[list[ForwardItem]], bool] | None = None  # a dispatch it says True to raises

    def kv_intact(self) -> bool:
        return True  # a failed dispatch here raises before anything runs, as a step that does not trace

    def dispatch(self, items: list[ForwardItem], *, logprobs: bool = True, top_logprobs: int = 0,
                 prompt_top_k: int = -1, after: HostPending | None = None) -> HostPending:
        assert prompt_top_k < 0, "the host model has no prompt logprobs"
        if self.fail is not None and self.fail(items):
            raise RuntimeError("injected step failure")
        if after is not None:  # each row's token is the one the step before sampled in the same row
            items = [dataclasses.replace(it, token_ids=np.asarray([token], np.int32))
                     for it, token in zip(items, after.out.tokens)]
        self.steps.append(items)
        for it in items:
            self.kv[it.slots[it.start_pos: it.start_pos + len(it.token_ids)]] = it.token_ids
        rows = [self._logits(it) for it in items]
        tokens = np.asarray([self._sample(it, logits) for it, logits in zip(items, rows)], np.int32)
        logprob_rows = np.stack([logits - np.logaddexp.reduce(logits) for logits in rows])  # the raw distribution
        top = None
        if top_logprobs:
            ids = np.argsort(-logprob_rows, axis=1, kind="stable")[:, :top_logprobs]
            top = (np.take_along_axis(logprob_rows, ids, axis=1), ids.astype(np.int32))
        q_lens = [len(it.token_ids) for it in items]
        is_decode = all(q == 1 for q in q_lens)
        layout = StepLayout(*self.step_shape(len(items), sum(q_lens), max(q_lens),
                                             max(it.start_pos + q for it, q in zip(items, q_lens)), is_decode),
                            self.page_size)
        chosen = logprob_rows[np.arange(len(items)), tokens] if logprobs else None
        return HostPending(StepOutput(tokens, chosen, top), layout)

    def _logits(self, item: ForwardItem) -> np.ndarray:
        context = self.kv[item.slots[: item.start_pos + len(item.token_ids)]]
        assert (context >= 0).all(), "a row attends to a slot no step wrote"
        return self.logits_after(context.tolist())

    def logits_after(self, context: list[int]) -> np.ndarray:
        """The model: the logits after these tokens."""
        return np.random.default_rng(context).standard_normal(self.vocab_size).astype(np.float32)

    def _sample(self, item: ForwardItem, logits: np.ndarray) -> int:
        x = logits.copy()
        if item.repetition_scale is not None:
            x = np.where(x < 0, x * item.repetition_scale, x / item.repetition_scale)
        if item.logit_bias is not None:
            x = x + item.logit_bias
        if item.bitmask is not None:
            bits = (np.asarray(item.bitmask, np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
            x = np.where(bits.reshape(-1)[: self.vocab_size].astype(bool), x, -np.inf)
        if item.temperature <= GREEDY_TEMPERATURE:
            return int(np.argmax(x))
        noise = np.random.default_rng([item.seed, item.step]).gumbel(size=self.vocab_size)
        return int(np.argmax(x / item.temperature + noise))


class OracleProposer(DraftProposer):
    """Drafts what the host model will sample after a request's tokens (as a perfect draft model would: greedy or
    seeded, under its grammar, no penalties) up to index ``wrong_from``, where it drafts another token and stops."""

    def __init__(self, runner: HostRunner, wrong_from: int):
        self.runner, self.wrong_from = runner, wrong_from

    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        tokens, draft = list(seq.token_ids), []
        temperature = 0.0 if seq.params.greedy else seq.params.temperature
        state = seq.constraint.copy() if seq.constraint is not None else None
        for i in range(num_tokens):
            # The verify row that samples draft token i: the draft before it in the output (its noise step).
            row = ForwardItem(np.asarray(tokens[-1:], np.int32), len(tokens) - 1, np.zeros(1, np.int32),
                              temperature=temperature, seed=seq.seed, step=len(seq.output_ids) + i,
                              bitmask=state.allowed_token_bitmask() if state is not None else None)
            token = self.runner._sample(row, self.runner.logits_after(tokens))
            if i == self.wrong_from:  # rejected: the rows after it are never used
                return [*draft, (token + 1) % self.runner.vocab_size]
            draft.append(token)
            tokens.append(token)
            if state is not None:
                if token in seq.stop_ids:
                    break
                state.advance(token)
                if state.is_terminated():
                    break
        return draft


@dataclasses.dataclass
class HostEngine:
    loop: EngineLoop
    runner: HostRunner
    scheduler: Scheduler
    allocator: SlotAllocator

    def run(self, seqs: list[Sequence], max_steps: int = 2000, between: Callable[[int], None] | None = None) -> None:
        """Add ``seqs`` (their constraints compiled and attached first, as ``EngineLoop.run`` does) and step the
        loop until it is idle; ``between(i)`` runs before step i (where ``run`` would take aborts)."""
        for seq in seqs:
            if self.loop.constraints.prepare(seq) is not None:
                self.loop.constraints.activate(seq, self.scheduler.token_limit)
            self.scheduler.add(seq)
        for i in range(max_steps):
            if between is not None:
                between(i)
            if self.loop.idle():
                return
            self.loop.step()
        raise AssertionError(f"still working after {max_steps} steps")

    def pool_is_whole(self) -> bool:
        """Every slot free or the prefix cache's (nothing running)."""
        return self.allocator.num_free() + self.loop.prefix_cache.total_size() == self.allocator.capacity


def host_engine(tokenizer: Any, *, num_slots: int = 512, page_size: int = 1, speculator: Speculator | None = None,
                prefix_cache: str = "none", **options: Any) -> HostEngine:
    """An EngineLoop over the host model, wired as ``Engine`` wires its own (``options``: EngineConfig's)."""
    config = EngineConfig(page_size=page_size, **options)
    allocator = SlotAllocator(num_slots, page_size)
    cache = RadixCache(page_size, free_slots=allocator.free) if prefix_cache == "radix" else NoPrefixCache(page_size)
    runner = HostRunner(num_slots, tokenizer.vocab_size, page_size)
    scheduler = Scheduler(allocator, cache, max_running=config.max_running_requests,
                          chunk_size=config.chunked_prefill_size, max_context=4096,
                          attention_budget_bytes=1 << 40, attention_bytes=lambda *shape: 0)
    constraints = ConstraintManager(tokenizer, tokenizer.vocab_size, set(), config.jump_forward)
    outputs = OutputProcessor(constraints, tokenizer.vocab_size, scheduler.token_limit)
    overlap = OverlapScheduler(scheduler, runner, config, max_batch=8)
    loop = EngineLoop(config, Mailbox(), scheduler, runner, cache, constraints, outputs, overlap, speculator)
    return HostEngine(loop, runner, scheduler, allocator)
