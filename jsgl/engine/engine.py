"""The engine's public API (thread-safe) and its wiring.

``submit`` validates and tokenizes on the caller's thread and posts the sequence to the ``Mailbox``; the engine
thread (``EngineLoop``, engine_loop.py) alone touches the scheduler, the allocator and the device. Results and
stream chunks flow back through each sequence's queue.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Sequence as Seq
from typing import Any

import jax
from jax.sharding import SingleDeviceSharding

from jsgl.engine import multihost
from jsgl.engine.admission import Admission, check_text
from jsgl.engine.backends import checked_on_device, resolve_backends
from jsgl.engine.config import EngineConfig
from jsgl.engine.constrained import ConstraintManager
from jsgl.engine.detokenizer import IncrementalDetokenizer
from jsgl.engine.engine_loop import EngineLoop, release_constraints
from jsgl.engine.handle import RequestHandle
from jsgl.engine.kv_pool import SlotAllocator
from jsgl.engine.lifecycle import EngineThreads, stop_when_unused
from jsgl.engine.mailbox import Mailbox
from jsgl.engine.memory import plan_memory, resolve_dtypes
from jsgl.engine.metrics import EngineMetrics
from jsgl.engine.model_runner import ModelRunner, enable_compilation_cache
from jsgl.engine.output_processor import OutputProcessor
from jsgl.engine.overlap import CPU_OVERLAP_MAX_BATCH, OverlapScheduler
from jsgl.engine.platform import current_platform, describe, max_step_tokens, pool_slots, resolve_defaults
from jsgl.engine.precompiler import compile_plan
from jsgl.engine.request import GenerateOutput, InvalidRequestError, SamplingParams, new_request_id
from jsgl.engine.sampling_params import expand_parallel_samples
from jsgl.engine.scheduler import Scheduler
from jsgl.engine.sequence import Sequence
from jsgl.engine.spanned_prompt import SpannedPrompt
from jsgl.engine.speculative import make_speculator
from jsgl.kernels import cpu as cpu_kernels
from jsgl.model.llama import packed_from_blocks
from jsgl.model.loader import load_gguf_blocks, load_placed
from jsgl.model.placement import to_device
from jsgl.model.sharding import TensorParallel
from jsgl.model.tokenizer import load_tokenizer, stop_token_ids
from jsgl.radix.cache_base import PrefixCacheBase
from jsgl.radix.flat_cache import FlatCache
from jsgl.radix.no_cache import NoPrefixCache
from jsgl.radix.radix_cache import RadixCache
from jsgl.radix.schedule_policy import POLICIES, order_waiting

log = logging.getLogger("jsgl.engine")


class Engine:
    def __init__(self, model: str = "smollm2-135m", config: EngineConfig | None = None, **options: Any):
        cfg = config or EngineConfig(model=model, **options)
        started = time.perf_counter()
        if cfg.nnodes > 1:  # before anything touches a jax backend
            multihost.initialize(cfg.dist_init_addr, cfg.nnodes, cfg.node_rank, cfg.dist_timeout)
            # Every process must run the same programs: nothing runs a step but rank 0's broadcasts (no padding runs
            # of a precompile), and each process places its own shards from the model (no orbax checkpoint of them).
            cfg = dataclasses.replace(cfg, precompile="off", weights_cache="off")  # (tp: checked by make_mesh)
        # The platform's defaults fill what was left unset, so `config` reads as what runs (page size, pool).
        self.platform = current_platform(cfg.device)
        defaults = resolve_defaults(self.platform, page_size=cfg.page_size, kv_cache_gb=cfg.kv_cache_gb,
                                    num_kv_slots=cfg.num_kv_slots, mem_fraction=cfg.mem_fraction,
                                    mixed_prefill_tokens=cfg.mixed_prefill_tokens,
                                    chunked_prefill_size=cfg.chunked_prefill_size,
                                    max_running_requests=cfg.max_running_requests)
        self.config = cfg = dataclasses.replace(cfg, **dataclasses.asdict(defaults))
        enable_compilation_cache()
        self.dtype, self.kv_dtype = resolve_dtypes(cfg.dtype, cfg.kv_dtype, self.platform.name)
        self.backends = resolve_backends(cfg.attention_backend, cfg.matmul_backend, tp=cfg.tp, dtype=self.dtype,
                                         kv_dtype=self.kv_dtype, page_size=cfg.page_size, platform=self.platform.name,
                                         layers=cfg.layers)
        matmul = self.backends.matmul
        # The matrices the kernels read from the GGUF's own blocks are not loaded as float32 at all.
        weight_blocks = load_gguf_blocks(cfg.model) if matmul == "gguf" else None
        # Each tensor is cast and put on its device (or its shards on theirs) as the loader reads it, or restored
        # onto them from the orbax checkpoint of an earlier start: the host never holds the whole model (but for a
        # GGUF's converted weights while a new dtype or tp degree is first placed).
        self.model_config, params = load_placed(cfg.model, self.dtype, cfg.tp, self._placer, self._sharding,
                                                cfg.weights_cache, skip=packed_from_blocks(weight_blocks))
        self.backends = checked_on_device(self.backends, cfg.attention_backend, self.model_config, self.kv_dtype,
                                          cfg.page_size, self.platform.name)
        load_s = time.perf_counter() - started
        if cfg.mixed_prefill_tokens and not self.backends.length_free(self.model_config):
            # The scheduler mixes no steps whose attention is padded to their longest request: said, and config says so.
            log.info("mixed steps off: %s attention pads each step to its longest request", self.backends.attention)
            self.config = cfg = dataclasses.replace(cfg, mixed_prefill_tokens=0)
        self.tokenizer = load_tokenizer(cfg.model)
        self.stop_ids = stop_token_ids(self.tokenizer, list(self.model_config.eos_token_ids))
        self.max_context = min(cfg.context_length or self.model_config.max_position_embeddings,
                               self.model_config.max_position_embeddings)
        self.memory_plan = plan_memory(self.model_config, tp=cfg.tp, mem_fraction=cfg.mem_fraction,
                                       kv_cache_gb=cfg.kv_cache_gb, num_kv_slots=cfg.num_kv_slots,
                                       max_step_tokens=max_step_tokens(cfg.chunked_prefill_size,
                                                                       cfg.mixed_prefill_tokens,
                                                                       cfg.max_running_requests),
                                       max_batch=cfg.max_running_requests,
                                       weight_itemsize=self.dtype.itemsize, kv_dtype=self.kv_dtype)
        num_slots = self.memory_plan.num_slots
        if cfg.mem_fraction is not None or self.platform.accelerator:
            log.info("memory plan:\n%s", self.memory_plan.render())
        num_slots = pool_slots(num_slots, cfg.page_size, self.platform.name)
        self.memory_plan = dataclasses.replace(self.memory_plan, num_slots=num_slots)  # the pool as allocated
        self.allocator = SlotAllocator(num_slots, cfg.page_size)
        self.runner = ModelRunner(self.model_config, params, num_slots, params_placed=True,
                                  backends=self.backends, kv_dtype=self.kv_dtype,
                                  weight_blocks=weight_blocks,
                                  max_context=self.max_context,
                                  tp=cfg.tp, max_top_logprobs=cfg.max_top_logprobs, page_size=cfg.page_size,
                                  executable_store=cfg.uses_executable_store)
        del params
        self.platform_report = describe(self.platform, dtype=self.dtype.name, kv_dtype=self.kv_dtype.name,
                                        attention_backend=self.backends.attention,
                                        matmul_backend=self.backends.matmul, layers=self.backends.layers,
                                        page_size=cfg.page_size)
        if self.backends.attention_fallback:  # auto's kernel failed its check on this device (kernels/self_check.py)
            self.platform_report["attention_fallback"] = self.backends.attention_fallback
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
            padded_attention=not self.runner.length_free, match_fraction=cfg.cache_match_fraction,
            mixed_prefill_tokens=cfg.mixed_prefill_tokens, keys_per_token=self.runner.keys_per_token(),
            prefill_share=cfg.prefill_share, priority_scheduling=cfg.enable_priority_scheduling,
            starvation_s=cfg.starvation_s)
        self._rng = random.Random(cfg.seed)
        self.constraints = ConstraintManager(self.tokenizer, self.model_config.vocab_size, self.stop_ids,
                                             cfg.jump_forward, cfg.grammar_backend)
        self.admission = Admission(cfg, self.tokenizer, self.model_config.vocab_size, self.max_context,
                                   self.allocator.capacity)
        self.outputs = OutputProcessor(self.constraints, self.model_config.vocab_size, self.scheduler.token_limit)
        self.mailbox = Mailbox()
        overlap = OverlapScheduler(self.scheduler, self.runner, cfg,
                                   cfg.max_running_requests if self.platform.accelerator else CPU_OVERLAP_MAX_BATCH)
        speculator = make_speculator(cfg, self.prefix_cache, self.scheduler.token_limit, self.platform.name)
        self.loop = EngineLoop(cfg, self.mailbox, self.scheduler, self.runner, self.prefix_cache, self.constraints,
                               self.outputs, overlap, speculator)
        self.is_follower = cfg.node_rank > 0
        # Stopped by shutdown(), on collection or at exit (before finalization aborts a thread inside XLA).
        self._stop_threads = stop_when_unused(self, EngineThreads(self.runner, self.mailbox, self.loop,
                                                                  self.is_follower))
        self.startup_s = {"load": load_s, "precompile": self._precompile(), "total": time.perf_counter() - started}
        self._metrics_lock = threading.Lock()
        # Multi-process: rank 0 sends each step to the others, which run them in ``follow`` instead of a loop.
        self._channel = multihost.StepChannel(cfg.page_size, self.model_config.vocab_size) if cfg.nnodes > 1 else None
        if self.is_follower:
            return
        self.runner.channel = self._channel
        self.loop.start()

    def follow(self) -> None:
        """A non-zero rank's whole life: run rank 0's steps on this process's shards until rank 0 shuts down."""
        if not self.is_follower:
            raise RuntimeError("only a process of node rank > 0 follows; rank 0 serves")
        multihost.follow(self.runner, self._channel)

    def _precompile(self) -> float:
        """Compile the planned step shapes (``EngineConfig.precompile``): before the first request, or start doing
        so in the background; with ``background``, those the executable store holds load before the first request
        (~0.1 s each), the rest compile in the background. Returns the seconds spent here."""
        cfg = self.config
        mode = "common" if cfg.precompile == "background" else cfg.precompile
        plan = self.runner.planned_signatures(mode, cfg.max_running_requests, cfg.chunked_prefill_size,
                                              cfg.mixed_prefill_tokens)
        if not plan:
            return 0.0
        runner = self.runner
        background = []
        if cfg.precompile == "background":  # what is stored loads now; the rest compiles in the background
            stored = [signature for signature in plan if runner.is_stored(signature)]
            plan, background = stored, [signature for signature in plan if signature not in stored]
            if not stored:
                runner.compiler.start_background(background, then=self.constraints.backend.warm)
                return 0.0
        t0 = time.perf_counter()
        compile_plan(runner, plan)
        self.constraints.backend.warm()  # a warm start: the regex vocabulary too (a first regex request waits ~0.5 s)
        if background:
            runner.compiler.start_background(background)
        seconds = time.perf_counter() - t0
        loaded = runner.store.loaded if runner.store is not None else 0
        log.info("precompiled %d step shapes (%s, %d of them loaded from the executable store) in %.1f s", len(plan),
                 cfg.precompile, loaded, seconds)
        return seconds

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the background precompile (``precompile="background"``) to finish; False on ``timeout``."""
        return self.runner.compiler.wait(timeout)

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
        rng, cache = random.Random(self.config.seed), self.prefix_cache  # (not self: the engine stays collectable)
        return lambda waiting: order_waiting(waiting, policy, cache, time.monotonic(), starvation, rng=rng)

    # ---------------------------------------------------------------------------------- public API
    def submit(self, prompt: str | SpannedPrompt | Seq[int], sampling_params: SamplingParams | dict | None = None,
               request_id: str | None = None) -> RequestHandle:
        """Queue one request; returns at once. Raises InvalidRequestError on bad input. A `SpannedPrompt`'s plain
        spans are tokenized as plain text (special tokens' strings there split)."""
        return self._enqueue([self._make_sequence(prompt, sampling_params, request_id)])[0]

    def submit_batch(self, prompts: list, sampling_params: list, request_ids: list[str] | None = None,
                     samples: list[int] | None = None) -> list[RequestHandle]:
        """Queue several requests atomically: the scheduler sees them in the same step (one by one, the first
        would start computing alone while the rest are tokenized). ``request_ids``: the client's ids. ``samples``:
        per prompt, how many consecutive requests are its n samples (expand_parallel_samples'); n samples that
        together can never fit the KV pool are refused."""
        seqs: list[Sequence] = []
        ids = request_ids if request_ids is not None else [None] * len(prompts)
        try:
            for prompt, params, rid in zip(prompts, sampling_params, ids, strict=True):
                seqs.append(self._make_sequence(prompt, params, rid))
            self.admission.check_samples_fit([s.prompt_ids for s in seqs], [s.params for s in seqs], samples)
        except BaseException:
            release_constraints(seqs)  # all or nothing: no build keeps running for a rejected batch
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
        future = self.constraints.prepare(seq)
        if future is not None:
            future.add_done_callback(lambda _, mailbox=self.mailbox: mailbox.wake())
        return seq

    def _enqueue(self, seqs: list[Sequence]) -> list[RequestHandle]:
        if self.is_follower:
            raise RuntimeError(f"node rank {self.config.node_rank} takes no requests: rank 0 serves them")
        try:
            self.mailbox.post(seqs)
        except BaseException:
            release_constraints(seqs)
            raise
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
        params = [SamplingParams.from_any(p) for p in params]  # validated once per sample, by submit_batch
        samples = [p.n for p in params]
        if any(p.n > 1 for p in params):  # n samples of a prompt: n requests, consecutive (as SGLang)
            batch, params = expand_parallel_samples(batch, params)
            single = False
        handles = self.submit_batch(batch, params, samples=samples)
        show = progress if progress is not None else (not single and len(batch) > 1)
        try:
            if show:
                from tqdm.auto import tqdm

                outputs = [h.result() for h in tqdm(handles, desc="generate", unit="req")]
            else:
                outputs = [h.result() for h in handles]
        except BaseException:  # a Ctrl-C: its requests end (their KV freed) and the engine serves on
            for handle in handles:
                handle.abort()
            raise
        return outputs[0] if single else outputs

    def abort(self, request_id: str) -> None:
        self.mailbox.abort(request_id)

    def flush_cache(self, timeout: float = 30.0) -> bool:
        """Empty the prefix cache; refused (False) while requests are queued or running."""
        return self.mailbox.flush(timeout)

    def stats(self) -> dict[str, Any]:
        s = self.scheduler.stats
        loop = self.loop
        window_prompt = s.prompt_tokens - loop.window_start[0]
        cache = self.prefix_cache
        tree = {"cache_tokens": cache.total_size(), "evicted_tokens": cache.evicted_tokens_total,
                "tree_time_s": cache.time_s}
        return {
            **tree,
            # Both rates cover the loop's window (EngineLoop.reset_hit_rate_window). The optimum assumes an empty
            # cache at the window's start: just after a size reset, the tree's older entries can let the achieved
            # rate exceed it; after a flush it cannot.
            "cache_hit_rate": (s.cached_tokens - loop.window_start[1]) / window_prompt if window_prompt else 0.0,
            "optimal_hit_rate": loop.distinct.optimal_hit_rate,
            "forward_passes": loop.forward_passes, "overlapped_steps": loop.overlap.steps,
            "jump_forward_tokens": self.constraints.jumped_tokens, "steps": s.steps, "extend_steps": s.extend_steps,
            "decode_steps": s.decode_steps, "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens, "computed_prefill_tokens": s.computed_prefill_tokens,
            "retractions": s.retractions, "preemptions": s.preemptions, "mixed_steps": s.mixed_steps,
            "speculative": loop.speculator.stats.as_dict() if loop.speculator is not None else None,
            **self._compile_stats(),
            **self.platform_report, "amx_prefill": self.amx_prefill,
            "cpu_vector_isa": cpu_kernels.vector_isa() if self.runner.matmul_backend != "xla" else None,
            "weight_bytes": self.memory_plan.weight_bytes, "kv_bytes": self.memory_plan.kv_bytes,
            "device_bytes": self.memory_plan.device_bytes, "device_free_bytes": self.memory_plan.free_bytes,
            "startup_s": self.startup_s["total"],
            "precompile_s": self.startup_s["precompile"],
            "load_s": self.startup_s["load"],  # weights: loaded, or restored from their orbax checkpoint
            "free_slots": self.allocator.num_free(), "total_slots": self.allocator.capacity,
            "mean_batch_size": s.batched_requests / s.steps if s.steps else 0.0,
            "decode_time_s": loop.step_time["decode"], "extend_time_s": loop.step_time["extend"],
            # (lengths read from the caller's thread: a moment's view)
            "running_requests": len(self.scheduler.prefilling) + len(self.scheduler.running),
            "queued_requests": len(self.scheduler.waiting) + len(loop.pending) + self.mailbox.num_queued(),
        }

    def enable_metrics(self, model_name: str | None = None) -> EngineMetrics:
        """Turn on Prometheus metrics (``engine/metrics.py``; the server's ``/metrics``): the same object on every
        call. Latencies are observed from here on; counters read from ``stats()`` cover the engine's life."""
        with self._metrics_lock:
            if self.loop.metrics is None:
                self.loop.metrics = EngineMetrics(self.stats, model_name or self.config.model)
            return self.loop.metrics

    def _compile_stats(self) -> dict[str, Any]:
        """Step shapes compiled (distinct signatures): at start, in the background (and its seconds, None while
        it runs or where there was none), on the request path (each a stall), and of those the ones no plan held."""
        compiler = self.runner.compiler
        return {"compiles": compiler.compiles, "compiled_at_start": compiler.counts["start"],
                "compiled_in_background": compiler.counts["background"], "background_compile_s": compiler.background_s,
                "compiled_on_request_path": compiler.counts["request"], "unplanned_compiles": compiler.unplanned,
                "loaded_from_store": self.runner.store.loaded if self.runner.store is not None else 0}

    def idle(self) -> bool:
        """Nothing queued or running (read from another thread: a hint for tests and benchmarks)."""
        return not self.mailbox.queued() and self.loop.idle()

    def alive(self) -> bool:
        """Whether the engine thread runs (it stops at shutdown)."""
        return self.loop.is_alive()

    def shutdown(self) -> None:
        """Stop the engine's threads: queued and running requests end as aborted. Idempotent; also done when the
        engine is collected or the interpreter exits."""
        self._stop_threads()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
