"""The token-granular KV pool: device buffers for K and V of every layer, and a host free-slot allocator.

Slot 0 is reserved: padding tokens of a bucketed step write there, so it never holds a real token.
With ``page_size > 1`` slots are handed out in whole pages (a page is ``page_size`` consecutive slots)
so a request's positions ``[k*page, (k+1)*page)`` share one page; page size 1 is the paper's design.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jsgl.kernels import kv_quant
from jsgl.model.config import ModelConfig


def slots_for_memory(config: ModelConfig, memory_gb: float, page_size: int = 1, dtype: Any = jnp.float32) -> int:
    """How many token slots fit in a memory budget (rounded down to whole pages) with pools of ``dtype``
    (jsgl.kernels.kv_quant: int8 is the 8-bit format, its scales counted)."""
    per_token = 2 * config.num_layers * config.num_kv_heads * kv_quant.bytes_per_head_token(dtype, config.head_dim)
    slots = int(memory_gb * (1 << 30)) // per_token
    return max(page_size * 2, slots - slots % page_size)


def allocate_pool(config: ModelConfig, num_slots: int, sharding: jax.sharding.NamedSharding | None = None,
                  dtype: Any = jnp.float32, stacked: bool = False):
    """Per-layer K and V pools, each ``[num_kv_heads, num_slots, head_dim]`` (see jsgl.model.llama.KVCache), or with
    ``stacked`` (a scanned model) one K and one V stack ``[num_kv_heads, num_layers, num_slots, head_dim]``; an
    ``Int8Pool`` each under the 8-bit format. ``sharding``: a layer's pool's (split over heads)."""
    shape = (config.num_kv_heads, num_slots, config.head_dim)
    if stacked:
        shape = (shape[0], config.num_layers, *shape[1:])
        if sharding is not None:  # the stack splits over heads as a layer's pool does
            spec = jax.sharding.PartitionSpec(sharding.spec[0], None, *sharding.spec[1:])
            sharding = jax.sharding.NamedSharding(sharding.mesh, spec)
        return kv_quant.allocate(shape, dtype, sharding), kv_quant.allocate(shape, dtype, sharding)
    make = lambda: [kv_quant.allocate(shape, dtype, sharding) for _ in range(config.num_layers)]
    return make(), make()


def page_slots(pages: np.ndarray, page_size: int) -> np.ndarray:
    """The slots of whole pages, in order (page p is slots [p * page_size, (p + 1) * page_size))."""
    return (np.asarray(pages, np.int32)[:, None] * page_size + np.arange(page_size, dtype=np.int32)).reshape(-1)


def slot_pages(slots: np.ndarray, num_tokens: int, page_size: int) -> np.ndarray:
    """The pages holding the first ``num_tokens`` of a request's slots (which come in whole pages): a block
    table's row. With page_size 1 these are the slots themselves."""
    if page_size == 1:
        return slots[:num_tokens]
    return slots[: -(-num_tokens // page_size) * page_size: page_size] // page_size


class SlotAllocator:
    """Free list of pool slots (page-granular). Host-side; the engine thread is its only user."""

    def __init__(self, num_slots: int, page_size: int = 1):
        if num_slots % page_size:
            raise ValueError("num_slots must be a multiple of page_size")
        self.num_slots = num_slots
        self.page_size = page_size
        # Page 0 holds the reserved padding slot; it is never handed out.
        self._free_pages = list(range(num_slots // page_size - 1, 0, -1))
        self._is_free = np.ones(num_slots // page_size, dtype=bool)
        self._is_free[0] = False

    @property
    def capacity(self) -> int:
        """Slots a request can ever use (all but the reserved page)."""
        return self.num_slots - self.page_size

    def num_free(self) -> int:
        return len(self._free_pages) * self.page_size

    def alloc(self, num_tokens: int) -> np.ndarray | None:
        """Slots of enough whole pages for ``num_tokens`` (a multiple of page_size), or None if short."""
        pages = -(-num_tokens // self.page_size)
        if pages > len(self._free_pages):
            return None
        taken = [self._free_pages.pop() for _ in range(pages)]
        self._is_free[taken] = False
        return page_slots(taken, self.page_size)

    def free(self, slots: np.ndarray) -> None:
        if len(slots) == 0:
            return
        pages = np.unique(np.asarray(slots) // self.page_size)
        if self._is_free[pages].any() or (pages == 0).any():
            raise RuntimeError(f"double free of KV pages {pages[self._is_free[pages]].tolist()}")
        self._is_free[pages] = True
        self._free_pages.extend(pages.tolist())
