"""One engine over two processes (jax.distributed, gloo on CPU): tp=2 across two 1-device processes gives what tp=2
in one process (two forced host devices) gives, and a process that loses its peer exits with the reason.

The runs are children (this file as a script): a jax backend's device count and its distributed system are fixed
when it starts. The reference child writes its outputs as JSON; rank 0 of the pair writes its own, then waits for
the test to kill rank 1, asks for one more request and reports what happened until jax's coordination service ends
it (``dist_timeout_s`` after the peer's heartbeats stop).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# A batch of different lengths: the long one (> chunked_prefill_size) is prefilled in chunks while the short ones
# decode, so extend and decode steps both cross the broadcast; one request samples (the sampler's inputs cross
# it), one has a frequency penalty (a per-vocabulary row crosses it).
PROMPTS = [
    "The capital of France is",
    "def add(a, b):",
    "In 1492, Christopher Columbus sailed across the Atlantic Ocean and reached the islands of the " * 4,
    "1, 1, 2, 3, 5, 8,",
]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
PARAMS = [GREEDY] * len(PROMPTS) + [
    {"max_new_tokens": 8, "temperature": 0.8, "sampling_seed": 7, "ignore_eos": True},
    {"max_new_tokens": 8, "temperature": 0.0, "frequency_penalty": 1.0, "ignore_eos": True}]
PROMPTS = PROMPTS + PROMPTS[:2]
ENGINE = {"model": "smollm2-135m", "tp": 2, "num_kv_slots": 1024, "max_running_requests": 8,
          "chunked_prefill_size": 64, "prefill_share": 1.0, "precompile": "off", "weights_cache": "off"}
TIMEOUT_S = 5  # the pair's dist_timeout_s: how long a dead peer goes unnoticed by the coordination service


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

    engine = Engine(**ENGINE, dist_init_addr=f"127.0.0.1:{port}", nnodes=2, node_rank=rank, dist_timeout_s=TIMEOUT_S)
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
        engine.generate("After the peer died,", GREEDY)
        print("GENERATED", flush=True)
    except Exception as exc:
        print(f"REQUEST FAILED: {exc}", flush=True)
    time.sleep(TIMEOUT_S * 12)  # jax's coordination service must end this process before this ends
    print("STILL ALIVE", flush=True)
    os._exit(3)


# ------------------------------------------------------------------------------------------ tests
def _env(devices: int) -> dict[str, str]:
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    return dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
                XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ != "__main__":
    import pytest

    @pytest.fixture(scope="module")
    def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
        tmp = tmp_path_factory.mktemp("multihost")
        ref = subprocess.run([sys.executable, __file__, "reference", str(tmp / "ref.json")], env=_env(2),
                             capture_output=True, text=True, timeout=600)
        assert ref.returncode == 0, ref.stderr[-4000:]
        out, port = tmp / "rank0.json", _free_port()
        start = time.perf_counter()
        ranks = [subprocess.Popen([sys.executable, __file__, "rank", str(r), str(port), str(out)], env=_env(1),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
        try:
            assert ranks[0].stdout.readline().strip() == "READY", ranks[0].communicate(timeout=60)[1][-4000:]
            pair_s = time.perf_counter() - start
            assert ranks[1].poll() is None  # the follower still waits for rank 0's next step
            ranks[1].kill()
            ranks[1].wait(timeout=30)
            Path(str(out) + ".killed").touch()
            killed = time.perf_counter()
            stdout, stderr = ranks[0].communicate(timeout=TIMEOUT_S * 12 + 60)
            rank0_exit = {"code": ranks[0].returncode, "stdout": stdout, "stderr": stderr[-6000:],
                          "seconds": time.perf_counter() - killed}
        finally:
            for proc in ranks:
                if proc.poll() is None:
                    proc.kill()
        return {"ref": json.loads((tmp / "ref.json").read_text()), "pair": json.loads(out.read_text()),
                "pair_s": pair_s, "rank0_exit": rank0_exit}

    def test_two_processes_span_one_mesh(runs: dict[str, Any]) -> None:
        pair = runs["pair"]
        assert (pair["devices"], pair["local_devices"]) == (2, 1)
        # Each process holds its shard of the pool: SmolLM2's 3 KV heads padded to 4, two a shard.
        assert pair["k_pool"] == [[2, 1024, 64]] and runs["ref"]["k_pool"] == [[2, 1024, 64]] * 2

    def test_two_processes_match_one_process(runs: dict[str, Any]) -> None:
        ref, pair = runs["ref"], runs["pair"]
        assert pair["token_ids"] == ref["token_ids"]  # greedy, sampled (seeded) and penalized alike
        assert all(len(ids) == p["max_new_tokens"] for ids, p in zip(pair["token_ids"], PARAMS))
        assert pair["extend_steps"] > 1 and pair["decode_steps"] > 1  # the long prompt's chunks beside decodes

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


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if sys.argv[1] == "reference":
        reference_main(sys.argv[2])
    else:
        rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
