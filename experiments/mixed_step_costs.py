"""What a mixed step costs against its decode and prefill run apart, on a served engine's own runner (its model,
backends, dtypes and pool): the cost model behind the platform's mixed-steps default (docs/performance.md).

Each case times three warm steps through ``ModelRunner.run`` (tokens read back; two warm-up calls absorb a shape's
compile), median of ``iters``: ``batch`` decodes at ``context``, a ``prefill``-token prefill from position 0, and
both in one step. Below 1, a mixed step is cheaper than the two it replaces; a decoding request waits for one step
instead of two while a prompt prefills.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

from jsgl.engine.model_runner import ModelRunner
from jsgl.engine.step_inputs import ForwardItem


@dataclasses.dataclass
class MixedCost:
    batch: int
    context: int
    prefill: int
    decode_s: float
    prefill_s: float
    mixed_s: float

    @property
    def ratio(self) -> float:
        return self.mixed_s / (self.decode_s + self.prefill_s)

    def row(self) -> str:
        return (f"decode b{self.batch} ctx{self.context} {1e3 * self.decode_s:8.1f} ms + prefill {self.prefill:4d} "
                f"{1e3 * self.prefill_s:8.1f} ms = {1e3 * (self.decode_s + self.prefill_s):8.1f} ms apart; mixed "
                f"{1e3 * self.mixed_s:8.1f} ms: {self.ratio:.2f}")


def _median_step(runner: ModelRunner, items: list[ForwardItem], iters: int) -> float:
    for _ in range(2):
        runner.run(items, logprobs=False)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        runner.run(items, logprobs=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(runner: ModelRunner, *, batches: list[int], prefills: list[int], context: int,
            iters: int = 5) -> list[MixedCost]:
    """Every (batch, prefill) case at ``context`` (lowered to what the pool holds). The runner must be idle and
    hold nothing worth keeping: the steps write K/V over the pool's first slots (flush an engine's cache first)."""
    page = runner.page_size
    round_up = lambda n: -(-n // page) * page  # noqa: E731  each request starts on a page of its own
    usable = runner.num_slots - page  # page 0 holds the reserved slot 0
    context = min(context, (usable - round_up(max(prefills))) // max(batches) // page * page)
    if context < 2:
        raise ValueError(f"a pool of {runner.num_slots} slots is too small for decodes at batch {max(batches)} "
                         f"beside a {max(prefills)}-token prefill")

    def decodes(batch: int) -> list[ForwardItem]:
        return [ForwardItem(token_ids=np.ones(1, np.int32), start_pos=context - 1,
                            slots=np.arange(context, dtype=np.int32) + page + i * round_up(context))
                for i in range(batch)]

    results = []
    for batch in batches:
        decode_s = _median_step(runner, decodes(batch), iters)
        for prefill in prefills:
            chunk = ForwardItem(token_ids=np.ones(prefill, np.int32), start_pos=0,
                                slots=np.arange(prefill, dtype=np.int32) + page + batch * round_up(context))
            prefill_s = _median_step(runner, [chunk], iters)
            mixed_s = _median_step(runner, [*decodes(batch), chunk], iters)
            results.append(MixedCost(batch, context, prefill, decode_s, prefill_s, mixed_s))
    return results
