"""Tensor parallelism on forced CPU devices: tp = 1..4 agree, params and pool are sharded, the engine serves.

The device count of the CPU backend is fixed when jax initialises, and other test files import jax first
in the same pytest session, so the checks run in a child process (this file run as a script) started
with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``; it writes its measurements as JSON and the
tests below assert on them. One child loads the model once and builds one runner at a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

NUM_DEVICES = 4
TPS = (1, 2, 3, 4)
PROMPTS = ["The capital of France is", "def add(a, b):"]
NEW_TOKENS = 6


# ------------------------------------------------------------------------------------------ child
def _shapes(array: Any) -> list[list[int]]:
    return [list(s.data.shape) for s in array.addressable_shards]


def _full_logits(runner: Any, ids: list[int]) -> Any:
    """Logits of every prompt position, through the runner's (sharded) params, pool and attention."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jsgl.kernels.attention import AttentionMetadata, get_attention_backend
    from jsgl.model.llama import forward_hidden, lm_logits

    n = len(ids)
    slots = np.arange(1, n + 1, dtype=np.int32)
    meta = AttentionMetadata(np.arange(n, dtype=np.int32), np.zeros(1, np.int32), np.full(1, n, np.int32),
                             slots[None], np.full(1, n, np.int32), n)
    attention = get_attention_backend("native")
    if runner.tp is not None:
        attention = runner.tp.shard_attention(attention)

    @jax.jit
    def logits(params, kv, token_ids, write_slots, meta):
        hidden, _ = forward_hidden(params, kv, token_ids, write_slots, meta, runner.forward_config, attention)
        return lm_logits(params, hidden)

    return np.asarray(logits(runner.params, runner.kv, jnp.asarray(ids, jnp.int32), slots, meta))


def _greedy(runner: Any, prompts: list[list[int]]) -> list[list[int]]:
    """Batched greedy decode: one extend step over all prompts, then NEW_TOKENS - 1 decode steps."""
    import numpy as np

    from jsgl.engine.step_inputs import ForwardItem

    span = max(map(len, prompts)) + NEW_TOKENS
    slots = [np.arange(1 + i * span, 1 + (i + 1) * span, dtype=np.int32) for i in range(len(prompts))]
    out = runner.run([ForwardItem(np.asarray(p, np.int32), 0, s) for p, s in zip(prompts, slots)])
    tokens = [[int(t)] for t in out.tokens]
    for step in range(NEW_TOKENS - 1):
        items = [ForwardItem(np.asarray(t[-1:], np.int32), len(p) + step, s)
                 for p, t, s in zip(prompts, tokens, slots)]
        for t, new in zip(tokens, runner.run(items).tokens):
            t.append(int(new))
    return tokens


