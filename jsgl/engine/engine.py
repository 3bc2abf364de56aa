"""The engine: the public API over model runner + scheduler, with a background step loop.

``submit`` validates and tokenizes on the caller's thread and hands the sequence to the loop; the loop
thread alone touches the scheduler, the allocator and the device. Results and stream chunks flow back
through each sequence's queue, so the API is thread-safe.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import secrets
import threading
import time
from collections.abc import Sequence as Seq
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jsgl.engine.admission import Admission, check_text
from jsgl.engine.config import EngineConfig
from jsgl.engine.constrained import ConstraintManager
from jsgl.engine.detokenizer import IncrementalDetokenizer
from jsgl.engine.handle import RequestHandle
from jsgl.engine.kv_pool import SlotAllocator
from jsgl.engine.memory import plan_memory, resolve_dtypes
from jsgl.engine.model_runner import ForwardItem, ModelRunner, PendingStep, bucket, enable_compilation_cache
from jsgl.engine.output_processor import OutputProcessor
from jsgl.engine.platform import current_platform, describe, resolve_defaults
from jsgl.engine.request import (
    AbortReason,
    FinishReason,
    GenerateOutput,
    InvalidRequestError,
    SamplingParams,
    new_request_id,
)
from jsgl.engine.sampling_params import expand_parallel_samples
from jsgl.engine.scheduler import Batch, Scheduler
from jsgl.engine.sequence import Sequence
from jsgl.engine.spanned_prompt import SpannedPrompt
from jsgl.fsm import release_index
from jsgl.kernels import cpu as cpu_kernels
from jsgl.model.llama import packed_from_blocks
from jsgl.model.loader import load_gguf_blocks, load_placed
from jsgl.model.placement import to_device
from jsgl.model.sharding import TensorParallel
from jsgl.model.tokenizer import load_tokenizer, stop_token_ids
from jsgl.radix.cache_base import PrefixCacheBase
from jsgl.radix.flat_cache import FlatCache
from jsgl.radix.metrics import DistinctPrefixCounter
from jsgl.radix.no_cache import NoPrefixCache
from jsgl.radix.radix_cache import RadixCache
from jsgl.radix.schedule_policy import POLICIES, order_waiting

log = logging.getLogger("jsgl.engine")

# Tokens the optimal-hit-rate trie may hold: ~256 B a node, so ~8 MB. Outputs go in too (a next call extends
# them); with them the old 1 << 18 window (~67 MB) let a soak of unique sampled outputs outgrow its memory bound.
HIT_RATE_WINDOW_TOKENS = 1 << 15
# On CPU the device's work runs on the host's own cores, so overlapping the host's work with it pays only while
# the step leaves them idle part of the time. bench_decode, overlap over sync (tokens/s, 5 rounds, 2 cores):
# batch 1 +7%, 2 +19%, 4 +13%, 8 +6%, 16 -4% (twice): a 16-row step keeps both cores busy.
CPU_OVERLAP_MAX_BATCH = 8


class Engine:
    def __init__(self, model: str = "smollm2-135m", config: EngineConfig | None = None, **options: Any):
        cfg = config or EngineConfig(model=model, **options)
        started = time.perf_counter()
        # The platform's defaults fill what was left unset, so `config` reads as what runs (page size, pool).
        self.platform = current_platform(cfg.device)
        defaults = resolve_defaults(self.platform, page_size=cfg.page_size, kv_cache_gb=cfg.kv_cache_gb,
                                    num_kv_slots=cfg.num_kv_slots, mem_fraction=cfg.mem_fraction)
        self.config = cfg = dataclasses.replace(cfg, **dataclasses.asdict(defaults))
        enable_compilation_cache()
        self.dtype, self.kv_dtype = resolve_dtypes(cfg.dtype, cfg.kv_dtype, self.platform.name)
        # The CPU kernels are float32: the matmul kernels take float32 weights and the attention kernel float32
        # pools and activations, so on CPU "auto" means XLA's dot under another dtype, and the native attention
        # under another dtype or KV dtype (the 8-bit format included).
        matmul, attention = cfg.matmul_backend, cfg.attention_backend
        on_cpu = not self.platform.accelerator
        if self.dtype != jnp.float32 and on_cpu and matmul == "auto":
            matmul = "xla"
        if (self.dtype != jnp.float32 or self.kv_dtype != jnp.float32) and on_cpu and attention == "auto":
            attention = "native"
        matmul = cpu_kernels.resolve_matmul_backend(matmul, cfg.tp)
        if self.dtype != jnp.float32 and matmul != "xla":
            raise ValueError(f"dtype {self.dtype}: the CPU matmul kernels are float32; use matmul_backend=xla "
                             "(or auto)")
        if (self.dtype != jnp.float32 or self.kv_dtype != jnp.float32) and attention == "cpu":
            raise ValueError(f"dtype {self.dtype}, kv_dtype {self.kv_dtype}: the CPU attention kernel is float32; "
                             "use attention_backend=native (or auto)")
        # The matrices the kernels read from the GGUF's own blocks are not loaded as float32 at all.
        weight_blocks = load_gguf_blocks(cfg.model) if matmul == "gguf" else None
        # Each tensor is cast and put on its device (or its shards on theirs) as the loader reads it, or restored
        # onto them from the orbax checkpoint of an earlier start: the host never holds the whole model (but for a
        # GGUF's converted weights while a new dtype or tp degree is first placed).
        self.model_config, params = load_placed(cfg.model, self.dtype, cfg.tp, self._placer, self._sharding,
                                                cfg.weights_cache, skip=packed_from_blocks(weight_blocks))
        load_s = time.perf_counter() - started
        self.tokenizer = load_tokenizer(cfg.model)
        self.stop_ids = stop_token_ids(self.tokenizer, list(self.model_config.eos_token_ids))
        self.max_context = min(cfg.context_length or self.model_config.max_position_embeddings,
                               self.model_config.max_position_embeddings)
        self.memory_plan = plan_memory(self.model_config, tp=cfg.tp, mem_fraction=cfg.mem_fraction,
                                       kv_cache_gb=cfg.kv_cache_gb, num_kv_slots=cfg.num_kv_slots,
                                       max_step_tokens=cfg.chunked_prefill_size, max_batch=cfg.max_running_requests,
                                       weight_itemsize=self.dtype.itemsize, kv_dtype=self.kv_dtype)
        num_slots = self.memory_plan.num_slots
        if cfg.mem_fraction is not None or self.platform.accelerator:
            log.info("memory plan:\n%s", self.memory_plan.render())
        num_slots = max(num_slots - num_slots % cfg.page_size, 2 * cfg.page_size)
        self.memory_plan = dataclasses.replace(self.memory_plan, num_slots=num_slots)  # the pool as allocated
        self.allocator = SlotAllocator(num_slots, cfg.page_size)
        self.runner = ModelRunner(self.model_config, params, num_slots, params_placed=True,
                                  attention_backend=attention, matmul_backend=matmul, kv_dtype=self.kv_dtype,
                                  weight_blocks=weight_blocks,
                                  max_context=self.max_context,
                                  tp=cfg.tp, max_top_logprobs=cfg.max_top_logprobs, page_size=cfg.page_size)
        del params
        self.platform_report = describe(self.platform, dtype=self.dtype.name, kv_dtype=self.kv_dtype.name,
                                        attention_backend=self.runner.attention_backend,
                                        matmul_backend=self.runner.matmul_backend, page_size=cfg.page_size)
        log.info("running on %s", ", ".join(f"{k} {v}" for k, v in self.platform_report.items()))
        # Prefill's matmuls on AMX tiles (near float32, not bitwise the AVX-512 kernels'): said once, and in stats().
        self.amx_prefill = matmul != "xla" and cpu_kernels.amx_enabled()
        if self.amx_prefill:
            log.info("matmuls of more than 16 rows run on AMX (three bfloat16 products per float32 product; "
                     "JSGL_NO_AMX=1 keeps the AVX-512 kernels)")
        self.prefix_cache = self._make_prefix_cache()
        self.scheduler = Scheduler(
            self.allocator, self.prefix_cache, max_running=cfg.max_running_requests,
            chunk_size=cfg.chunked_prefill_size, max_context=self.max_context,
            attention_budget_bytes=int(cfg.attention_budget_gb * (1 << 30)),
            attention_bytes=self.runner.attention_bytes, order_waiting=self._order_waiting(),
            padded_attention=not self.runner.length_free, match_fraction=cfg.cache_match_fraction)
        self._rng = random.Random(cfg.seed)
        self._lock = threading.Lock()
        self._inbox: list[Sequence] = []
        self._aborts: set[str] = set()
        self._by_id: dict[str, Sequence] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._flush: list[tuple[threading.Event, list[bool]]] = []
        self._pending: list[Sequence] = []  # waiting for their constraint's index to build
        self._inflight: Overlapped | None = None  # a decode step dispatched before the last one was read back
        self._overlap_max_batch = cfg.max_running_requests if self.platform.accelerator else CPU_OVERLAP_MAX_BATCH
        self.constraints = ConstraintManager(self.tokenizer, self.model_config.vocab_size, self.stop_ids,
                                             self.config.jump_forward, self.config.grammar_backend)
        self.admission = Admission(cfg, self.tokenizer, self.model_config.vocab_size, self.max_context,
                                   self.allocator.capacity)
        self.outputs = OutputProcessor(self.constraints, self.model_config.vocab_size, self.scheduler.token_limit)
        self._reset_hit_rate_window()
        self.forward_passes = 0
        self.overlapped_steps = 0  # decode steps dispatched before the step they follow was read back
        self.step_time = {"decode": 0.0, "extend": 0.0}
        self.startup_s = {"load": load_s, "precompile": self._precompile(), "total": time.perf_counter() - started}
        self._thread = threading.Thread(target=self._loop, name="jsgl-engine", daemon=True)
        self._thread.start()

    def _precompile(self) -> float:
        """Compile the planned step shapes before the first request (``EngineConfig.precompile``)."""
        plan = self.runner.planned_signatures(self.config.precompile, self.config.max_running_requests,
                                              self.config.chunked_prefill_size)
        if not plan:
            return 0.0
        t0 = time.perf_counter()
        self.runner.precompile(plan)
        self.constraints.backend.warm()
        seconds = time.perf_counter() - t0
        log.info("precompiled %d step shapes (%s) in %.1f s", len(plan), self.config.precompile, seconds)
        return seconds

    def _placer(self, config: Any) -> Any:
        """Where each loaded tensor goes: the default device, or under tensor parallelism each device's slice of
        the padded tensor (jsgl.model.sharding)."""
        if self.config.tp > 1:
            return TensorParallel.create(config, self.config.tp).place
        return lambda name, x: to_device(x)

    def _sharding(self, config: Any) -> Any:
        """Where each restored checkpoint array goes (what ``_placer`` gives a loaded one): (leaf name, shape)
        -> its sharding."""
        if self.config.tp > 1:
            return TensorParallel.create(config, self.config.tp).sharding
        device = SingleDeviceSharding(jax.devices()[0])
        return lambda name, shape: device

    # --------------------------------------------------------------------------- extension points
    def _make_prefix_cache(self) -> PrefixCacheBase:
        cache_cls = {"radix": RadixCache, "flat": FlatCache, "none": NoPrefixCache}[self.config.prefix_cache]
        return cache_cls(page_size=self.config.page_size, free_slots=self.allocator.free)

    def _order_waiting(self) -> Any:
        policy, starvation = self.config.schedule_policy, self.config.starvation_s
        if policy not in POLICIES:
            raise ValueError(f"unknown schedule policy {policy!r}; known: {POLICIES}")
        rng = random.Random(self.config.seed)
        return lambda waiting: order_waiting(waiting, policy, self.prefix_cache, time.monotonic(),
                                             starvation, rng=rng)

    # ---------------------------------------------------------------------------------- public API
    def submit(self, prompt: str | SpannedPrompt | Seq[int], sampling_params: SamplingParams | dict | None = None,
               request_id: str | None = None) -> RequestHandle:
        """Queue one request; returns at once. Raises InvalidRequestError on bad input. A `SpannedPrompt`'s plain
        spans are tokenized as plain text (special tokens' strings there split)."""
        return self._enqueue([self._make_sequence(prompt, sampling_params, request_id)])[0]

    def submit_batch(self, prompts: list, sampling_params: list,
                     request_ids: list[str] | None = None) -> list[RequestHandle]:
        """Queue several requests atomically: the scheduler sees them in the same step. (Submitted one by one,
        the first of an HTTP request's 64 MMLU prompts started computing alone while the rest were tokenized:
        0.7 s more of a 5 s batch.) ``request_ids``: the client's ids, one per prompt."""
        seqs: list[Sequence] = []
        ids = request_ids if request_ids is not None else [None] * len(prompts)
        try:
            for prompt, params, rid in zip(prompts, sampling_params, ids, strict=True):
                seqs.append(self._make_sequence(prompt, params, rid))
        except BaseException:
            self._release_constraints(seqs)  # all or nothing: no build keeps running for a rejected batch
            raise
        return self._enqueue(seqs)

    def _make_sequence(self, prompt: str | SpannedPrompt | Seq[int], sampling_params: Any,
                       request_id: str | None) -> Sequence:
        params = self.admission.sampling_params(sampling_params)
        if request_id is not None:
            check_text(request_id, "request id")
        ids = self.admission.prompt_ids(prompt, params)
        seed = params.sampling_seed
        # The sampler keys on 32 bits: fold a 64-bit seed's halves together rather than drop one.
        seed = self._rng.getrandbits(32) if seed is None else (seed ^ (seed >> 32)) & 0xFFFFFFFF
        detok = IncrementalDetokenizer(
            self.tokenizer, params.stop_strings, params.skip_special_tokens, stop_regexes=params.stop_regexes,
            spaces_between_special_tokens=params.spaces_between_special_tokens, no_stop_trim=params.no_stop_trim)
        detok.check_stops = params.min_new_tokens == 0
        seq = Sequence(
            rid=request_id or new_request_id(), prompt_ids=ids, params=params, detok=detok,
            seed=seed, stop_ids=set() if params.ignore_eos else set(self.stop_ids),
        )
        seq.stop_ids |= set(params.stop_token_ids or [])
        self._prepare_constraint(seq)
        return seq

    def _enqueue(self, seqs: list[Sequence]) -> list[RequestHandle]:
        with self._lock:
            if self._stopped:
                self._release_constraints(seqs)
                raise RuntimeError("the engine is shut down")
            rids = [seq.rid for seq in seqs]
            taken = [r for r in rids if r in self._by_id] or sorted({r for r in rids if rids.count(r) > 1})
            if taken:  # checked under the lock: two requests can never share an id (aborts hit by id)
                self._release_constraints(seqs)
                raise InvalidRequestError(f"request id {taken[0]!r} is already in use")
            self._inbox.extend(seqs)
            self._by_id.update((seq.rid, seq) for seq in seqs)
        self._wake.set()
        return [RequestHandle(self, seq) for seq in seqs]

    def generate(self, prompts: str | SpannedPrompt | Seq[int] | list, sampling_params: Any = None,
                 progress: bool | None = None) -> GenerateOutput | list[GenerateOutput]:
        """Generate for one prompt or a list (ids lists count as one prompt each); blocks. With n > 1 in
        a prompt's params, its n outputs come consecutively and the result is always a list."""
        single = isinstance(prompts, (str, SpannedPrompt)) or (len(prompts) > 0 and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(batch)
        if len(params) != len(batch):
            raise InvalidRequestError("need one sampling_params per prompt")
        params = [self.admission.sampling_params(p, allow_n=True) for p in params]
        if any(p.n > 1 for p in params):  # n samples of a prompt: n requests, consecutive (as SGLang)
            batch, params = expand_parallel_samples(batch, params)
            single = False
        handles = self.submit_batch(batch, params)
        show = progress if progress is not None else (not single and len(batch) > 1)
        if show:
            from tqdm.auto import tqdm

            outputs = [h.result() for h in tqdm(handles, desc="generate", unit="req")]
        else:
            outputs = [h.result() for h in handles]
        return outputs[0] if single else outputs

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)
        self._wake.set()

    def flush_cache(self, timeout: float = 30.0) -> bool:
        """Empty the prefix cache; refused (False) while requests are queued or running."""
        done, result = threading.Event(), [False]
        with self._lock:
            if self._inbox:
                return False
            self._flush.append((done, result))
        self._wake.set()
        done.wait(timeout)
        return result[0]

    def stats(self) -> dict[str, Any]:
        s = self.scheduler.stats
        window_prompt = s.prompt_tokens - self._window[0]
        cache = self.prefix_cache
        tree = {"cache_tokens": cache.total_size(), "evicted_tokens": cache.evicted_tokens_total,
                "tree_time_s": cache.time_s}
        return {
            **tree,
            # Achieved and optimal hit rates cover the same window: since start, the last flush, or the
            # last time the optimum's trie reached HIT_RATE_WINDOW_TOKENS tokens. (The optimum
            # assumes an empty cache at the window's start: just after a size reset, the tree's older
            # entries can let the achieved rate exceed it; after a flush it cannot.)
            "cache_hit_rate": (s.cached_tokens - self._window[1]) / window_prompt if window_prompt else 0.0,
            "optimal_hit_rate": self._distinct.optimal_hit_rate,
            "forward_passes": self.forward_passes, "overlapped_steps": self.overlapped_steps,
            "jump_forward_tokens": self.constraints.jumped_tokens, "steps": s.steps, "extend_steps": s.extend_steps,
            "decode_steps": s.decode_steps, "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens, "computed_prefill_tokens": s.computed_prefill_tokens,
            "retractions": s.retractions, "compiles": self.runner.compiles,
            **self.platform_report, "amx_prefill": self.amx_prefill,
            "cpu_vector_isa": cpu_kernels.vector_isa() if self.runner.matmul_backend != "xla" else None,
            "unplanned_compiles": self.runner.unplanned_compiles,
            "weight_bytes": self.memory_plan.weight_bytes, "kv_bytes": self.memory_plan.kv_bytes,
            "device_bytes": self.memory_plan.device_bytes, "device_free_bytes": self.memory_plan.free_bytes,
            "startup_s": self.startup_s["total"],
            "precompile_s": self.startup_s["precompile"],
            "load_s": self.startup_s["load"],  # weights: loaded, or restored from their orbax checkpoint
            "free_slots": self.allocator.num_free(), "total_slots": self.allocator.capacity,
            "mean_batch_size": s.batched_requests / s.steps if s.steps else 0.0,
            "decode_time_s": self.step_time["decode"], "extend_time_s": self.step_time["extend"],
        }

    def idle(self) -> bool:
        with self._lock:
            return not self._inbox and not self._pending and not self.scheduler.has_work()

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------------------------ helpers
    def _prepare_constraint(self, seq: Sequence) -> None:
        future = self.constraints.prepare(seq)
        if future is not None:
            future.add_done_callback(lambda _: self._wake.set())

    def _activate_constraints(self) -> None:
        """Hand requests whose FSM index finished building to the scheduler."""
        still = []
        now = time.monotonic()
        for seq in self._pending:
            if seq.finished:
                continue
            if not seq.constraint_ready.done():
                if now - seq.arrival_time > self.config.constraint_timeout_s:
                    self._finish(seq, FinishReason.ABORT, AbortReason.INVALID_REQUEST,
                                 f"the constraint's index was not built within {self.config.constraint_timeout_s:g}"
                                 " s (--constraint-timeout-s); simplify the regex or schema")
                else:
                    still.append(seq)
                continue
            try:
                self.constraints.activate(seq, self.scheduler.token_limit)
            except InvalidRequestError as exc:
                self._finish(seq, FinishReason.ABORT, AbortReason.INVALID_REQUEST, str(exc))
                continue
            self.scheduler.add(seq)
        self._pending = still

    # --------------------------------------------------------------------------------- step loop
    def _loop(self) -> None:
        while True:
            with self._lock:
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, set()
                stopped = self._stopped
            for seq in inbox:
                if self._distinct.nodes >= HIT_RATE_WINDOW_TOKENS:
                    self._reset_hit_rate_window()  # bound the trie: a long-running server's memory stays flat
                self._distinct.add(seq.prompt_ids)
                if seq.constraint_ready is not None:
                    self._pending.append(seq)
                else:
                    self.scheduler.add(seq)
            self._activate_constraints()
            self._run_flushes()
            for rid in aborts:
                self._abort_now(rid)
            if stopped:
                for seq in [*self._pending, *self.scheduler.waiting, *self.scheduler.prefilling,
                            *self.scheduler.running]:
                    self._finish(seq, FinishReason.ABORT, AbortReason.SHUTDOWN, "engine shut down")
                return
            if not self.scheduler.has_work() and self._inflight is None:
                # Also the granularity of constraint timeouts while only pending requests remain.
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception:  # not attributable to one request (step() isolates those): fail the batch
                error_id = log_failure("engine step failed outside any one request")
                self._inflight = None
                lost_kv = not self.runner.kv_intact()  # the pools were donated to the failed call
                if lost_kv:
                    self.runner.reset_kv()
                for seq in [*self.scheduler.prefilling, *self.scheduler.running, *self._orphans()]:
                    message = f"internal error in the engine step (error id {error_id})"
                    try:
                        self._finish(seq, FinishReason.ABORT, AbortReason.STEP_FAILED, message)
                    except Exception:  # its state is what broke: answer the caller anyway (its KV may leak)
                        log_failure(f"request {seq.rid} could not be released after {error_id}")
                        seq.finish_reason, seq.abort_reason, seq.error = (FinishReason.ABORT,
                                                                          AbortReason.STEP_FAILED, message)
                        with self._lock:
                            self._by_id.pop(seq.rid, None)
                        seq.publish()
                if lost_kv:  # what the tree points at is gone too
                    self.prefix_cache.evict(self.prefix_cache.total_size())

    def _orphans(self) -> list[Sequence]:
        """Live requests in no queue: a step that failed midway through moving one (a retraction between
        `running` and `waiting`) would otherwise leave its caller waiting forever."""
        queued = {id(s) for s in [*self._pending, *self.scheduler.waiting, *self.scheduler.prefilling,
                                  *self.scheduler.running]}
        with self._lock:
            live = list(self._by_id.values())
            queued.update(id(s) for s in self._inbox)
        return [s for s in live if id(s) not in queued and s.finish_reason is None]

    def _run_flushes(self) -> None:
        with self._lock:
            flushes, self._flush = self._flush, []
        for done, result in flushes:
            if not self.scheduler.has_work() and not self._pending:
                self.prefix_cache.evict(self.prefix_cache.total_size())
                self._reset_hit_rate_window()
                result[0] = True
            done.set()

    def _reset_hit_rate_window(self) -> None:
        s = self.scheduler.stats
        self._distinct = DistinctPrefixCounter()
        self._window = (s.prompt_tokens, s.cached_tokens)

    def _abort_now(self, rid: str) -> None:
        seq = self._by_id.get(rid)
        if seq is not None and not seq.finished:
            self._finish(seq, FinishReason.ABORT, AbortReason.CLIENT, "aborted")

    def step(self) -> Batch | None:
        """Run one batch and fold its sampled tokens back (engine thread only). With overlap scheduling the
        next decode step of the same requests is dispatched before this one is read back (``_overlap``), and
        the following call runs that one instead of scheduling."""
        if self._inflight is not None:
            return self._absorb_overlapped()
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        t0 = time.perf_counter()
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
        self.step_time["decode" if batch.is_decode else "extend"] += time.perf_counter() - t0
        return batch

    def _absorb(self, batch: Batch, rows: list[int], results: list[Any]) -> None:
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
            if publish:
                if seq.finished:  # free KV before waking the caller, so "done" implies "released"
                    self._retire(seq)
                seq.publish()
        self.scheduler.after_step(batch)

    def _overlap(self, batch: Batch, items: list[ForwardItem], pending: PendingStep) -> Overlapped | None:
        """Dispatch the next decode step of ``batch``'s requests behind ``pending``, its tokens taken from
        ``pending``'s on device, when nothing the host would learn from ``pending`` can change that step: no
        request waits to be admitted, and no request's next sampling depends on this token (FSM masks,
        penalties, logit bias). A request that finishes on ``pending``'s token wastes its row of the next step
        (its KV write lands in a slot it has already freed, before anyone can reuse it: steps run in order);
        a request known to finish on it (length) gets a padding row, and too many of those end the overlap."""
        if not (self.config.overlap_schedule and batch.is_decode) or self._pending or \
                self.scheduler.waiting or self.scheduler.prefilling or len(batch.seqs) > self._overlap_max_batch:
            return None
        with self._lock:
            if self._inbox or self._aborts or self._flush or self._stopped:
                return None
        if any(it.bitmask is not None or it.logit_bias is not None or it.repetition_scale is not None
               for it in items):
            return None
        limit = self.scheduler.token_limit
        going = [not s.finished and len(s.output_ids) + 1 < s.max_new_tokens and s.num_tokens + 1 < limit
                 for s in batch.seqs]
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
            if not self.scheduler.grow(seq, position + 1):  # may evict from the cache
                return None
            next_items.append(dataclasses.replace(item, token_ids=np.zeros(1, np.int32), start_pos=position,
                                                  slots=seq.slots, step=len(seq.output_ids) + 1))
        try:
            following = self._dispatch(batch.seqs, next_items, True, after=pending)
        except Exception:  # not run: the requests go on through the scheduler
            if not self.runner.kv_intact():
                raise
            log.warning("an overlapped decode step could not be dispatched; continuing without", exc_info=True)
            return None
        self.scheduler.count_step(True, sum(going))
        self.overlapped_steps += 1
        return Overlapped(Batch(True, list(batch.seqs), [1] * len(batch.seqs)), next_items,
                          [i for i, go in enumerate(going) if go], following)

    def _absorb_overlapped(self) -> Batch:
        """Run the overlapped step dispatched by the previous call: first overlap the one after it, then read
        this one and fold in the rows of requests still running."""
        t0 = time.perf_counter()
        current, self._inflight = self._inflight, None
        batch, pending = current.batch, current.pending
        self._inflight = self._overlap(batch, current.items, pending)
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
        self.step_time["decode"] += time.perf_counter() - t0
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

    def _forward(self, seqs: list[Sequence], items: list[Any], is_decode: bool) -> Any:
        return self._dispatch(seqs, items, is_decode).result()

    def _run_isolated(self, batch: Batch, rows: list[int], items: list[Any]) -> list[Any]:
        """The step's output as one (StepOutput, row) per sequence, or None for a sequence whose step
        failed. When the batched forward fails, each sequence is rerun alone (its K/V writes go to its
        own slots, so recomputing them is harmless): a failure that follows one request's inputs fails
        that request only, and the others continue. A failure that consumed the donated KV pools cannot
        be confined to one request: it is raised and fails every running request. Between dispatching the
        batched step and reading it, the next decode step may be overlapped behind it (``_overlap``)."""
        if not items:
            return []
        seqs = [batch.seqs[i] for i in rows]
        try:
            pending = self._dispatch(seqs, items, batch.is_decode)
            if len(rows) == len(batch.seqs):
                self._inflight = self._overlap(batch, items, pending)
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
            return self._forward([seq], [item], is_decode), 0
        except Exception:
            if not self.runner.kv_intact():
                raise
            self._fail_one(seq, "its model step")
            return None

    def _fail_one(self, seq: Sequence, where: str) -> None:
        """Finish one request whose own step failed. Its error names an id to find the logged traceback,
        never the exception text (which may quote request content)."""
        error_id = log_failure(f"request {seq.rid} failed in {where}")
        self._finish(seq, FinishReason.ABORT, AbortReason.STEP_FAILED,
                     f"internal error in {where} (error id {error_id})")

    def _finish(self, seq: Sequence, reason: FinishReason, abort_reason: AbortReason | None = None,
                error: str | None = None) -> None:
        seq.finish_reason, seq.abort_reason, seq.error = reason, abort_reason, error
        self._retire(seq)
        seq.publish()

    def _retire(self, seq: Sequence) -> None:
        self._distinct.add_generated(seq.token_ids)  # the cache keeps the output too: later prompts may reuse it
        self.scheduler.drop(seq)
        self._release_constraints([seq])
        with self._lock:
            self._by_id.pop(seq.rid, None)

    @staticmethod
    def _release_constraints(seqs: list[Sequence]) -> None:
        """Let go of index builds nobody waits for any more (the build stops when no request holds it)."""
        for seq in seqs:
            future, seq.constraint_ready = seq.constraint_ready, None
            if future is not None:
                release_index(future)


@dataclasses.dataclass
class Overlapped:
    """A decode step dispatched behind the one before it, not yet read back."""

    batch: Batch  # every request of the step before, in the same rows
    items: list[ForwardItem]
    rows: list[int]  # the rows that compute a request's next token (the others are padding)
    pending: PendingStep


def log_failure(what: str) -> str:
    """Log the current exception under a fresh error id, and return the id for the caller's message."""
    error_id = secrets.token_hex(6)
    log.exception("%s (error id %s)", what, error_id)
    return error_id
