"""Host tensors onto devices, in the layout the forward wants, at the speed of the copy.

An HF checkpoint stores each matrix [out, in]; the forward multiplies [in, out]. The loader hands such a matrix on
as a transposed view of what it read, and here it travels as stored and is transposed on its device (numpy's
strided copy of a bfloat16 matrix ran at ~0.1-0.3 GB/s). Under tensor parallelism each device's block travels so.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

_device_transpose = jax.jit(jnp.transpose)


def _transposed_view(x: Any) -> bool:
    return isinstance(x, np.ndarray) and x.ndim == 2 and not x.flags.c_contiguous and x.T.flags.c_contiguous


def to_device(x: Any, device: Any = None) -> jax.Array:
    """A host tensor on ``device``; a transposed view is uploaded as stored and transposed there."""
    if not isinstance(x, np.ndarray):  # already a device array (a restored checkpoint's)
        return jax.device_put(x, device)
    if _transposed_view(x):
        return _device_transpose(jax.device_put(x.T, device))
    return jax.device_put(np.ascontiguousarray(x), device)


def to_sharded(x: np.ndarray, sharding: Sharding) -> jax.Array:
    """``x`` split over ``sharding``'s devices, each device's block put there by ``to_device``: of a transposed
    view, the block of what was read (whole rows of it: a copy of contiguous runs at most), transposed there."""
    if not _transposed_view(x):
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    stored = x.T
    blocks = [to_device(np.ascontiguousarray(stored[tuple(reversed(index))]).T, device)
              for device, index in sharding.addressable_devices_indices_map(x.shape).items()]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, blocks)
