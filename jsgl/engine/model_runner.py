"""Runs one engine step on device: pads a ragged batch to shape buckets and calls the jitted step.

Every dynamic dimension is bucketed (tokens T, requests B, new tokens per request S, attended length L)
so a steady workload stops compiling after warm-up; ``compiles`` counts distinct step signatures.
The KV pools are donated to each step and come back updated in place.

A step is two jitted calls: the forward (per signature; it also takes the greedy tokens when nothing else is
asked) and the sampler over its logits (per batch bucket alone). The sampler was most of a fused step's compile;
apart, it compiles once per batch bucket for every token count, and a plain greedy step does not call it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jsgl.engine.backends import Backends, resolve_backends
from jsgl.engine.executable_store import ExecutableStore, abstract
from jsgl.engine.kv_pool import allocate_pool
from jsgl.engine.multihost import RESET_KV, StepChannel, StepMessage
from jsgl.engine.precompiler import StepCompiler
from jsgl.engine.sampler import argmax, sample, stage_flags
from jsgl.engine.step_inputs import ForwardItem, StepLayout, new_packed, pack_step, unpack_forward, unpack_sampling
from jsgl.kernels.attention import get_attention_backend
from jsgl.model.config import ModelConfig
from jsgl.model.llama import forward_hidden, lm_logits, stack_layers, with_packed_weights
from jsgl.model.sharding import TensorParallel
from jsgl.paths import cache_dir

log = logging.getLogger("jsgl.engine.model_runner")


def bucket(n: int, minimum: int = 1, maximum: int | None = None) -> int:
    """Smallest power of two >= max(n, minimum) (capped at ``maximum`` when given and n fits)."""
    b = max(minimum, 1 << max(0, (max(n, 1) - 1).bit_length()))
    return min(b, maximum) if maximum is not None and n <= maximum else b


# An extend step of more than this many tokens is padded to 3/4 of the next power of two when it fits there (384
# for 257-384 tokens), so a large step pays for less padding; only from here up, so it adds few signatures.
THREE_QUARTER_BUCKETS_FROM = 256


def token_bucket(n: int) -> int:
    """An extend step's padded token count: a power of two from 16, or 3/4 of one above
    ``THREE_QUARTER_BUCKETS_FROM``."""
    power = bucket(n, 16)
    three_quarters = power * 3 // 4
    return three_quarters if three_quarters > THREE_QUARTER_BUCKETS_FROM and n <= three_quarters else power


@dataclasses.dataclass
class StepOutput:
    tokens: np.ndarray  # [n] sampled after each item's last new token
    logprobs: np.ndarray | None  # [n], when asked
    top_logprobs: tuple[np.ndarray, np.ndarray] | None  # ([n, K] values, [n, K] ids)
    # Per item, logprob of each target (next prompt) token and its top-k, when asked.
    prompt_logprobs: list[np.ndarray] | None = None
    prompt_top_logprobs: list[tuple[np.ndarray, np.ndarray]] | None = None


class PendingStep:
    """A dispatched step whose outputs have not been read back (JAX dispatches asynchronously)."""

    def __init__(self, out: dict[str, jax.Array], layout: StepLayout, q_lens: list[int], logprobs: bool,
                 top_logprobs: int, prompt_top_k: int):
        self.out, self.layout, self.q_lens = out, layout, q_lens
        self.logprobs, self.top_logprobs, self.prompt_top_k = logprobs, top_logprobs, prompt_top_k

    @property
    def tokens(self) -> jax.Array:
        """The sampled tokens, on device: a next step can take them as inputs before they are read."""
        return self.out["tokens"]

    def result(self) -> StepOutput:
        """Wait for the step and read back what was asked (only that crosses to the host)."""
        n, logprobs, top_logprobs, prompt_top_k = len(self.q_lens), self.logprobs, self.top_logprobs, self.prompt_top_k
        wanted = ["tokens"] + ["logprobs"] * logprobs + ["top_vals", "top_ids"] * (top_logprobs > 0) + \
            ["prompt_logprobs"] * (prompt_top_k >= 0) + ["prompt_top_vals", "prompt_top_ids"] * (prompt_top_k > 0)
        host = dict(zip(wanted, jax.device_get([self.out[k] for k in wanted])))
        result = StepOutput(host["tokens"][:n], host["logprobs"][:n] if logprobs else None,
                            (host["top_vals"][:n, :top_logprobs], host["top_ids"][:n, :top_logprobs])
                            if top_logprobs else None)
        if prompt_top_k >= 0:
            starts = np.cumsum([0, *self.q_lens])
            spans = [slice(starts[b], starts[b + 1]) for b in range(n)]
            result.prompt_logprobs = [host["prompt_logprobs"][s] for s in spans]
            if prompt_top_k > 0:
                result.prompt_top_logprobs = [(host["prompt_top_vals"][s, :prompt_top_k],
                                               host["prompt_top_ids"][s, :prompt_top_k]) for s in spans]
        return result


def step_name(signature: tuple) -> str:
    """A step signature as a file name in the executable store."""
    return "step_" + "_".join(str(n) for n in signature)


def enable_compilation_cache() -> None:
    path = os.environ.get("JSGL_JAX_CACHE", str(cache_dir() / "jax"))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ.get("JSGL_JAX_CACHE_MIN_SECS", "0.1")))


def _step(params, kv, ints, previous_tokens, *, layout: StepLayout, config: ModelConfig, attention_backend: str,
          prompt_top_k: int, tp: TensorParallel | None = None):
    """The forward: the updated pools, and {"logits" [B, V] after each request's last new token, "tokens" (their
    argmax when the inputs' ``argmax`` flag is set, else zeros: the sampler's turn), the prompt's logprobs when
    ``prompt_top_k >= 0``}."""
    inputs = unpack_forward(ints, previous_tokens, layout)
    attention = get_attention_backend(attention_backend)
    if tp is not None:  # attention per shard on local heads; XLA partitions the rest from the shardings
        attention = tp.shard_attention(attention)
    hidden, kv = forward_hidden(params, kv, inputs.token_ids, inputs.write_slots, inputs.meta, config, attention)
    if tp is not None:  # the updated pool keeps the donated pool's sharding, so it can alias it in place
        kv = tp.constrain_kv(kv)
    logits = lm_logits(params, hidden[inputs.sample_index])
    tokens = jax.lax.cond(inputs.argmax, argmax, lambda x: jnp.zeros(x.shape[0], jnp.int32), logits)
    out = {"tokens": tokens}
    if prompt_top_k >= 0:
        all_logprobs = jax.nn.log_softmax(lm_logits(params, hidden), axis=-1)
        out["prompt_logprobs"] = jnp.take_along_axis(all_logprobs, inputs.target_ids[:, None], axis=-1)[:, 0]
        if prompt_top_k > 0:
            out["prompt_top_vals"], out["prompt_top_ids"] = jax.lax.top_k(all_logprobs, prompt_top_k)
    if tp is not None:  # what the host reads, whole on every device: each process reads its own copy
        out = tp.replicate(out)
    return kv, {"logits": logits, **out}


def _sample_fn(logits, sampling, bitmask, logit_bias, repetition_scale, *, top_logprobs: int):
    inputs = unpack_sampling(sampling, bitmask, logit_bias, repetition_scale, top_logprobs)
    tokens, logprobs, top_vals, top_ids = sample(logits, inputs)
    return {"tokens": tokens, "logprobs": logprobs, "top_vals": top_vals, "top_ids": top_ids}


# The sampler over a forward's logits: one compile per (batch bucket, vocabulary, top-logprobs width), shared by
# every step shape and, within a process, every runner without tensor parallelism.
_sample_step = jax.jit(_sample_fn, static_argnames=("top_logprobs",))


class ModelRunner:
    def __init__(self, config: ModelConfig, params: Any, num_slots: int, *,
                 attention_backend: str = "auto", matmul_backend: str = "auto", weight_blocks: Any = None,
                 max_context: int | None = None, kv_sharding: Any | None = None, tp: int = 1,
                 max_top_logprobs: int = 20, kv_dtype: Any = jnp.float32, params_placed: bool = False,
                 page_size: int = 1, backends: Backends | None = None, layers: str = "auto",
                 executable_store: bool = False):
        """``params``: host arrays, placed here (sharded under ``tp``), or with ``params_placed`` already on their
        devices and shards (the engine's loader puts them there tensor by tensor)."""
        self.config = config
        self.kv_dtype = jnp.dtype(kv_dtype)
        self.max_top_logprobs = max_top_logprobs  # the static width of the top-logprobs output
        # Resolved by the engine (it loads the weights by them), or here for a runner built directly.
        self.backends = backends or resolve_backends(attention_backend, matmul_backend, tp=tp, kv_dtype=kv_dtype,
                                                     page_size=page_size, layers=layers)
        if self.attention_backend == "cpu" and config.layer_windows:  # not silent: the kernels mask no window
            log.info("attention: the CPU kernels have no sliding window; layers %s (window %d) attend through "
                     "the native path", [i for i, w in enumerate(config.layer_windows) if w],
                     max(config.layer_windows))
        self.max_context = max_context or config.max_position_embeddings
        self.num_slots = num_slots
        # The pool's pages (the allocator's): block tables hold one entry per page, page p being slots
        # [p * page_size, (p + 1) * page_size); the Pallas kernels read them so, the other paths expand them.
        self.page_size = page_size
        # tp > 1: params (numpy or device arrays) are padded to whole GQA groups per shard and placed
        # with NamedShardings; the forward runs with the padded config (see jsgl.model.sharding).
        self.tp = TensorParallel.create(config, tp) if tp > 1 else None
        self.forward_config = self.tp.config if self.tp else config
        if self.tp:
            params = params if params_placed else self.tp.shard_params(params)
            kv_sharding = self.tp.kv_sharding
        # "packed"/"gguf": the CPU kernels' weights; weight_blocks (load_gguf_blocks) serve "gguf" only.
        if self.matmul_backend != "xla":
            params = with_packed_weights(params, weight_blocks if self.matmul_backend == "gguf" else None)
        if self.backends.scanned:  # before the pool: stacking holds one weight's layers twice for a moment
            params = stack_layers(params, self.tp.stack_leaf if self.tp else None)
        self.params = params
        self.kv = allocate_pool(self.forward_config, num_slots, kv_sharding, self.kv_dtype, self.backends.scanned)
        self.ragged, self.length_free = self.backends.ragged(config), self.backends.length_free(config)
        self.builds_scores = self.backends.builds_scores(config)
        self.table_width = bucket(min(self.max_context, num_slots), 64)
        # The pool as a step's compile sees it (shape and placement), so compiling needs no live pool.
        self._kv_spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.kv)
        self.compiler = StepCompiler(self)
        # Compiled steps kept on disk, under a fingerprint of everything a step is compiled against.
        self.store = ExecutableStore(repr(self.forward_config), repr(self.backends), str(self.kv_dtype),
                                     self.page_size, num_slots, self.table_width, max_top_logprobs,
                                     abstract(self.params), abstract(self._kv_spec)) if executable_store else None
        self._defaults: dict[tuple[str, int], jax.Array] = {}  # neutral mask/bias/scale per batch bucket
        self._stored_samplers: dict[int, Any] = {}  # the sampler per batch bucket, through the executable store
        self._last_tokens: jax.Array | None = None  # the last step's tokens: an overlapped step's inputs
        self.channel: StepChannel | None = None  # rank 0 of a multi-process engine: where each step is sent
        # Under tp, the sampler's outputs whole on every device (each process reads its own copy).
        self._sample = _sample_step if self.tp is None else \
            jax.jit(_sample_fn, static_argnames=("top_logprobs",), out_shardings=self.tp.replicated)
        self._step = jax.jit(
            functools.partial(_step, config=self.forward_config, attention_backend=self.attention_backend,
                              tp=self.tp),
            static_argnames=("layout", "prompt_top_k"), donate_argnums=(1,),
        )

    @property
    def attention_backend(self) -> str:
        return self.backends.attention

    @property
    def matmul_backend(self) -> str:
        return self.backends.matmul

    def kv_intact(self) -> bool:
        """False when a failed step consumed the donated pools (an error while the step executed, not
        while it was traced): the engine must then reallocate them and drop what the cache held."""
        return not any(leaf.is_deleted() for leaf in jax.tree.leaves(self.kv))

    def reset_kv(self) -> None:
        if self.channel is not None:  # the other processes' pools were donated to the same failed call
            self.channel.send_control(RESET_KV)
        sharding = self.tp.kv_sharding if self.tp else None
        self.kv = allocate_pool(self.forward_config, self.num_slots, sharding, self.kv_dtype, self.backends.scanned)

    # ------------------------------------------------------------------------------ batch building
    def attention_bytes(self, num_items: int, max_new: int, max_len: int) -> int:
        """Size of the padded attention scores of an extend batch (the scheduler bounds it); 0 where no score
        array is built (the kernels; the CPU kernel's fallback to the native path does build one)."""
        if not self.builds_scores:
            return 0
        return (self.config.num_heads * bucket(num_items) * bucket(max_new, 16)
                * bucket(max_len, 64) * 4)

    def keys_per_token(self) -> float:
        """Attended keys that cost as much as one new token's matmuls (the scheduler's cost of a long context): the
        matmuls' flops per token over attention's per key, the CPU attention kernel running at about a third of
        the matmul kernels' rate (docs/performance.md)."""
        c = self.config
        per_layer = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim \
            + c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
        per_key = 4 * c.num_heads * c.head_dim  # q.k and p.v, per layer
        return 2 * per_layer / per_key / (3.0 if self.attention_backend == "cpu" else 1.0)

    def step_shape(self, num_items: int, total_new: int, max_new: int, max_len: int,
                   is_decode: bool) -> tuple[int, int, int, int]:
        """The padded (tokens T, requests B, new tokens per request S, attended length L) of a batch.

        Decode: B = T over power-of-two request counts. Extend: T over powers of two from 16; B from 8
        (its rows cost one lm_head product each, which is little; it halves the extend signatures). Length-free
        attention: S = T and L fixed, so (T, B) is the signature."""
        num_b = bucket(num_items) if is_decode else bucket(num_items, 8)
        num_t = num_b if is_decode else token_bucket(total_new)
        if self.length_free and max_len <= self.table_width:
            return num_t, num_b, 1 if is_decode else num_t, self.table_width
        return num_t, num_b, 1 if is_decode else bucket(max_new, 16), bucket(max_len, 64)

    def run(self, items: list[ForwardItem], *, logprobs: bool = True, top_logprobs: int = 0,
            prompt_top_k: int = -1) -> StepOutput:
        """One forward + sample over ``items``: the sampled tokens, with their logprobs if ``logprobs``, the
        top ``top_logprobs`` alternatives, and for ``prompt_top_k >= 0`` the prompt's logprobs too."""
        return self.dispatch(items, logprobs=logprobs, top_logprobs=top_logprobs, prompt_top_k=prompt_top_k).result()

    def dispatch(self, items: list[ForwardItem], *, logprobs: bool = True, top_logprobs: int = 0,
                 prompt_top_k: int = -1, after: PendingStep | None = None) -> PendingStep:
        """Start ``run``'s step without waiting for it. With ``after`` (a decode step of the same requests in
        the same rows, not yet read back), each item's token is the one ``after`` samples in its row: the
        step is queued behind it on the device while the host reads and absorbs ``after``."""
        n = len(items)
        if top_logprobs > self.max_top_logprobs or prompt_top_k > self.max_top_logprobs:
            raise ValueError(f"top logprobs {max(top_logprobs, prompt_top_k)} > the runner's max_top_logprobs "
                             f"{self.max_top_logprobs}")
        is_decode = all(len(it.token_ids) == 1 for it in items) and prompt_top_k < 0
        q_lens = [len(it.token_ids) for it in items]
        kv_lens = [it.start_pos + q for it, q in zip(items, q_lens)]
        layout = StepLayout(*self.step_shape(n, sum(q_lens), max(q_lens), max(kv_lens), is_decode), self.page_size)
        if after is not None and (not is_decode or after.layout != layout):
            raise ValueError("a step dispatched after another must be a decode step of the same layout")
        step = pack_step(items, layout, self.config.vocab_size, self._neutral, logprobs=logprobs,
                         top_logprobs=top_logprobs, after_previous=after is not None)
        # Prompt logprobs: one variant, the widest top-k (sliced per request on the way out).
        message = StepMessage(step, -1 if prompt_top_k < 0 else self.max_top_logprobs, after is not None)
        if self.channel is not None:  # multi-process: every other process runs the same step (engine/multihost.py)
            if after is not None and after.tokens is not self._last_tokens:
                raise ValueError("across processes, a step can follow only the step dispatched just before it")
            self.channel.send(message)
        out = self.execute(message, after.tokens if after is not None else None)
        return PendingStep(out, layout, step.q_lens, logprobs, top_logprobs, prompt_top_k)

    def execute(self, message: StepMessage, previous: jax.Array | None = None) -> dict[str, jax.Array]:
        """Run a packed step on this process's devices (rank 0 once it has sent it, the other ranks as they receive
        it): the forward, then the sampler unless the forward's argmax is the step's tokens. ``previous``: the
        tokens a step that follows another takes as inputs (a follower: the last step's, its own copy)."""
        step, layout = message.step, message.step.layout
        if previous is None:
            previous = self._last_tokens if message.after else self._neutral("previous_tokens", layout.num_b)
        signature = (*layout[:4], message.prompt_k)
        compiled = self.compiler.executable(signature)
        if compiled is None:
            self.compiler.count_jit(signature)
        args = (self.params, self.kv, step.packed.ints, previous)
        self.kv, out = compiled(*args) if compiled is not None else \
            self._step(*args, layout=layout, prompt_top_k=message.prompt_k)
        if not step.plain_greedy:  # queued behind the forward on the device; its tokens replace the forward's zeros
            stored = self._stored_samplers.get(layout.num_b)
            args = (out["logits"], step.packed.sampling, *step.vocab_rows)
            out = {**out, **(stored(*args) if stored is not None else
                             self._sample(*args, top_logprobs=self.max_top_logprobs))}
        self._last_tokens = out["tokens"]
        return out

    def planned_signatures(self, mode: str, max_running: int, chunk_size: int,
                           mixed_prefill_tokens: int = 0) -> list[tuple]:
        """The step signatures a configuration produces, for ``precompile(mode)`` (jsgl.engine.precompiler).

        ``common`` (and ``background``, the same set): every decode batch bucket up to ``max_running``, and every
        extend (tokens up to the chunk size, or a mixed step's prefill beside every running request's decode;
        requests up to ``max_running``): all that plain generation, constrained or sampled, can meet. ``all``: also
        the extends that return prompt logprobs (``select``, ``logprob_start_len``). With padded attention (native;
        the CPU kernel under tensor parallelism) the attended length multiplies the set, so only decode at each
        length bucket is planned; extends compile on first use. Jump-forward extends of more tokens than a chunk
        (many running requests jumping at once) are not planned either."""
        if mode == "off":
            return []
        batch_buckets = [1 << i for i in range(bucket(max_running).bit_length())]
        max_tokens = max(bucket(chunk_size, 16), mixed_prefill_tokens + max_running if mixed_prefill_tokens else 0)
        token_buckets = sorted({token_bucket(n) for n in range(1, max_tokens + 1)})
        lengths = [self.table_width] if self.length_free else \
            [64 << i for i in range(max(self.table_width // 64, 1).bit_length())]
        plan = [(b, b, 1, length, -1) for b in batch_buckets for length in lengths]
        if not self.length_free:
            return plan
        extends = sorted({self.step_shape(b, t, t, self.table_width, False)
                          for t in token_buckets for b in batch_buckets if b <= t})
        prompt_ks = [-1, self.max_top_logprobs] if mode == "all" else [-1]
        return plan + [(*shape, k) for k in prompt_ks for shape in extends]

    def compile_step(self, signature: tuple) -> Any:
        """Compile the step for ``signature`` ahead of use (any thread: the pool enters as its shape and placement,
        so a step running meanwhile may donate it). The executable store, or else XLA's persistent cache, makes a
        restart's compiles loads."""
        name = step_name(signature)
        if self.store is not None and (compiled := self.store.load(name)) is not None:
            return compiled
        layout = StepLayout(*signature[:4], self.page_size)
        args = (self.params, self._kv_spec, jax.ShapeDtypeStruct((layout.num_ints,), jnp.int32),
                jax.ShapeDtypeStruct((layout.num_b,), jnp.int32))
        lowered = self._step.lower(*args, layout=layout, prompt_top_k=signature[4])
        return self.store.compile(lowered, name) if self.store is not None else lowered.compile()

    def is_stored(self, signature: tuple) -> bool:
        """Whether the executable store holds the step for ``signature``."""
        return self.store is not None and self.store.holds(step_name(signature))

    def run_padding(self, signature: tuple, compiled: Any) -> None:
        """Execute a compiled step on padding (every write goes to reserved slot 0; engine thread only, as it
        donates the pool): an executable's first run pays one-time costs. Twice: taking the argmax, then not (the
        sampler's turn), the second taking the first's tokens as its previous tokens, as an overlapped decode step
        does (its first dispatch is slow too)."""
        layout = StepLayout(*signature[:4], self.page_size)
        previous = self._neutral("previous_tokens", layout.num_b)
        for greedy in (True, False):
            packed = new_packed(layout, self.config.vocab_size)
            packed.views(layout)["argmax"][:] = greedy
            self.kv, out = compiled(self.params, self.kv, packed.ints, previous)
            jax.block_until_ready(out)
            previous = out["tokens"]

    def run_sampler(self, num_b: int, like: jax.ShapeDtypeStruct) -> None:
        """Compile and run the sampler at batch bucket ``num_b`` on neutral rows and zero logits placed as a step
        places them, sampling with token logprobs (its branches are conditionals inside one program: any run
        compiles them all). Any thread."""
        layout = StepLayout(num_b, num_b, 1, 1, 1)
        packed = new_packed(layout, self.config.vocab_size)
        views = packed.views(layout)
        views["temperature"][:] = 1.0
        views["flags"][:] = stage_flags(all_greedy=False, token_logprobs=True, apply_mask=False, apply_bias=False,
                                        apply_repetition=False, want_top=False)
        arrays = [self._neutral(kind, num_b) for kind in ("bitmask", "logit_bias", "repetition_scale")]
        logits = jax.device_put(np.zeros((num_b, like.shape[1]), like.dtype), like.sharding)
        args = (logits, packed.sampling, *arrays)
        if self.store is not None:  # loaded or compiled through the store, then what execute() calls at this bucket
            name = f"sampler_{num_b}_{like.dtype}"
            sampler = self.store.load(name)
            if sampler is None:
                # The logits placed as a step places them; the rest as jit takes them (host or uncommitted arrays).
                specs = [jax.ShapeDtypeStruct(logits.shape, like.dtype, sharding=like.sharding),
                         *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args[1:])]
                sampler = self.store.compile(self._sample.lower(*specs, top_logprobs=self.max_top_logprobs), name)
            self._stored_samplers[num_b] = sampler
            jax.block_until_ready(sampler(*args))
            return
        jax.block_until_ready(self._sample(*args, top_logprobs=self.max_top_logprobs))

    def _neutral(self, kind: str, num_b: int) -> jax.Array:
        """A device array that leaves the logits unchanged (kept, so a step without masks, biases or
        penalties uploads none); its stage is also switched off by a flag."""
        key = (kind, num_b)
        if key not in self._defaults:
            vocab = self.config.vocab_size
            self._defaults[key] = jnp.asarray({
                "bitmask": lambda: np.full((num_b, -(-vocab // 32)), 0xFFFFFFFF, np.uint32),
                "logit_bias": lambda: np.zeros((num_b, vocab), np.float32),
                "repetition_scale": lambda: np.ones((num_b, vocab), np.float32),
                "previous_tokens": lambda: np.zeros(num_b, np.int32)}[kind]())
        return self._defaults[key]
