"""The no-cache ablation as a prefix cache that keeps nothing: every request computes its whole prompt."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jsgl.radix.cache_base import PrefixCacheBase


class NoPrefixCache(PrefixCacheBase):
    keeps_prefixes = False

    def match_prefix(self, tokens: Sequence[int] | np.ndarray) -> tuple[np.ndarray, Any]:
        self.query_tokens_total += len(tokens)
        return np.zeros(0, np.int32), None

    def match_len(self, tokens: Sequence[int] | np.ndarray) -> int:
        return 0

    def insert(self, tokens: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray) -> int:
        return len(tokens)  # takes none of them: the caller frees all its slots

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, handle: Any) -> int:
        return 0

    def dec_lock_ref(self, handle: Any) -> int:
        return 0

    def reset(self, force: bool = False) -> None:
        pass

    def format_tree(self, max_tokens: int = 8) -> str:
        return "(no prefix cache)"
