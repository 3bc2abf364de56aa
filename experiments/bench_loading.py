"""Loading an HF bfloat16 checkpoint onto the device, against a plain safetensors read of the same files.

    jsgl bench loading                     # a Llama-3-8B-shaped checkpoint cut to --layers layers, random bf16
    jsgl bench loading --layers 4 --rounds 3

A checkpoint with Llama-3-8B's tensor shapes (``--layers`` of its 32 layers, the full embedding and head;
random bfloat16 values) is written to a temporary folder as safetensors shards, as transformers saves one. Then,
alternating, ``--rounds`` times each:

* **plain read**: ``safetensors.safe_open(..., "flax")`` reads every tensor onto the default device as stored;
* **jsgl**: ``load_model`` with the engine's placer (each matrix read, put on the device as stored, transposed
  there to the forward's [in, out]: ``jsgl.model.placement.to_device``);
* **host transpose**: the same, but each matrix made contiguous on the host first (what jsgl did before).

With ``--tp N`` jsgl's two runs place each tensor's slices on N devices, as the engine does under tensor parallelism.

GB/s is the checkpoint's bytes over the median wall time. The files stay in the page cache after the first
round, so this measures the read path (memory copies, transposes), not the disk; say so where it is quoted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from jsgl.model.config import LLAMA3_8B
from jsgl.model.loader import load_model
from jsgl.model.placement import to_device
from jsgl.model.sharding import TensorParallel

HF_NAMES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_checkpoint(folder: Path, layers: int, vocab: int | None = None, seed: int = 0) -> int:
    """A Llama-3-8B-shaped bf16 checkpoint of ``layers`` layers, one shard per layer (+ embedding and head): its
    bytes."""
    import json

    from safetensors.numpy import save_file

    hidden, inter = LLAMA3_8B["hidden_size"], LLAMA3_8B["intermediate_size"]
    heads, kv_heads = LLAMA3_8B["num_attention_heads"], LLAMA3_8B["num_key_value_heads"]
    vocab = vocab or LLAMA3_8B["vocab_size"]
    hd = hidden // heads
    shapes = {"q_proj": (heads * hd, hidden), "k_proj": (kv_heads * hd, hidden), "v_proj": (kv_heads * hd, hidden),
              "o_proj": (hidden, heads * hd), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    rng = np.random.default_rng(seed)
    # Random bits of bf16 values in +-[2^-8, 2^-7) (sign and mantissa random, one exponent): made as fast as the
    # memory is written, where drawing floats took minutes for the 2 GB of embedding and head on 2 cores.
    as_bf16 = lambda shape: ((rng.integers(0, 1 << 16, shape, dtype=np.uint16) & 0x807F)  # noqa: E731
                             | 0x3BC0).view(ml_dtypes.bfloat16)
    total = 0
    shards = [{"model.embed_tokens.weight": as_bf16((vocab, hidden)), "model.norm.weight": as_bf16((hidden,)),
               "lm_head.weight": as_bf16((vocab, hidden))}]
    for i in range(layers):
        shard = {f"model.layers.{i}.{group}.{name}.weight": as_bf16(shape)
                 for name, shape in shapes.items() for group in [HF_NAMES[name]]}
        shard[f"model.layers.{i}.input_layernorm.weight"] = as_bf16((hidden,))
        shard[f"model.layers.{i}.post_attention_layernorm.weight"] = as_bf16((hidden,))
        shards.append(shard)
    for n, shard in enumerate(shards):
        total += sum(x.nbytes for x in shard.values())
        _save_bf16(save_file, shard, folder / f"model-{n:05d}-of-{len(shards):05d}.safetensors")
    config = {**LLAMA3_8B, "num_hidden_layers": layers, "vocab_size": vocab, "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config))
    return total


def _save_bf16(save_file, tensors: dict[str, np.ndarray], path: Path) -> None:
    """safetensors' numpy writer refuses ml_dtypes' bfloat16: write the bits as uint16, then mark them BF16."""
    import json
    import struct

    save_file({k: v.view(np.uint16) for k, v in tensors.items()}, str(path))
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    for key, entry in header.items():
        if key != "__metadata__":
            entry["dtype"] = "BF16"
    # Data offsets count from the end of the header, so a longer header only moves where the data starts.
    new = json.dumps(header, separators=(",", ":")).encode()
    new = new.ljust(-(-len(new) // 8) * 8)  # padded to 8 bytes, as safetensors writes it
    path.write_bytes(struct.pack("<Q", len(new)) + new + data[8 + length:])


def plain_read(folder: Path) -> list:
    from safetensors import safe_open

    out = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "flax") as f:
            out.extend(f.get_tensor(k) for k in f.keys())  # noqa: SIM118  (safe_open is not a dict)
    return out


def jsgl_load(folder: Path, host_transpose: bool = False, tp: int = 1) -> list:
    """The engine's placer (tensor parallel: each device's slice), or with ``host_transpose`` each matrix made
    contiguous on the host before it."""
    def placer(config):
        place = TensorParallel.create(config, tp).place if tp > 1 else lambda name, x: to_device(x)
        return (lambda name, x: place(name, np.ascontiguousarray(x))) if host_transpose else place

    _, params = load_model(str(folder), ml_dtypes.bfloat16, placer)
    return jax.tree.leaves(params)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--vocab", type=int, default=None, help="cut the embedding and head to this many rows")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel over this many devices (on CPU: "
                   "XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    args = p.parse_args(argv)
    runs = {"plain read": lambda f: plain_read(f), "jsgl": lambda f: jsgl_load(f, tp=args.tp),
            "host transpose": lambda f: jsgl_load(f, host_transpose=True, tp=args.tp)}
    with tempfile.TemporaryDirectory(prefix="jsgl-bench-loading-") as root:
        folder = Path(root)
        nbytes = write_checkpoint(folder, args.layers, args.vocab)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                t0 = time.perf_counter()
                jax.block_until_ready(run(folder))
                times[name].append(time.perf_counter() - t0)
    print(f"{nbytes / 1e9:.2f} GB of bf16 safetensors (Llama-3-8B shapes, {args.layers} layers) onto "
          f"{args.tp} x {jax.devices()[0].device_kind}; median of {args.rounds} rounds, files in the page cache:")
    plain = statistics.median(times["plain read"])
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"  {name:15s} {median:7.2f} s  {nbytes / median / 1e9:6.2f} GB/s  "
              f"({plain / median:.2f}x the plain read)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
