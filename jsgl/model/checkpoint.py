"""jsgl's params pytree as orbax checkpoints, restored straight onto the devices that hold them.

A checkpoint is saved as the engine holds the params: cast to its dtype and, under tensor parallelism, padded
to whole GQA groups per shard (``jsgl.model.sharding``). One per (source model, dtype, tp degree), under the
model's cache folder::

    params-<dtype>-tp<N>/config.json   the HF-style config the params belong to
    params-<dtype>-tp<N>/tree/         orbax (tensorstore, OCDBT): each array in chunks

A restore gives each array the sharding asked for, and tensorstore reads each device's slice only: a tp=4
restart places every shard on its device without a host copy of the model (nor of one tensor). The float32
tp=1 checkpoint of a GGUF model is also its converted-weights cache (dequantized once, ~6 s for the default
model), which ``load_model`` restores to host arrays.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

Params = dict[str, Any]
# (leaf name: "embed", "wq", ...; its stored shape) -> where its restored array lives
ShardingOf = Callable[[str, tuple[int, ...]], jax.sharding.Sharding]


def checkpoint_path(model_cache: Path, dtype: Any, tp: int) -> Path:
    return model_cache / f"params-{np.dtype(dtype).name}-tp{tp}"


def exists(path: Path) -> bool:
    return (path / "config.json").exists() and (path / "tree").is_dir()


def save(path: Path, params: Params, hf_config: dict[str, Any]) -> None:
    """Write ``params`` (numpy or jax arrays, sharded or not) under ``path``; atomic: a stopped save leaves
    no checkpoint behind, only a temporary folder the next save replaces."""
    import orbax.checkpoint as ocp

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # Uncompressed: zstd saved a third of the default model's 540 MB and made restoring it ~1.5x slower.
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False)) as checkpointer:
        checkpointer.save(tmp.resolve() / "tree", args=ocp.args.PyTreeSave(params))
    (tmp / "config.json").write_text(json.dumps(hf_config))
    try:
        os.replace(tmp, path)
    except OSError:  # another process saved it first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)


def restore(path: Path, sharding_of: ShardingOf | None = None) -> tuple[dict[str, Any], Params]:
    """(the HF config, the params): each array on ``sharding_of(leaf name, shape)``, or as host numpy arrays
    when it is None."""
    import orbax.checkpoint as ocp

    tree = path.resolve() / "tree"
    hf_config = json.loads((path / "config.json").read_text())
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        stored = checkpointer.metadata(tree).item_metadata
    # Bytes in flight bounded by two of the largest array (orbax refuses an array as large as its bound): the host
    # holds about as much as when loading tensor by tensor. Unbounded, a 200 MB model restored at tp=4 peaked 70-90
    # MB over its placed shards (largest tensor: 8 MB); bounded, 35-45 MB.
    largest = max(int(np.prod(m.shape)) * np.dtype(m.dtype).itemsize for m in jax.tree.leaves(stored))
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(restore_concurrent_gb=2 * largest / 1e9)) as checkpointer:
        if sharding_of is None:
            args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), stored)
        else:
            args = jax.tree_util.tree_map_with_path(
                lambda key, m: ocp.ArrayRestoreArgs(sharding=sharding_of(_leaf_name(key), m.shape)), stored)
        return hf_config, checkpointer.restore(tree, args=ocp.args.PyTreeRestore(restore_args=args))


def _leaf_name(key: tuple) -> str:
    """("layers", 3, "wq") -> "wq"; ("embed",) -> "embed"."""
    last = key[-1]
    return str(getattr(last, "key", getattr(last, "name", last)))