def _pallas_per_shard() -> float:
    """Max |sharded Pallas (interpret) - native| on random data, tp=4 over 12 q / 4 kv heads, decode+extend."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jsgl.kernels.attention import AttentionMetadata, get_attention_backend, native_paged_attention
    from jsgl.model.config import ModelConfig
    from jsgl.model.sharding import TensorParallel

    tp = TensorParallel.create(ModelConfig("llama", 128, 64, 128, 1, 12, 4, 16), 4)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((8, 12, 16), np.float32)
    k, v = (rng.standard_normal((4, 64, 16), np.float32) for _ in range(2))
    put = lambda x, spec: jax.device_put(x, NamedSharding(tp.mesh, spec))  # noqa: E731
    sharded = jax.jit(lambda q, k, v, m: tp.shard_attention(get_attention_backend("pallas"))(q, k, v, m, 0.25))
    worst = 0.0
    for max_q in (1, 4):
        b = 8 // max_q
        meta = AttentionMetadata(np.tile(np.arange(max_q, dtype=np.int32) + 10, b),
                                 np.arange(b, dtype=np.int32) * max_q, np.full(b, max_q, np.int32),
                                 rng.integers(1, 64, (b, 16)).astype(np.int32), np.full(b, 10 + max_q, np.int32),
                                 max_q)
        out = sharded(put(q, P(None, "tp")), put(k, P("tp")), put(v, P("tp")), meta)
        worst = max(worst, float(np.abs(np.asarray(out) - native_paged_attention(q, k, v, meta, 0.25)).max()))
    return worst


def child_main(out_path: str) -> None:
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jsgl.engine.engine import Engine
    from jsgl.engine.model_runner import ModelRunner
    from jsgl.model.loader import load_model
    from jsgl.model.tokenizer import load_tokenizer

    result: dict[str, Any] = {"devices": len(jax.local_devices())}
    config, np_params = load_model("smollm2-135m")
    tokenizer = load_tokenizer("smollm2-135m")
    prompts = [tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS]
    result["prompts"] = prompts
    ref_logits = None
    for tp in TPS:
        start = time.perf_counter()
        params = jax.tree.map(jnp.asarray, np_params) if tp == 1 else np_params
        # tp=1 is the reference on XLA's own path (the CPU kernels do not shard), so all compare like for like.
        runner = ModelRunner(config, params, 64, attention_backend="native", matmul_backend="xla", tp=tp)
        logits = _full_logits(runner, prompts[0])
        if ref_logits is None:
            ref_logits = logits
        layers = runner.params["layers"][-1]
        result[f"tp{tp}"] = {
            "max_abs_diff": float(np.abs(logits - ref_logits).max()),
            "logit_range": float(ref_logits.max() - ref_logits.min()),
            "argmax_equal": bool((logits.argmax(-1) == ref_logits.argmax(-1)).all()),
            "greedy": _greedy(runner, prompts),
            "heads": [runner.forward_config.num_heads, runner.forward_config.num_kv_heads],
            "shards": {name: _shapes(a) for name, a in [
                ("embed", runner.params["embed"]), ("wq", layers["wq"]), ("wk", layers["wk"]),
                ("wo", layers["wo"]), ("w_up", layers["w_up"]), ("w_down", layers["w_down"]),
                ("attn_norm", layers["attn_norm"]), ("k_pool", runner.kv[0][-1]), ("v_pool", runner.kv[1][-1])]},
            "num_layers": [len(runner.params["layers"]), len(runner.kv[0]), len(runner.kv[1])],
            "kv_spec": list(runner.kv[0][-1].sharding.spec) if runner.tp else None,
            "seconds": time.perf_counter() - start,
        }
        del runner, params

    # Scanned layers (the TPU default) at tp=2: weights stacked over layers and the pool one stack per K/V,
    # each split over its heads' axis as the per-layer ones are.
    runner = ModelRunner(config, np_params, 64, attention_backend="native", matmul_backend="xla", tp=2,
                         layers="scanned")
    logits = _full_logits(runner, prompts[0])
    result["scanned tp2"] = {"max_abs_diff": float(np.abs(logits - ref_logits).max()),
                             "greedy": _greedy(runner, prompts),
                             "shards": {"wq": _shapes(runner.params["layers"]["wq"]), "k": _shapes(runner.kv[0])}}
    del runner

    start = time.perf_counter()
    engine = Engine(model="smollm2-135m", tp=2, num_kv_slots=512, max_running_requests=8,
                    chunked_prefill_size=64)
    try:
        outs = engine.generate(prompts, {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True},
                               progress=False)
        result["engine"] = {"token_ids": [o.token_ids for o in outs], "texts": [o.text for o in outs],
                            "k_pool": _shapes(engine.runner.kv[0][0]), "seconds": time.perf_counter() - start,
                            "overlapped_steps": engine.stats()["overlapped_steps"]}
    finally:
        engine.shutdown()
    try:
        Engine(model="smollm2-135m", tp=NUM_DEVICES * 2, num_kv_slots=64)
        result["too_many_error"] = None
    except ValueError as exc:
        result["too_many_error"] = str(exc)
    result["pallas_max_diff"] = _pallas_per_shard()
    Path(out_path).write_text(json.dumps(result))


def sharded_load_main(checkpoint: str, out_path: str, mode: str) -> None:
    """Load a bfloat16 HF checkpoint at tp=4 onto the forced devices, tensor by tensor (``mode`` "load", then
    through ``load_placed``, which saves the params as placed in an orbax checkpoint) or from that checkpoint
    ("restore"); report the host's
    peak memory over what the placed shards themselves take (on CPU devices, device buffers are host memory)."""
    import jax
    import ml_dtypes
    import numpy as np

    from jsgl.model import checkpoint as orbax_checkpoint
    from jsgl.model.loader import load_model, load_placed, placed_checkpoint_path, read_safetensors
    from jsgl.model.sharding import TensorParallel

    def status(field: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
        return int(line.split()[1]) * 1024

    # VmHWM, not getrusage's ru_maxrss: a child started by a big process inherits the parent's ru_maxrss.

    jax.device_put(1.0)  # the backend up before the baseline
    import orbax.checkpoint  # noqa: F401  (its import, ~100 MB of modules, is not the load's memory)

    largest = max(t.nbytes for f in Path(checkpoint).glob("*.safetensors") for t in read_safetensors(f).values())
    start = status("VmRSS")
    parallel: list[TensorParallel] = []

    def placer(config):
        parallel.append(TensorParallel.create(config, NUM_DEVICES))
        return parallel[0].place

    def sharding(config):
        placer(config)
        return parallel[0].sharding

    saved = placed_checkpoint_path(checkpoint, ml_dtypes.bfloat16, NUM_DEVICES)
    if mode == "load":
        config, params = load_model(checkpoint, ml_dtypes.bfloat16, placer)
    else:
        assert orbax_checkpoint.exists(saved)
        config, params = load_placed(checkpoint, ml_dtypes.bfloat16, NUM_DEVICES, placer, sharding, "orbax")
    peak = status("VmHWM")
    leaves = jax.tree.leaves(params)
    flat = {"embed": params["embed"], "final_norm": params["final_norm"], "lm_head": params["lm_head"],
            **{f"layers.{i}.{k}": v for i, layer in enumerate(params["layers"]) for k, v in layer.items()}}
    result = {
        "peak_over_start": peak - start, "largest": largest, "files": len(list(Path(checkpoint).glob("*.safetensors"))),
        "placed": sum(s.data.nbytes for x in leaves for s in x.addressable_shards),
        "dtypes": sorted({str(x.dtype) for x in leaves}),
        "specs_match": all(x.sharding == parallel[0].sharding(n.rsplit(".", 1)[-1], x.shape) for n, x in flat.items()),
        "wq_shards": _shapes(params["layers"][0]["wq"]), "embed_shards": _shapes(params["embed"]),
        "num_layers": config.num_layers,
        "sums": {n: float(np.asarray(x, np.float64).sum()) for n, x in flat.items()}}
    if mode == "load":  # once measured: load again through the engine's path, which saves the checkpoint
        del params, leaves, flat
        load_placed(checkpoint, ml_dtypes.bfloat16, NUM_DEVICES, placer, sharding, "orbax")
        assert orbax_checkpoint.exists(saved)
    Path(out_path).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------ tests
if __name__ != "__main__":
    import pytest

    from jsgl.model.sharding import head_layout

    @pytest.fixture(scope="module")
    def tp_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
        out = tmp_path_factory.mktemp("tp") / "result.json"
        env = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false",
                   XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                             f"--xla_force_host_platform_device_count={NUM_DEVICES}".strip())
        proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(out.read_text())

    def test_head_layout_smollm2() -> None:
        """9 q / 3 kv heads: tp=2 pads a zero KV head (+ its 3 q heads), tp=4 replicates KV head 0."""
        two = head_layout(9, 3, 2)
        assert two.kv_heads == (0, 1, 2, -1) and two.q_heads == (*range(9), -1, -1, -1)
        four = head_layout(9, 3, 4)
        assert four.kv_heads == (0, 0, 1, 2)
        assert four.q_heads == (0, 1, -1, 2, -1, -1, 3, 4, 5, 6, 7, 8)
        assert head_layout(9, 3, 3).is_identity and head_layout(9, 3, 1).is_identity
        assert head_layout(32, 8, 16).q_heads == tuple(range(32))  # tp multiple of kv heads: no padding

    @pytest.mark.parametrize("tp", [1, 2, 3, 4, 5, 6, 8, 12])
    def test_head_layout_covers_every_head_with_its_kv_head(tp: int) -> None:
        lay = head_layout(9, 3, tp)
        group = lay.num_heads // lay.num_kv_heads
        assert lay.num_heads % tp == 0 and lay.num_kv_heads % tp == 0
        assert sorted(h for h in lay.q_heads if h >= 0) == list(range(9))
        for i, h in enumerate(lay.q_heads):
            if h >= 0:  # padded q head i reads padded kv head i // group, which must be h's kv head
                assert lay.kv_heads[i // group] == h // 3

    def test_child_saw_forced_devices(tp_run: dict[str, Any]) -> None:
        assert tp_run["devices"] == NUM_DEVICES

    @pytest.mark.parametrize("tp", TPS[1:])
    def test_logits_match_tp1(tp_run: dict[str, Any], tp: int) -> None:
        r = tp_run[f"tp{tp}"]
        assert r["max_abs_diff"] < 1e-5 * r["logit_range"], r["max_abs_diff"]
        assert r["argmax_equal"]

    @pytest.mark.parametrize("tp", TPS[1:])
    def test_greedy_matches_tp1(tp_run: dict[str, Any], tp: int) -> None:
        assert tp_run[f"tp{tp}"]["greedy"] == tp_run["tp1"]["greedy"]

    @pytest.mark.parametrize("tp,heads", [(1, [9, 3]), (2, [12, 4]), (3, [9, 3]), (4, [12, 4])])
    def test_params_and_pool_sharded(tp_run: dict[str, Any], tp: int, heads: list[int]) -> None:
        r = tp_run[f"tp{tp}"]
        assert r["heads"] == heads
        s, hq, hkv = r["shards"], heads[0] // tp, heads[1] // tp
        assert r["num_layers"] == [30, 30, 30]  # per-layer weights and pools
        assert s["wq"] == [[576, hq * 64]] * tp  # column-parallel: whole q heads per shard
        assert s["wk"] == [[576, hkv * 64]] * tp
        assert s["wo"] == [[hq * 64, 576]] * tp  # row-parallel
        assert s["w_up"] == [[576, 1536 // tp]] * tp
        assert s["w_down"] == [[1536 // tp, 576]] * tp
        assert s["embed"] == [[49152 // tp, 576]] * tp  # vocab-parallel, tied lm head
        assert s["attn_norm"] == [[576]] * tp  # replicated
        assert s["k_pool"] == s["v_pool"] == [[hkv, 64, 64]] * tp
        if tp > 1:
            assert r["kv_spec"] == ["tp"]  # NamedSharding over the KV-head axis

    def test_scanned_layers_shard_and_match_tp1(tp_run: dict[str, Any]) -> None:
        r = tp_run["scanned tp2"]
        assert r["max_abs_diff"] < 1e-5 * tp_run["tp1"]["logit_range"], r["max_abs_diff"]
        assert r["greedy"] == tp_run["tp1"]["greedy"]
        assert r["shards"] == {"wq": [[30, 576, 6 * 64]] * 2, "k": [[2, 30, 64, 64]] * 2}

    def test_engine_tp2_serves_batch(tp_run: dict[str, Any]) -> None:
        eng = tp_run["engine"]
        assert eng["token_ids"] == tp_run["tp1"]["greedy"]  # the engine at tp=2 == the runner at tp=1
        assert all(text for text in eng["texts"])
        assert eng["k_pool"] == [[2, 512, 64]] * 2
        assert eng["overlapped_steps"] > 0  # decode steps dispatched behind sharded ones, tokens taken on device

    def test_too_many_devices_is_a_clear_error(tp_run: dict[str, Any]) -> None:
        assert "tp=8 needs 8 local devices but only 4" in tp_run["too_many_error"]

    def test_pallas_attention_runs_per_shard(tp_run: dict[str, Any]) -> None:
        assert tp_run["pallas_max_diff"] < 1e-5

    def test_sharded_checkpoint_loads_tensor_by_tensor_onto_its_shards(tmp_path: Path) -> None:
        """A 4-file bfloat16 checkpoint (~200 MB) at tp=4: every param lands as its NamedSharding's shards, in
        bfloat16, and the host's peak memory beyond the placed shards stays under twice the largest tensor plus
        64 MB (loading the whole model first, as before, needed ~200 MB more). The same for a restart from the
        orbax checkpoint of the placed params, which restores the same values onto the same shards."""
        import torch
        import transformers as tf

        torch.manual_seed(0)
        config = tf.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=2048, num_hidden_layers=24,
                                num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
        tf.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="60MB")
        env = dict(os.environ, JAX_PLATFORMS="cpu", JSGL_CACHE_DIR=str(tmp_path / "cache"),
                   XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                             f"--xla_force_host_platform_device_count={NUM_DEVICES}".strip())
        results = {}
        for mode in ("load", "restore"):  # tensor by tensor (then saved with orbax); restored from orbax
            out = tmp_path / f"{mode}.json"
            proc = subprocess.run([sys.executable, __file__, "--sharded-load", str(tmp_path), str(out), mode],
                                  env=env, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-4000:]
            results[mode] = r = json.loads(out.read_text())
            assert r["files"] >= 4 and r["num_layers"] == 24 and r["dtypes"] == ["bfloat16"]
            assert r["specs_match"], mode
            assert r["wq_shards"] == [[512, 128]] * 4 and r["embed_shards"] == [[2048, 512]] * 4
            assert r["peak_over_start"] - r["placed"] < 2 * r["largest"] + (64 << 20), (mode, r["peak_over_start"])
        assert results["restore"]["sums"] == results["load"]["sums"]  # the same values on the same shards


if __name__ == "__main__":
    # Before jax initialises (it is only imported inside child_main): force the CPU device count.
    if f"device_count={NUM_DEVICES}" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                                   f"--xla_force_host_platform_device_count={NUM_DEVICES}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if sys.argv[1] == "--sharded-load":
        sharded_load_main(*sys.argv[2:5])
    else:
        child_main(sys.argv[1])
