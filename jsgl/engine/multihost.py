"""One engine over several processes (hosts): a multi-controller JAX program joined by ``jax.distributed``.

Every process builds the same engine over one global mesh (``jax.devices()``: all processes' devices) and holds
only its shards of the params and KV pool. Rank 0 owns the scheduler, tokenizer and server: for each step it
broadcasts what the step's jitted calls take (the packed inputs of ``step_inputs.py`` and the step's shape), and
every process runs the same calls over its shards (``ModelRunner.execute``). The other ranks run ``follow``: receive
a step, run it, until rank 0 says stop. The tokens every process computes are replicated, so rank 0 reads its own.

A message is two broadcasts (``multihost_utils.broadcast_one_to_all``, one all-reduce each over jax's CPU
collectives (gloo) or the accelerator's): a fixed header (kind, shape, flags), then the arrays it announces. While
rank 0 is idle it sends a keepalive a minute: the others wait inside a broadcast meanwhile.
A lost peer fails the next collective ("connection closed by peer") and, within ``dist_timeout``, jax's
coordination service sees its heartbeats stop and terminates every remaining process with that reason.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jsgl.engine.step_inputs import PackedStep, Step, StepLayout

if TYPE_CHECKING:
    from jsgl.engine.model_runner import ModelRunner

log = logging.getLogger("jsgl.engine.multihost")

# Header fields: message kind, the step's layout (T, B, S, L), prompt top-k, and flags.
HEADER = ("kind", "num_t", "num_b", "max_q", "max_l", "prompt_k", "plain_greedy", "after", "bitmask", "logit_bias",
          "repetition_scale")
STEP, STOP, RESET_KV, KEEPALIVE = 1, 2, 3, 4
# While rank 0 is idle, the others wait inside a broadcast: a message this often keeps that wait short of any
# collective timeout (gloo's waited 330 s in a check; its limit is not documented), and finds a dead peer sooner.
KEEPALIVE_S = 60.0
VOCAB_ROWS = ("bitmask", "logit_bias", "repetition_scale")


@dataclasses.dataclass
class StepMessage:
    """What every process needs to run one step: its packed inputs, and whether its tokens come from the step
    before (``after``: an overlapped decode step; each process has that step's tokens on its own devices)."""

    step: Step
    prompt_k: int
    after: bool


def initialize(dist_init_addr: str, nnodes: int, node_rank: int, timeout_s: int) -> None:
    """Join the ``nnodes`` processes (before anything touches a jax backend). ``timeout_s`` bounds the wait for
    the others to join, how long a silent peer counts as alive, and how long an exiting process waits for the
    others at shutdown."""
    if jax.distributed.is_initialized():
        return
    # CPU devices of different processes talk through gloo (jax 0.10's default, set so the choice is visible).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Rank 0's coordination service listens on the address given, not on every interface (jax's default): it
    # and the step broadcasts trust whoever joins (docs/serving.md#one-model-across-hosts).
    jax.distributed.initialize(dist_init_addr, num_processes=nnodes, process_id=node_rank,
                               initialization_timeout=timeout_s, heartbeat_timeout_seconds=timeout_s,
                               shutdown_timeout_seconds=timeout_s, coordinator_bind_address=dist_init_addr)
    log.info("process %d of %d joined at %s: %d devices in all, %d here", node_rank, nnodes, dist_init_addr,
             jax.device_count(), jax.local_device_count())


class StepChannel:
    """Rank 0 sends steps, every other rank receives them (the same two broadcasts on every process)."""

    def __init__(self, page_size: int, vocab_size: int):
        self.page_size = page_size
        self.source = jax.process_index() == 0
        self.vocab_widths = {"bitmask": -(-vocab_size // 32), "logit_bias": vocab_size,
                             "repetition_scale": vocab_size}
        self.last_sent = time.monotonic()

    def keepalive(self) -> None:
        """Rank 0 while idle: a message if none went out for ``KEEPALIVE_S``. A lost peer is logged here (the step
        that meets it fails its requests; jax's coordination service ends the process)."""
        if time.monotonic() - self.last_sent < KEEPALIVE_S:
            return
        try:
            self.send_control(KEEPALIVE)
        except PeerLostError:
            log.exception("rank 0's keepalive to the other processes failed")

    def send(self, message: StepMessage) -> None:
        step = message.step
        rows = [row if isinstance(row, np.ndarray) else None for row in step.vocab_rows]  # None: the neutral row
        header = np.array([STEP, *step.layout[:4], message.prompt_k, step.plain_greedy, message.after,
                           *(row is not None for row in rows)], np.int32)
        self._broadcast(header)
        payload = [step.packed.ints, step.packed.sampling] + [_as_int32(row) for row in rows if row is not None]
        self._broadcast(payload)

    def send_control(self, kind: int) -> None:
        self._broadcast(np.array([kind] + [0] * (len(HEADER) - 1), np.int32))

    def receive(self, neutral: Callable[[str, int], Any]) -> StepMessage | int:
        """The next step, or a control kind (``STOP``, ``RESET_KV``, ``KEEPALIVE``). ``neutral(kind, num_b)``: the
        receiver's own neutral vocabulary row, where rank 0 sent none (``ModelRunner._neutral``)."""
        header = dict(zip(HEADER, (int(x) for x in self._broadcast(np.zeros(len(HEADER), np.int32)))))
        if header["kind"] != STEP:
            return header["kind"]
        layout = StepLayout(header["num_t"], header["num_b"], header["max_q"], header["max_l"], self.page_size)
        vocab = [kind for kind in VOCAB_ROWS if header[kind]]
        # Shapes only: the values come from rank 0 (zeros here are what a non-source contributes).
        like = [np.zeros(layout.num_ints, np.int32), np.zeros(layout.num_sampling, np.int32)]
        like += [np.zeros((layout.num_b, self.vocab_widths[kind]), np.int32) for kind in vocab]
        ints, sampling, *rows = self._broadcast(like)
        received = dict(zip(vocab, rows))
        vocab_rows = tuple(received[kind].view(_VOCAB_DTYPES[kind]) if kind in received
                           else neutral(kind, layout.num_b) for kind in VOCAB_ROWS)
        step = Step(layout, PackedStep(ints, sampling), vocab_rows, bool(header["plain_greedy"]), [])
        return StepMessage(step, header["prompt_k"], bool(header["after"]))

    def _broadcast(self, tree: Any) -> Any:
        from jax.experimental import multihost_utils

        self.last_sent = time.monotonic()
        try:
            return multihost_utils.broadcast_one_to_all(tree, is_source=self.source)
        except Exception as exc:  # a peer gone: say so (jax's coordination service ends this process soon after)
            raise PeerLostError(f"process {jax.process_index()}: a collective with the other processes failed "
                                f"(a peer process died or was stopped?): {exc}") from exc


class PeerLostError(RuntimeError):
    """A broadcast between the engine's processes failed: another process is gone."""


_VOCAB_DTYPES = {"bitmask": np.uint32, "logit_bias": np.float32, "repetition_scale": np.float32}


def _as_int32(row: np.ndarray) -> np.ndarray:
    """The row's bits as int32: the broadcast sums the source's values with zeros, exact for integers."""
    return np.ascontiguousarray(row).view(np.int32)


def follow(runner: ModelRunner, channel: StepChannel) -> None:
    """A non-zero rank's loop: run every step rank 0 broadcasts, on this process's shards, until it says stop."""
    log.info("process %d follows rank 0's steps", jax.process_index())
    steps = 0
    while True:
        message = channel.receive(runner._neutral)
        if message == STOP:
            log.info("process %d: rank 0 stopped after %d steps", jax.process_index(), steps)
            return
        if message == RESET_KV:
            runner.reset_kv()
        if not isinstance(message, StepMessage):  # (KEEPALIVE: nothing to do)
            continue
        try:
            runner.execute(message)
            steps += 1
        except PeerLostError:
            raise
        except Exception:  # rank 0 met the same failure in the same call and decides (RESET_KV if the pool is lost)
            log.exception("process %d: a step failed", jax.process_index())
