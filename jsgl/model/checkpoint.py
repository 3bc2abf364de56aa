"""jsgl's params pytree as orbax checkpoints, restored straight onto the devices that hold them.

A checkpoint is saved as the engine holds the params: cast to its dtype and, under tensor parallelism, padded
to whole GQA groups per shard (``jsgl.model.sharding``). One per (source model, dtype, tp degree)::

    <folder>/config.json   the HF-style config the params belong to
    <folder>/tree/         orbax (tensorstore, OCDBT): each array in chunks

where the folder is ``checkpoints/<model key>/params-<FORMAT>-<dtype>-tp<N>`` in jsgl's cache, except a GGUF
model's float32 tp=1 params: they are its converted-weights cache (dequantized once, ~6 s for the default
model), under ``models/<model key>/``, which ``load_model`` also restores to host arrays.

A restore gives each array the sharding asked for, and tensorstore reads each device's slice only, with the
bytes in flight bounded: a tp=4 restart places every shard on its device without a host copy of the model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import jax
import numpy as np

Params = dict[str, Any]
# (leaf name: "embed", "wq", ...; its stored shape) -> where its restored array lives
ShardingOf = Callable[[str, tuple[int, ...]], jax.sharding.Sharding]


# Bump when what a checkpoint holds changes (the loader's conversion, the tensor-parallel padding): a checkpoint
# of another format is never restored.
FORMAT = "v1"


def folder_name(dtype: Any, tp: int) -> str:
    return f"params-{FORMAT}-{np.dtype(dtype).name}-tp{tp}"


def exists(path: Path) -> bool:
    return (path / "config.json").exists() and (path / "tree").is_dir()


def save(path: Path, params: Params, hf_config: dict[str, Any]) -> None:
    """Write ``params`` (numpy or jax arrays, sharded or not) under ``path``; atomic: it is written in a folder
    of this process's own and renamed into place, so a stopped save leaves no checkpoint behind."""
    import orbax.checkpoint as ocp

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=path.name + ".tmp-"))
    # Uncompressed: zstd saved a third of the default model's 540 MB and made restoring it ~1.5x slower. Device
    # to host copies bounded like a restore's reads: saving a model from an accelerator never holds it on the host.
    handler = ocp.PyTreeCheckpointHandler(use_compression=False,
                                          save_device_host_concurrent_gb=_in_flight_gb(jax.tree.leaves(params)))
    try:
        with ocp.Checkpointer(handler) as checkpointer:  # save() returns once the checkpoint is finalized
            checkpointer.save(tmp.resolve() / "tree", args=ocp.args.PyTreeSave(params))
        (tmp / "config.json").write_text(json.dumps(hf_config))
        os.replace(tmp, path)
    except OSError:
        if not exists(path):
            raise
        # another process saved it first: keep theirs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _in_flight_gb(leaves: list[Any]) -> float:
    """Two of the largest array (orbax refuses an array as large as its bound)."""
    return 2 * max(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves) / 1e9


def restore(path: Path, sharding_of: ShardingOf | None = None,
            skip: Collection[str] = ()) -> tuple[dict[str, Any], Params]:
    """(the HF config, the params): each array on ``sharding_of(leaf name, shape)``, or as host numpy arrays
    when it is None. ``skip``: flat names ("lm_head", "layers.3.wq") left out of the params, never read."""
    import orbax.checkpoint as ocp

    tree = path.resolve() / "tree"
    hf_config = json.loads((path / "config.json").read_text())
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        stored = checkpointer.metadata(tree).item_metadata
    wanted = _without(stored, skip)
    # Bytes in flight bounded: the host holds about as much as when loading tensor by tensor. Unbounded, a 200 MB
    # model restored at tp=4 peaked 70-90 MB over its placed shards (largest tensor: 8 MB); bounded, 35-45 MB.
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(
            restore_concurrent_gb=_in_flight_gb(jax.tree.leaves(stored)))) as checkpointer:
        if sharding_of is None:
            args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted)
        else:
            args = jax.tree_util.tree_map_with_path(
                lambda key, m: ocp.ArrayRestoreArgs(sharding=sharding_of(_leaf_name(key), m.shape)), wanted)
        return hf_config, checkpointer.restore(tree, args=ocp.args.PyTreeRestore(
            item=wanted, restore_args=args, partial_restore=bool(skip)))


def _without(stored: Any, skip: Collection[str]) -> dict[str, Any]:
    """The stored tree ({"embed", ..., "layers": [{"wq", ...}, ...]}) less the ``skip`` names."""
    tree = {name: leaf for name, leaf in stored.items() if name != "layers" and name not in skip}
    tree["layers"] = [{name: leaf for name, leaf in layer.items() if f"layers.{i}.{name}" not in skip}
                      for i, layer in enumerate(stored["layers"])]
    return tree


def _leaf_name(key: tuple) -> str:
    """("layers", 3, "wq") -> "wq"; ("embed",) -> "embed"."""
    last = key[-1]
    return str(getattr(last, "key", getattr(last, "name", last)))
