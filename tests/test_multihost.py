"""One engine over two processes (jax.distributed, gloo on CPU): tp=2 across two 1-device processes gives what tp=2
in one process (two forced host devices) gives, and a process that loses its peer exits with the reason.

The runs are children (this file as a script): a jax backend's device count and its distributed system are fixed
when it starts. The reference child writes its outputs as JSON; rank 0 of the pair writes its own, then waits for
the test to kill rank 1, asks for one more request and reports what happened until jax's coordination service ends
it (``dist_timeout`` after the peer's heartbeats stop).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from jsgl.server.launch import free_port

# A batch of different lengths: the long one (> chunked_prefill_size; all fit one attended-length bucket, 64, so
# few step shapes compile) is prefilled in chunks while the short ones decode, so extend and decode steps both
# cross the broadcast; one request samples (the sampler's inputs cross it), one has a frequency penalty (a
# per-vocabulary row crosses it).
PROMPTS = [
    "The capital of France is",
    "def add(a, b):",
    "In 1492, Christopher Columbus sailed across the Atlantic Ocean and reached the islands of the " * 2,
    "1, 1, 2, 3, 5, 8,",
]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PARAMS = [GREEDY] * len(PROMPTS) + [
    {"max_new_tokens": 8, "temperature": 0.8, "sampling_seed": 7, "ignore_eos": True},
    {"max_new_tokens": 8, "temperature": 0.0, "frequency_penalty": 1.0, "ignore_eos": True}]
PROMPTS = PROMPTS + PROMPTS[:2]
ENGINE = {"model": "smollm2-135m", "tp": 2, "num_kv_slots": 1024, "max_running_requests": 8,
          "chunked_prefill_size": 32, "prefill_share": 1.0, "precompile": "off", "weights_cache": "off"}
TIMEOUT_S = 5  # the pair's dist_timeout: how long a dead peer goes unnoticed by the coordination service


# ------------------------------------------------------------------------------------------ children
def _generate(engine: Any) -> dict[str, Any]:
    start = time.perf_counter()
    outs = engine.generate(PROMPTS, PARAMS, progress=False)
    stats = engine.stats()
    return {"token_ids": [o.token_ids for o in outs], "seconds": time.perf_counter() - start,
            "extend_steps": stats["extend_steps"], "decode_steps": stats["decode_steps"],
            "k_pool": [list(s.data.shape) for s in engine.runner.kv[0][0].addressable_shards]}


def reference_main(out: str) -> None:
    from jsgl.engine.engine import Engine

    engine = Engine(**ENGINE)
    try:
        Path(out).write_text(json.dumps(_generate(engine)))
    finally:
        engine.shutdown()


def rank_main(rank: int, port: int, out: str) -> None:
    import jax

    from jsgl.engine.engine import Engine

    engine = Engine(**ENGINE, dist_init_addr=f"127.0.0.1:{port}", nnodes=2, node_rank=rank, dist_timeout=TIMEOUT_S)
    if rank > 0:
        engine.follow()
        return
    result = _generate(engine)
    result["devices"], result["local_devices"] = jax.device_count(), jax.local_device_count()
    Path(out).write_text(json.dumps(result))
    print("READY", flush=True)
    while not Path(out + ".killed").exists():  # the test kills rank 1, then says so
        time.sleep(0.1)
    try:
        late = engine.generate("After the peer died,", GREEDY)
        print("GENERATED" if late.error is None else f"REQUEST FAILED: {late.error}", flush=True)
    except Exception as exc:
        print(f"REQUEST FAILED: {exc!r}", flush=True)
    time.sleep(TIMEOUT_S * 12)  # jax's coordination service must end this process before this ends
    print("STILL ALIVE", flush=True)
    os._exit(3)


def _messages() -> list[Any]:
    """Two steps as rank 0 packs them (seeded: rank 1 builds the same to compare): one with an FSM mask and a logit
    bias row (-inf included), one plain greedy decode that takes the previous step's tokens."""
    import numpy as np

    from jsgl.engine.multihost import StepMessage
    from jsgl.engine.step_inputs import Step, StepLayout, new_packed

    rng = np.random.default_rng(0)
    out = []
    for layout, rows in ((StepLayout(32, 8, 32, 64), True), (StepLayout(4, 4, 1, 64), False)):
        packed = new_packed(layout, VOCAB)
        packed.ints[:] = rng.integers(-2**31, 2**31 - 1, packed.ints.shape, np.int32)
        packed.views(layout)["temperature"][:] = rng.random(layout.num_b, np.float32)
        vocab_rows: list[Any] = [None, None, None]
        if rows:
            bias = rng.standard_normal((layout.num_b, VOCAB)).astype(np.float32)
            bias[0, :3] = [-np.inf, np.inf, -0.0]
            vocab_rows[:2] = [rng.integers(0, 2**32, (layout.num_b, VOCAB // 32), np.uint32), bias]
        out.append(StepMessage(Step(layout, packed, tuple(vocab_rows), not rows, []), -1 if rows else 20, not rows))
    return out


VOCAB = 1024


def channel_main(rank: int, port: int, out: str) -> None:
    """The channel alone (no model): rank 1 receives what rank 0 sends, bit for bit; then rank 0 dies without a
    stop message, and rank 1's next receive must fail at once rather than wait for it."""
    from jsgl.engine import multihost

    multihost.initialize(f"127.0.0.1:{port}", 2, rank, TIMEOUT_S)
    channel = multihost.StepChannel(1, VOCAB)
    messages = _messages()
    if rank == 0:
        for message in messages:
            channel.send(message)
        channel.keepalive()  # not yet due: sends nothing
        multihost.KEEPALIVE_S = 0.0
        channel.keepalive()
        channel.send_control(multihost.RESET_KV)
        os._exit(0)  # gone without a stop message
    def neutral(kind: str, num_b: int) -> tuple:  # the receiver's own neutral row, where rank 0 sent none
        return ("neutral", kind, num_b)

    same = []
    for sent in messages:
        got = channel.receive(neutral)
        assert isinstance(got, multihost.StepMessage)
        pairs = [(sent.step.packed.ints, got.step.packed.ints), (sent.step.packed.sampling, got.step.packed.sampling)]
        pairs += [(a, b) for a, b in zip(sent.step.vocab_rows, got.step.vocab_rows) if a is not None]
        same.append(all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in pairs)
                    and got.step.layout == sent.step.layout and (got.prompt_k, got.after) == (sent.prompt_k, sent.after)
                    and got.step.plain_greedy == sent.step.plain_greedy
                    and [isinstance(b, tuple) and b == neutral(kind, sent.step.layout.num_b) for kind, a, b in
                         zip(multihost.VOCAB_ROWS, sent.step.vocab_rows, got.step.vocab_rows) if a is None]
                    == [True] * sum(r is None for r in sent.step.vocab_rows))
    controls = [channel.receive(neutral), channel.receive(neutral)]
    Path(out).write_text(json.dumps({"same": same, "controls": controls == [multihost.KEEPALIVE, multihost.RESET_KV]}))
    # Rank 0 is gone: this receive fails at once (gloo's connection is closed), unless jax's coordination service,
    # which lived in rank 0, ends this process first.
    try:
        channel.receive(neutral)
    except multihost.PeerLostError as exc:
        Path(out + ".error").write_text(str(exc))
        raise


def listen_main(port: int) -> None:
    """Rank 0 alone, waiting for a rank 1 that never comes (the test probes its coordination port meanwhile)."""
    from jsgl.engine import multihost

    multihost.initialize(f"127.0.0.1:{port}", 2, 0, 60)



# ------------------------------------------------------------------------------------------ tests
def _env(devices: int) -> dict[str, str]:
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    return dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
                XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip())


if __name__ != "__main__":
    import pytest


    def test_channel_carries_steps_bit_for_bit_and_a_dead_rank0_fails_the_follower(tmp_path: Path) -> None:
        out, port = tmp_path / "channel.json", free_port()
        procs = [subprocess.Popen([sys.executable, __file__, "channel", str(r), str(port), str(out)], env=_env(1),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
        try:
            assert procs[0].wait(timeout=120) == 0, procs[0].communicate()[1][-4000:]
            rank0_gone = time.perf_counter()
            stderr = procs[1].communicate(timeout=TIMEOUT_S * 6)[1]
            follower_s = time.perf_counter() - rank0_gone
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        result = json.loads(out.read_text())
        assert result == {"same": [True, True], "controls": True}, stderr[-4000:]
        # The follower fails, with the reason, within the heartbeat timeout: at once, or jax's coordination service
        # (which lived in rank 0) ends it.
        assert procs[1].returncode != 0 and follower_s < TIMEOUT_S * 2
        error = Path(str(out) + ".error")
        assert (error.exists() and "a peer process died" in error.read_text()) or \
            "JAX distributed service detected fatal errors" in stderr, stderr[-4000:]

    # ~1-2 min on two cores: three processes load the model and compile their steps.
    @pytest.fixture(scope="module")
    def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
        tmp = tmp_path_factory.mktemp("multihost")
        out, port = tmp / "rank0.json", free_port()
        start = time.perf_counter()
        # The reference beside the pair: most of either is compiling, one core each.
        ref = subprocess.Popen([sys.executable, __file__, "reference", str(tmp / "ref.json")], env=_env(2),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ranks = [subprocess.Popen([sys.executable, __file__, "rank", str(r), str(port), str(out)], env=_env(1),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
        try:
            # (Gloo says on stdout when its peers connect.)
            while (line := ranks[0].stdout.readline()) and line.strip() != "READY":
                pass
            assert line, ranks[0].communicate(timeout=60)[1][-4000:]
            pair_s = time.perf_counter() - start
            assert ranks[1].poll() is None  # the follower still waits for rank 0's next step
            ranks[1].kill()
            ranks[1].wait(timeout=30)
            Path(str(out) + ".killed").touch()
            killed = time.perf_counter()
            stdout, stderr = ranks[0].communicate(timeout=TIMEOUT_S * 12 + 60)
            rank0_exit = {"code": ranks[0].returncode, "stdout": stdout, "stderr": stderr[-6000:],
                          "seconds": time.perf_counter() - killed}
            assert ref.wait(timeout=600) == 0, ref.communicate()[1][-4000:]
        finally:
            for proc in [*ranks, ref]:
                if proc.poll() is None:
                    proc.kill()
        return {"ref": json.loads((tmp / "ref.json").read_text()), "pair": json.loads(out.read_text()),
                "pair_s": pair_s, "total_s": time.perf_counter() - start, "rank0_exit": rank0_exit}

    @pytest.mark.slow
    def test_two_processes_span_one_mesh(runs: dict[str, Any]) -> None:
        pair = runs["pair"]
        assert (pair["devices"], pair["local_devices"]) == (2, 1)
        # Each process holds its shard of the pool: SmolLM2's 3 KV heads padded to 4, two a shard.
        print(f"pair ready in {runs['pair_s']:.0f} s (its batch {pair['seconds']:.0f} s), "
              f"all in {runs['total_s']:.0f} s")
        assert pair["k_pool"] == [[2, 1024, 64]] and runs["ref"]["k_pool"] == [[2, 1024, 64]] * 2

    @pytest.mark.slow
    def test_two_processes_match_one_process(runs: dict[str, Any]) -> None:
        ref, pair = runs["ref"], runs["pair"]
        assert pair["token_ids"] == ref["token_ids"]  # greedy, sampled (seeded) and penalized alike
        assert all(len(ids) == p["max_new_tokens"] for ids, p in zip(pair["token_ids"], PARAMS))
        assert pair["extend_steps"] > 1 and pair["decode_steps"] > 1  # the long prompt's chunks beside decodes

    @pytest.mark.slow
    def test_rank0_exits_when_its_peer_dies(runs: dict[str, Any]) -> None:
        exit_ = runs["rank0_exit"]
        assert "STILL ALIVE" not in exit_["stdout"]
        assert exit_["code"] != 0
        assert exit_["seconds"] < TIMEOUT_S * 12
        # The step's broadcast fails at once (the request gets an error, not a hang), and the coordination service
        # names the dead process when it ends this one.
        assert "REQUEST FAILED" in exit_["stdout"] or "GENERATED" not in exit_["stdout"], exit_["stdout"]
        assert "a peer process died" in exit_["stderr"] or "stopped sending heartbeats" in exit_["stderr"], \
            exit_["stderr"]


def test_the_coordination_service_listens_on_the_given_address_only() -> None:
    """--dist-init-addr 127.0.0.1:P: P answers there, and not on another of the host's addresses (127.0.0.2, the
    loopback's too), where jax's default bind ([::]) let a stranger join and abort both ranks."""
    import socket

    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "listen", str(port)], env=_env(1),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
                time.sleep(0.1)
        try:
            socket.create_connection(("127.0.0.2", port), timeout=2).close()
            raise AssertionError(f"the coordination service also answers on 127.0.0.2:{port}")
        except ConnectionRefusedError:
            pass
    finally:
        proc.kill()
        proc.wait(10)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if sys.argv[1] == "reference":
        reference_main(sys.argv[2])
    elif sys.argv[1] == "channel":
        channel_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    elif sys.argv[1] == "listen":
        listen_main(int(sys.argv[2]))
    else:
        rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])

