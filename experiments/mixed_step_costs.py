"""What a mixed step costs against its decode and prefill run apart, on a served engine's own runner (its model,
backends, dtypes and pool): the cost model behind the platform's mixed-steps default (docs/performance.md).

Each case times three warm steps through ``ModelRunner.run`` (tokens read back; a first call absorbs a shape's
compile), median of ``iters``: ``batch`` decodes at ``context``, a ``prefill``-token prefill from position 0, and
both in one step. Below 1, a mixed step is cheaper than the two it replaces; a decoding request waits for one step
instead of two while a prompt prefills.
"""

from __future__ import annotations

import dataclasses

from jsgl.experiments.bench_device_steps import decode_items, prefill_item, time_step

from jsgl.engine.model_runner import ModelRunner


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


def measure(runner: ModelRunner, *, batches: list[int], prefills: list[int], context: int,
            iters: int = 5) -> list[MixedCost]:
    """Every (batch, prefill) case at ``context`` (lowered to what the pool holds). The runner must be idle and
    hold nothing worth keeping: the steps write K/V over the pool's first slots (flush an engine's cache first)."""
    page = runner.page_size
    room = runner.num_slots - page - -(-max(prefills) // page) * page  # less page 0 (slot 0's) and the prefill's
    context = min(context, room // max(batches) // page * page)
    if context < 2:
        raise ValueError(f"a pool of {runner.num_slots} slots is too small for decodes at batch {max(batches)} "
                         f"beside a {max(prefills)}-token prefill")
    median = lambda items: time_step(runner, items, iters)[1]  # noqa: E731  its first call absorbs a compile
    results = []
    for batch in batches:
        decodes = decode_items(batch, context, page)
        decode_s = median(decodes)
        for prefill in prefills:
            chunk = prefill_item(prefill, batch, context, page)
            results.append(MixedCost(batch, context, prefill, decode_s, median([chunk]), median([*decodes, chunk])))
    return results
