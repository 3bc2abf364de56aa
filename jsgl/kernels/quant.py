"""The quantized-weight type the CPU kernels compute on; the model loader fills it from a GGUF file."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class QuantBlocks:
    """A GGUF matrix [N, K] in its own blocks of 32 along K: ``w[n, k] = d[n, k // 32] * q[n, k] (+ m[n, k // 32])``.

    Q4_1 has ``m`` and q in 0..15; Q8_0 has no ``m`` and int8 q. Rows are in HF order (Q/K unpermuted).
    """

    kind: str  # "q4_1" | "q8_0"
    q: np.ndarray  # [N, K] uint8 (q4_1) or int8 (q8_0)
    d: np.ndarray  # [N, K // 32] float32
    m: np.ndarray | None  # [N, K // 32] float32, q4_1 only
