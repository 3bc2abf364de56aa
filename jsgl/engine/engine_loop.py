"""The engine thread: the loop that takes what callers posted, steps the model, and finishes requests.

Only this thread touches the scheduler, the allocator, the prefix cache and the device buffers. One iteration:
take the mailbox's requests, flushes and aborts; hand requests whose constraint is built to the scheduler; run a
step (scheduled, or the overlapped one dispatched by the step before); fold its tokens back, finishing and
retiring requests. A failed batched step is rerun per request, so only the culprit fails.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

from jsgl.engine.config import EngineConfig
from jsgl.engine.constrained import ConstraintManager
from jsgl.engine.mailbox import Mailbox
from jsgl.engine.metrics import EngineMetrics
from jsgl.engine.model_runner import ModelRunner, PendingStep, bucket
from jsgl.engine.output_processor import OutputProcessor
from jsgl.engine.overlap import Overlapped, OverlapScheduler
from jsgl.engine.request import AbortReason, FinishReason, InvalidRequestError
from jsgl.engine.scheduler import Batch, Scheduler
from jsgl.engine.sequence import Sequence
from jsgl.engine.speculative import Draft, Speculator, choose_rows
from jsgl.engine.step_inputs import ForwardItem
from jsgl.fsm import release_index
from jsgl.radix.cache_base import PrefixCacheBase
from jsgl.radix.metrics import DistinctPrefixCounter

log = logging.getLogger("jsgl.engine")

# Tokens the optimal-hit-rate trie may hold: ~256 B a node, so ~8 MB. Outputs go in too (a next call extends
# them), so a soak of unique sampled outputs needs the bound to keep its memory flat.
HIT_RATE_WINDOW_TOKENS = 1 << 15


class EngineLoop:
    def __init__(self, config: EngineConfig, mailbox: Mailbox, scheduler: Scheduler, runner: ModelRunner,
                 prefix_cache: PrefixCacheBase, constraints: ConstraintManager, outputs: OutputProcessor,
                 overlap: OverlapScheduler, speculator: Speculator | None = None):
        self.config = config
        self.mailbox = mailbox
        self.scheduler = scheduler
        self.runner = runner
        self.prefix_cache = prefix_cache
        self.constraints = constraints
        self.outputs = outputs
        self.overlap = overlap
        self.speculator = speculator  # speculative decoding (engine/speculative.py), or None
        self.pending: list[Sequence] = []  # waiting for their constraint's index to build
        self._inflight: Overlapped | None = None  # a decode step dispatched before the last one was read back
        self.forward_passes = 0
        self.step_time = {"decode": 0.0, "extend": 0.0}
        self.metrics: EngineMetrics | None = None  # Engine.enable_metrics
        self.reset_hit_rate_window()
        self._thread = threading.Thread(target=self.run, name="jsgl-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def started(self) -> bool:
        return self._thread.ident is not None

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=timeout)

    def idle(self) -> bool:
        return not self.pending and not self.scheduler.has_work() and self._inflight is None

    # --------------------------------------------------------------------------------------- loop
    def run(self) -> None:
        while True:
            news = self.mailbox.take()
            for seq in news.requests:
                if self.distinct.nodes >= HIT_RATE_WINDOW_TOKENS:
                    self.reset_hit_rate_window()  # bound the trie: a long-running server's memory stays flat
                self.distinct.add(seq.prompt_ids)
                if seq.constraint_ready is not None:
                    self.pending.append(seq)
                else:
                    self.scheduler.add(seq)
            self._activate_constraints()
            for flush in news.flushes:
                if not self.scheduler.has_work() and not self.pending:
                    self.prefix_cache.evict(self.prefix_cache.total_size())
                    self.reset_hit_rate_window()
                    flush.ok = True
                flush.done.set()
            for rid in news.aborts:
                seq = self.mailbox.get(rid)
                if seq is not None and not seq.finished:
                    self.finish(seq, FinishReason.ABORT, AbortReason.CLIENT, "aborted")
            if news.stopped:
                for seq in [*self.pending, *self.scheduler.waiting, *self.scheduler.prefilling,
                            *self.scheduler.running]:
                    self.finish(seq, FinishReason.ABORT, AbortReason.SHUTDOWN, "engine shut down")
                return
            compiler = self.runner.compiler
            if not self.scheduler.has_work() and self._inflight is None:
                compiler.engine_busy(False)
                if not self.pending and compiler.warm_next():  # one padding run, then look again
                    continue
                if self.runner.channel is not None:  # multi-process: the other ranks wait for rank 0's next message
                    self.runner.channel.keepalive()
                self.mailbox.wait(timeout=0.5)  # also the granularity of constraint timeouts
                continue
            compiler.engine_busy(True)
            try:
                self.step()
            except Exception:  # not attributable to one request (step() isolates those): fail the batch
                self._fail_all(log_failure("engine step failed outside any one request"))

    def _activate_constraints(self) -> None:
        """Hand requests whose FSM index finished building to the scheduler."""
        still = []
        now = time.monotonic()
        for seq in self.pending:
            if seq.finished:
                continue
            if not seq.constraint_ready.done():
                if now - seq.arrival_time > self.config.constraint_timeout_s:
                    self.finish(seq, FinishReason.ABORT, AbortReason.INVALID_REQUEST,
                                f"the constraint's index was not built within {self.config.constraint_timeout_s:g}"
                                " s (--constraint-timeout-s); simplify the regex or schema")
                else:
                    still.append(seq)
                continue
            try:
                self.constraints.activate(seq, self.scheduler.token_limit)
            except InvalidRequestError as exc:
                self.finish(seq, FinishReason.ABORT, AbortReason.INVALID_REQUEST, str(exc))
                continue
            self.scheduler.add(seq)
        self.pending = still

    def reset_hit_rate_window(self) -> None:
        """Achieved and optimal hit rates cover the same window: since start, the last flush, or the last time the
        optimum's trie reached HIT_RATE_WINDOW_TOKENS tokens."""
        s = self.scheduler.stats
        self.distinct = DistinctPrefixCounter()
        self.window_start = (s.prompt_tokens, s.cached_tokens)

    # --------------------------------------------------------------------------------------- step
    def step(self) -> Batch | None:
        """Run one batch and fold its sampled tokens back. With overlap scheduling the next decode step of the same
        requests is dispatched before this one is read back, and the following call runs that one instead of
        scheduling."""
        if self._inflight is not None:
            return self._absorb_overlapped()
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        t0 = time.perf_counter()
        if self.speculator is not None and batch.decoding:
            drafts = self._drafts(batch)
            if drafts is not None:
                rows = self._verify(batch, drafts)
                seconds = time.perf_counter() - t0
                self.speculator.costs.observe(bucket(rows), seconds)
                self._account(batch, seconds)
                return batch
        rows: list[int] = []  # batch positions that made it into the step
        items = []
        for i, (seq, chunk) in enumerate(zip(batch.seqs, batch.chunks)):
            try:
                items.append(self.outputs.forward_item(seq, chunk, batch.samples(i)))
                rows.append(i)
            except Exception:
                self._fail_one(seq, "preparing its step inputs")
        results = self._run_isolated(batch, rows, items)
        self._absorb(batch, rows, results)
        seconds = time.perf_counter() - t0
        if self.speculator is not None and batch.is_decode and self._inflight is None:
            self.speculator.costs.observe(bucket(len(items)), seconds)  # what a step of these rows costs here
        self._account(batch, seconds)
        return batch

    def _account(self, batch: Batch, seconds: float) -> None:
        self.step_time["decode" if batch.is_decode else "extend"] += seconds
        self.scheduler.account(batch, seconds)

    def _absorb(self, batch: Batch, rows: list[int], results: list[Any]) -> None:
        metrics = self.metrics
        now = time.monotonic() if metrics is not None else 0.0
        for i, result in zip(rows, results):
            seq = batch.seqs[i]
            if result is None:
                continue  # failed alone: already finished with its own error
            out, row = result
            try:
                publish = self.outputs.absorb(seq, batch.chunks[i], batch.samples(i), out, row)
            except Exception:
                self._fail_one(seq, "processing its sampled token")
                continue
            if metrics is not None:
                metrics.tokens(seq, now, batch.samples(i))
            if publish:
                self._publish(seq)
        self.scheduler.after_step(batch)

    def _publish(self, seq: Sequence) -> None:
        if seq.finished:  # free KV before waking the caller, so "done" implies "released"
            self.retire(seq)
        seq.publish()

    # ---------------------------------------------------------------------------- speculative decoding
    def _drafts(self, batch: Batch) -> dict[int, Draft] | None:
        """Drafts for a batch of the running requests (by batch position; their slots grown), or None when the step
        is better run as it is: no drafts and no jump-forward run to fold in, more requests than ``max_batch``, or more
        rows than a decode step has."""
        speculator, kv = self.speculator, self.scheduler.kv
        base_rows = sum(batch.chunks)
        # Above max_batch a jump-forward's run stays an extend step too: as rows, each of its tokens would pay for
        # the LM head, which an extend step computes for the sampled tokens only.
        if base_rows > self.config.max_running_requests or len(batch.seqs) > speculator.settings.max_batch:
            return None
        proposed: dict[int, Draft] = {}
        for i, seq in enumerate(batch.seqs):
            try:
                draft = speculator.draft(seq)
            except Exception:  # e.g. a grammar backend's error on a copied state: no draft, not a failed step
                log.warning("request %s: no draft (proposing failed)", seq.rid, exc_info=True)
                draft = None
            if draft is not None:
                proposed[i] = draft
        keep = choose_rows(base_rows, len(batch.seqs), [len(d.tokens) for d in proposed.values()],
                           [speculator.acceptance(batch.seqs[i]) for i in proposed], speculator.costs,
                           self.config.max_running_requests)
        drafts: dict[int, Draft] = {}
        for (i, draft), n in zip(proposed.items(), keep):
            draft.tokens = draft.tokens[:n]
            if n and kv.grow(batch.seqs[i], batch.seqs[i].num_tokens + n, evict=False):
                drafts[i] = draft
            elif not n:  # not worth its rows now: asks again later (and meanwhile lets steps overlap)
                speculator.passed_over(batch.seqs[i])
        if not drafts and batch.is_decode:
            return None
        return drafts

    def _verify(self, batch: Batch, drafts: dict[int, Draft]) -> int:
        """One decode step of one-token rows: each request's uncomputed tokens and its draft; then fold in what each
        accepted, and give back the slots of what it did not. Returns the rows computed."""
        self.scheduler.count_as_decode(batch)  # a jump-forward's run made it an extend step: no longer
        items: list[ForwardItem] = []
        spans: list[tuple[int, int]] = []  # (batch position, its first row)
        for i, seq in enumerate(batch.seqs):
            try:
                rows = self.outputs.verify_items(seq, drafts.get(i))
            except Exception:
                self._fail_one(seq, "preparing its step inputs")
                continue
            spans.append((i, len(items)))
            items += rows
        try:
            out = self._dispatch(batch.seqs, items, True).result() if items else None
        except Exception:
            if not self.runner.kv_intact():
                raise
            log.warning("a verify step failed; its requests step without drafts", exc_info=True)
            for seq in batch.seqs:
                self.scheduler.kv.shrink(seq, seq.num_tokens)
            rows = [i for i, _ in spans]
            items = [self.outputs.forward_item(batch.seqs[i], batch.chunks[i], batch.samples(i)) for i in rows]
            self._absorb(batch, rows, self._run_isolated(batch, rows, items))
            return len(items)
        metrics = self.metrics
        now = time.monotonic() if metrics is not None else 0.0
        for i, first in spans:
            seq = batch.seqs[i]
            draft = drafts.get(i)
            try:
                accepted = self.outputs.absorb_verified(seq, draft.tokens if draft else [], out, first)
            except Exception:
                self._fail_one(seq, "processing its sampled token")
                continue
            if draft is not None:
                self.speculator.verified(seq, len(draft.tokens), accepted)
            if not seq.finished:
                self.scheduler.kv.shrink(seq, seq.num_tokens)
            if metrics is not None:
                metrics.tokens(seq, now, True)
            self._publish(seq)
        self.speculator.stats.verify_steps += bool(drafts)
        self.scheduler.after_step(batch)
        return len(items)

    def _follow(self, batch: Batch, items: list[ForwardItem], pending: PendingStep) -> Overlapped | None:
        """Overlap the next decode step behind ``pending`` unless a request waits to be admitted."""
        if self.pending or self.mailbox.has_news():
            return None
        speculator = self.speculator
        if speculator is not None and len(batch.seqs) <= speculator.settings.max_batch \
                and any(speculator.may_draft(seq) for seq in batch.seqs):
            return None  # the next step may verify drafts, which depend on this one's tokens
        return self.overlap.follow(batch, items, pending, self._dispatch)

    def _absorb_overlapped(self) -> Batch:
        """Run the overlapped step dispatched by the previous call: first overlap the one after it, then read
        this one and fold in the rows of requests still running."""
        t0 = time.perf_counter()
        current, self._inflight = self._inflight, None
        batch, pending = current.batch, current.pending
        self._inflight = self._follow(batch, current.items, pending)
        try:
            out = pending.result()
        except Exception:
            self._inflight = None  # queued behind the failed step
            if not self.runner.kv_intact():
                raise
            # Nothing of it was folded in: the requests decode this token again through the scheduler.
            log.warning("an overlapped decode step failed; its requests go on without it", exc_info=True)
            return batch
        rows = [i for i in current.rows if not batch.seqs[i].finished]  # finished meanwhile: their row is void
        self._absorb(batch, rows, [(out, i) for i in rows])
        seconds = time.perf_counter() - t0
        self.step_time["decode"] += seconds
        self.scheduler.account(batch, seconds)
        return batch

    def _dispatch(self, seqs: list[Sequence], items: list[Any], is_decode: bool,
                  after: PendingStep | None = None) -> PendingStep:
        logprobs = any(s.params.return_logprob for s in seqs)
        top = max((s.params.top_logprobs_num for s in seqs if s.params.return_logprob), default=0)
        want_prompt = (not is_decode) and any(s.wants_prompt_logprobs for s in seqs)
        pending = self.runner.dispatch(items, logprobs=logprobs, top_logprobs=top,
                                       prompt_top_k=top if want_prompt else -1, after=after)
        self.forward_passes += 1
        return pending

    # ---------------------------------------------------------------------------- failure isolation
    def _run_isolated(self, batch: Batch, rows: list[int], items: list[Any]) -> list[Any]:
        """The step's output as one (StepOutput, row) per sequence, or None for a sequence whose step failed.
        When the batched forward fails, each sequence is rerun alone (its K/V writes go to its own slots, so
        recomputing them is harmless): a failure that follows one request's inputs fails that request only. A
        failure that consumed the donated KV pools cannot be confined to one request: it is raised and fails
        every running request. Between dispatching the step and reading it, the next may be overlapped."""
        if not items:
            return []
        seqs = [batch.seqs[i] for i in rows]
        try:
            pending = self._dispatch(seqs, items, batch.is_decode)
            if len(rows) == len(batch.seqs):
                self._inflight = self._follow(batch, items, pending)
            out = pending.result()
            return [(out, row) for row in range(len(items))]
        except Exception:
            self._inflight = None  # an overlapped step queued behind this one failed with it
            if not self.runner.kv_intact():
                raise
            if len(items) == 1:  # already alone
                self._fail_one(seqs[0], "its model step")
                return [None]
            log.warning("a batched step of %d requests failed; rerunning each alone", len(items))
        return [self._forward_alone(seq, item, batch.is_decode) for seq, item in zip(seqs, items)]

    def _forward_alone(self, seq: Sequence, item: Any, is_decode: bool) -> Any:
        try:
            return self._dispatch([seq], [item], is_decode).result(), 0
        except Exception:
            if not self.runner.kv_intact():
                raise
            self._fail_one(seq, "its model step")
            return None

    def _fail_one(self, seq: Sequence, where: str) -> None:
        """Finish one request whose own step failed. Its error names an id to find the logged traceback, never the
        exception text (which may quote request content)."""
        error_id = log_failure(f"request {seq.rid} failed in {where}")
        self.finish(seq, FinishReason.ABORT, AbortReason.STEP_FAILED,
                    f"internal error in {where} (error id {error_id})")

    def _fail_all(self, error_id: str) -> None:
        """A step failed outside any one request: every request in it ends; lost pools are reallocated."""
        self._inflight = None
        lost_kv = not self.runner.kv_intact()  # the pools were donated to the failed call
        if lost_kv:
            self.runner.reset_kv()
        message = f"internal error in the engine step (error id {error_id})"
        for seq in [*self.scheduler.prefilling, *self.scheduler.running, *self._orphans()]:
            try:
                self.finish(seq, FinishReason.ABORT, AbortReason.STEP_FAILED, message)
            except Exception:  # its state is what broke: answer the caller anyway (its KV may leak)
                log_failure(f"request {seq.rid} could not be released after {error_id}")
                seq.finish_reason, seq.abort_reason, seq.error = FinishReason.ABORT, AbortReason.STEP_FAILED, message
                self.mailbox.retire(seq.rid)
                seq.publish()
        if lost_kv:  # what the tree points at is gone too
            self.prefix_cache.evict(self.prefix_cache.total_size())

    def _orphans(self) -> list[Sequence]:
        """Live requests in no queue: a step that failed midway through moving one (a retraction between `running`
        and `waiting`) would otherwise leave its caller waiting forever."""
        untaken, live = self.mailbox.untaken_or_live()
        queued = {id(s) for s in [*untaken, *self.pending, *self.scheduler.waiting, *self.scheduler.prefilling,
                                  *self.scheduler.running]}
        return [s for s in live if id(s) not in queued and s.finish_reason is None]

    # ----------------------------------------------------------------------------------- finishing
    def finish(self, seq: Sequence, reason: FinishReason, abort_reason: AbortReason | None = None,
               error: str | None = None) -> None:
        seq.finish_reason, seq.abort_reason, seq.error = reason, abort_reason, error
        self.retire(seq)
        seq.publish()

    def retire(self, seq: Sequence) -> None:
        """Release a finished request: its KV (to the cache or the allocator), its constraint build, its id."""
        self.distinct.add_generated(seq.token_ids)  # the cache keeps the output too: later prompts may reuse it
        if self.metrics is not None:
            self.metrics.finished(seq, time.monotonic())
        self.scheduler.drop(seq)
        if self.speculator is not None:
            self.speculator.forget(seq)
        release_constraints([seq])
        self.mailbox.retire(seq.rid)


def release_constraints(seqs: list[Sequence]) -> None:
    """Let go of index builds nobody waits for any more (the build stops when no request holds it)."""
    for seq in seqs:
        future, seq.constraint_ready = seq.constraint_ready, None
        if future is not None:
            release_index(future)


def log_failure(what: str) -> str:
    """Log the current exception under a fresh error id, and return the id for the caller's message."""
    error_id = secrets.token_hex(6)
    log.exception("%s (error id %s)", what, error_id)
    return error_id
