"""Engine options (also the CLI's flags): memory, batching, caching and ablation switches."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EngineConfig:
    model: str = "smollm2-135m"
    kv_cache_gb: float = 1.0  # memory budget of the KV pool (float32 K and V of all layers)
    num_kv_slots: int | None = None  # overrides kv_cache_gb when set
    page_size: int = 1  # token-granular pool, as in the paper
    max_running_requests: int = 64
    chunked_prefill_size: int = 512  # new prompt tokens per extend step
    context_length: int | None = None  # defaults to the model's
    attention_backend: str = "auto"  # auto | native | pallas | cpu
    matmul_backend: str = "auto"  # auto | xla | packed | gguf (kernels of jsgl.kernels.cpu; gguf: Q4_1/Q8_0 blocks)
    attention_budget_gb: float = 0.5  # bound on an extend step's padded attention scores
    prefix_cache: str = "radix"  # radix | flat | none
    schedule_policy: str = "lpm"  # lpm | dfs-weight | fcfs | lof | random
    starvation_s: float | None = 30.0  # waiting longer than this goes first
    jump_forward: bool = True  # compressed-FSM jump-forward for regex/json_schema requests
    seed: int = 0  # seeds requests that do not bring their own
    tp: int = 1  # tensor-parallel degree (jax.sharding over local devices)

    def __post_init__(self) -> None:
        if self.prefix_cache not in ("radix", "flat", "none"):
            raise ValueError(f"prefix_cache must be radix, flat or none, not {self.prefix_cache!r}")
        if self.page_size < 1 or self.max_running_requests < 1 or self.chunked_prefill_size < 16:
            raise ValueError("page_size >= 1, max_running_requests >= 1, chunked_prefill_size >= 16")
