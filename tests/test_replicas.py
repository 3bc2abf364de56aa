"""`jsgl serve --dp N` (jsgl/server/replicas.py): engine replicas as Ray actors behind sglang-router.

Two replicas behind `cache_aware` answer every route as one engine does (SGLang /generate plain and streamed,
OpenAI chat, a client that goes away), with one engine's greedy outputs; on a workload of several long shared
prefixes their hit rate stays within 10% of one engine's and above round_robin's; a replica killed mid-run (or
hung) costs no request silently: each gets an answer or an error status, and the replica comes back into the
router's rotation. The CLI's refusals (a missing extra, --api-key with --dp) are quick tests, and so is the
supervisor's logic (a replica back from down or hung is registered with the router again) against a real /health
port, with the router and Ray stood in for.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from jsgl import cli
from jsgl.engine.config import EngineConfig
from jsgl.server.launch import ServerProcess, launch_server_process

WORKER = dict(kv_cache_gb=0.25, max_running_requests=8, chunked_prefill_size=256)
GREEDY = {"temperature": 0, "max_new_tokens": 12}
PROMPT = "The three primary colors are"
HAVE_EXTRA = all(importlib.util.find_spec(m) is not None for m in ("ray", "sglang_router"))
needs_extra = pytest.mark.skipif(not HAVE_EXTRA, reason='needs pip install "jsgl[distributed]"')


def test_dp_without_the_extra_names_it(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    assert cli.main(["serve", "--dp", "2"]) == 2
    err = capsys.readouterr().err
    assert 'pip install "jsgl[distributed]"' in err and "ray" in err, err


def test_dp_with_an_api_key_is_refused(capsys):
    assert cli.main(["serve", "--dp", "2", "--api-key", "k"]) == 2
    err = capsys.readouterr().err
    assert "--api-key" in err and "--dp" in err, err


def test_dp_with_several_nodes_is_refused(capsys):
    assert cli.main(["serve", "--dp", "2", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:5000"]) == 2
    err = capsys.readouterr().err
    assert "--dp" in err and "--nnodes" in err, err


# Several long system prompts, each with several questions, interleaved (prompt 0 of each, then 1 of each, ...).
TOPICS = ["astronomy", "cooking", "geology", "music theory", "sailing"]
WORDS = ("river stone light quiet market paper garden window silver engine harbor winter lantern orchard signal "
         "meadow copper bridge candle forest").split()


def shared_prefix_prompts(systems: int, questions: int) -> list[str]:
    prompts = {}
    for s in range(systems):
        body = " ".join(WORDS[(s * 7 + i * 3) % len(WORDS)] for i in range(160))
        system = f"You are an expert in {TOPICS[s % len(TOPICS)]} (assistant {s}). Background notes: {body}."
        for q in range(questions):
            prompts[q, s] = f"{system}\nQuestion {q}: what is the {q + 1}th most important fact about it?\nAnswer:"
    return [prompts[key] for key in sorted(prompts)]


def _run_workload(url: str, prompts: list[str], concurrency: int = 4) -> list[str]:
    def one(prompt: str) -> str:
        resp = httpx.post(f"{url}/generate", json={"text": prompt, "sampling_params": {
            "temperature": 0, "max_new_tokens": 4}}, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()["text"]

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def hit_rate(worker_urls: list[str], url: str, prompts: list[str]) -> float:
    """Cached over prompt tokens, summed over the workers, for `prompts` sent to `url` from empty caches."""
    for worker in worker_urls:
        assert httpx.post(f"{worker}/flush_cache", timeout=30).status_code == 200
    before = [httpx.get(f"{w}/get_server_info", timeout=30).json() for w in worker_urls]
    _run_workload(url, prompts)
    after = [httpx.get(f"{w}/get_server_info", timeout=30).json() for w in worker_urls]
    cached = sum(a["cached_tokens"] - b["cached_tokens"] for a, b in zip(after, before))
    prompt = sum(a["prompt_tokens"] - b["prompt_tokens"] for a, b in zip(after, before))
    return cached / prompt


@pytest.fixture(scope="module")
def single() -> Iterator[ServerProcess]:
    with launch_server_process(precompile="off", **WORKER) as server:
        yield server


@pytest.fixture(scope="module")
def replicas():
    from jsgl.server.replicas import Replicas

    config = EngineConfig(model="smollm2-135m", precompile="off", **WORKER)
    with Replicas(config, dp=2, policy="cache_aware", hang_restart_s=8.0) as r:
        yield r


def _generate(url: str, **body) -> dict:
    resp = httpx.post(f"{url}/generate", json={"text": PROMPT, "sampling_params": GREEDY, **body}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


@needs_extra
@pytest.mark.slow
def test_routes_through_replicas_answer_as_one_engine(replicas, single):
    routed = _generate(replicas.url)
    assert routed["text"] == _generate(single.url)["text"] and routed["meta_info"]["completion_tokens"] == 12
    events = []
    with httpx.stream("POST", f"{replicas.url}/generate", timeout=120,
                      json={"text": PROMPT, "sampling_params": GREEDY, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["text"] == routed["text"]
    chat = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8,
            "temperature": 0}
    answers = [httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120) for url in (replicas.url,
                                                                                             single.url)]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    assert len({a.json()["choices"][0]["message"]["content"] for a in answers}) == 1
    # Greedy outputs of a shared-prefix batch, routed over both replicas, are one engine's.
    prompts = shared_prefix_prompts(2, 2)
    assert _run_workload(replicas.url, prompts) == _run_workload(single.url, prompts)


def _active(urls: list[str]) -> int:
    return sum(httpx.get(f"{u}/get_server_info", timeout=10).json()["active_requests"] for u in urls)


@needs_extra
@pytest.mark.slow
def test_a_client_that_goes_away_aborts_its_request_on_the_replica(replicas):
    long = {"text": "Count forever: 1, 2, 3,", "stream": True,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0}}
    with httpx.stream("POST", f"{replicas.url}/generate", json=long, timeout=120) as r:
        assert sum(line.startswith("data: ") for line, _ in zip(r.iter_lines(), range(6))) >= 2
    deadline = time.monotonic() + 20  # 4000 tokens would take minutes: the replica aborted it
    while _active(replicas.urls) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _active(replicas.urls) == 0


@needs_extra
@pytest.mark.slow
def test_cache_aware_hit_rate_is_one_engines_and_above_round_robin(replicas, single):
    from jsgl.server.router_process import RouterProcess

    prompts = shared_prefix_prompts(5, 4)
    one = hit_rate([single.url], single.url, prompts)
    cache_aware = hit_rate(replicas.urls, replicas.url, prompts)
    robin = RouterProcess(replicas.urls, policy="round_robin")
    try:
        robin.wait_for_workers(2)
        round_robin = hit_rate(replicas.urls, robin.url, prompts)
    finally:
        robin.stop()
    print(f"hit rate: one engine {one:.3f}, dp2 cache_aware {cache_aware:.3f}, dp2 round_robin {round_robin:.3f}")
    assert cache_aware >= 0.9 * one, (one, cache_aware)
    assert cache_aware > round_robin + 0.1, (cache_aware, round_robin)


def _pid(replicas, index: int) -> int:
    import ray

    return ray.get(replicas.replicas[index].actor.pid.remote(), timeout=60)


def _until_back(replicas, index: int, restarts: int, timeout: float = 120.0) -> float:
    start = time.monotonic()
    while replicas.replicas[index].restarts == restarts:
        assert time.monotonic() - start < timeout, f"replica {index} did not come back in {timeout:.0f} s"
        time.sleep(0.2)
    return time.monotonic() - start


def _prompt_tokens(replicas) -> list[int]:
    return [httpx.get(f"{u}/get_server_info", timeout=30).json()["prompt_tokens"] for u in replicas.urls]


def _marked_replica(replicas, marker: str) -> int:
    """The replica that serves a request beginning with `marker` (a long text of its own): the one the test stops."""
    before = _prompt_tokens(replicas)
    _generate(replicas.url, text=f"{marker} Question: why?")
    grew = [a > b for a, b in zip(_prompt_tokens(replicas), before)]
    assert grew.count(True) == 1, grew
    return grew.index(True)


def _finished(replicas) -> list[int]:
    """Requests each replica has finished (its /metrics: sglang:num_requests_total over finish reasons)."""
    counts = []
    for url in replicas.urls:
        lines = httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
        counts.append(round(sum(float(line.rsplit(" ", 1)[1]) for line in lines
                                if line.startswith("sglang:num_requests_total{"))))
    return counts


def _routed_to(replicas, index: int, requests: int = 8) -> int:
    """How many of `requests` new prompts, 4 at a time, the router sent to replica `index`. Under cache_aware
    (sglang-router 0.3.2) a prompt that matches no replica's tree goes to the replica with the fewest requests in
    flight, ties to the first in the router's worker order: one at a time, all would go to whichever replica is
    first (restarted or not); 4 at a time, a replica with none in flight gets the next."""
    start = _finished(replicas)
    prompts = [f"{WORDS[i % len(WORDS)].capitalize()} {i * 7919}: name {i + 2} things a {TOPICS[i % len(TOPICS)]} "
               f"expert would check first." for i in range(requests)]
    with ThreadPoolExecutor(4) as pool:
        for resp in pool.map(lambda p: _generate(replicas.url, text=p, sampling_params={
                "temperature": 0, "max_new_tokens": 16}), prompts):
            assert resp["meta_info"]["completion_tokens"] >= 1
    deadline = time.monotonic() + 10  # the engine counts a request as it finishes: all of them, then
    while sum(now := _finished(replicas)) - sum(start) < requests and time.monotonic() < deadline:
        time.sleep(0.1)
    routed = now[index] - start[index]
    if not routed:
        print("the router's workers:", json.dumps(replicas.router.workers()))
    return routed


@needs_extra
@pytest.mark.slow
def test_a_killed_replica_loses_no_request_and_comes_back(replicas):
    marker = "A note on killed replicas: " + " ".join(WORDS * 4)
    victim = _marked_replica(replicas, marker)
    restarts = replicas.replicas[victim].restarts
    prompts = shared_prefix_prompts(4, 4)

    def one(prompt: str) -> tuple[int, str]:
        # Every request ends, with an answer or an error status; a hang would raise ReadTimeout here.
        resp = httpx.post(f"{replicas.url}/generate", json={"text": prompt, "sampling_params": {
            "temperature": 0, "max_new_tokens": 16}}, timeout=120)
        return resp.status_code, resp.text

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        time.sleep(1.0)  # mid-run
        os.kill(_pid(replicas, victim), signal.SIGKILL)
        results = [f.result() for f in futures]
    assert all(code == 200 or code >= 500 for code, _ in results), results
    assert all(json.loads(text)["text"] for code, text in results if code == 200)
    print("statuses:", sorted(code for code, _ in results))
    back = _until_back(replicas, victim, restarts)
    print(f"replica {victim} back in the router's rotation {back:.1f} s after the kill")
    assert _generate(replicas.url)["meta_info"]["completion_tokens"] == 12  # still serving
    # Back in the router's list, healthy, serving, and routed to: new prompts, 4 at a time, reach it.
    url = replicas.replicas[victim].url
    assert any(w["url"] == url and w["is_healthy"] for w in replicas.router.workers())
    assert _generate(url)["meta_info"]["completion_tokens"] == 12
    routed = _routed_to(replicas, victim)
    print(f"the router sent {routed} of 8 new concurrent requests to the restarted replica {victim}")
    assert routed >= 1


@needs_extra
@pytest.mark.slow
def test_a_hung_replica_is_killed_and_restarted(replicas):
    marker = "A note on hung replicas: " + " ".join(reversed(WORDS * 4))
    victim = _marked_replica(replicas, marker)
    restarts = replicas.replicas[victim].restarts
    pid = _pid(replicas, victim)
    os.kill(pid, signal.SIGSTOP)  # alive to Ray, silent to every health check
    try:
        back = _until_back(replicas, victim, restarts)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    print(f"hung replica {victim} back {back:.1f} s after it stopped answering (hang_restart_s=8)")
    assert _pid(replicas, victim) != pid
    url = replicas.replicas[victim].url
    assert any(w["url"] == url and w["is_healthy"] for w in replicas.router.workers())
    assert _generate(url)["meta_info"]["completion_tokens"] == 12
    routed = _routed_to(replicas, victim)
    print(f"the router sent {routed} of 8 new concurrent requests to the restarted replica {victim}")
    assert routed >= 1


@pytest.mark.parametrize("dp,cores", [(1, 2), (2, 8), (2, 2), (4, 2)])
def test_thread_env_gives_xla_only_flags_it_parses(dp, cores, monkeypatch):
    # XLA reads an XLA_FLAGS that does not start with "--" as a file name and aborts the process: a replica with
    # several threads (--dp 1 --ray-address, or --dp 2 on 4+ cores) died at its first import of jax so.
    from jsgl.server.replicas import thread_env

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    env = thread_env(dp, cores)
    threads = max(1, cores // dp)
    assert env["JSGL_CPU_THREADS"] == env["OMP_NUM_THREADS"] == str(threads)
    flags = env.get("XLA_FLAGS")
    assert (flags == "--xla_cpu_multi_thread_eigen=false") if threads == 1 else flags is None, flags
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    flags = thread_env(dp, cores).get("XLA_FLAGS")
    assert flags is None or flags.split() == ["--xla_force_host_platform_device_count=2",
                                              "--xla_cpu_multi_thread_eigen=false"], flags


class HealthEndpoint:
    """A replica's /health on a real port (http.server), switched between answering (200 or 503) and not listening:
    what the supervisor probes, without an engine or Ray."""

    def __init__(self) -> None:
        from jsgl.server.launch import free_port

        self.port, self.status, self._server = free_port(), 200, None
        self.url = f"http://127.0.0.1:{self.port}"

    def up(self, status: int = 200) -> None:
        import http.server
        import threading

        self.status = status
        if self._server is None:
            endpoint = self

            class Health(http.server.BaseHTTPRequestHandler):
                def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                    self.send_response(endpoint.status if self.path == "/health" else 404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()

                def log_message(self, *args) -> None:
                    pass

            self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Health)
            threading.Thread(target=self._server.serve_forever, args=(0.01,), daemon=True).start()

    def down(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class RecordingRouter:
    """RouterProcess's interface the supervisor uses (``reregister``), recording the calls."""

    def __init__(self) -> None:
        self.registered: list[str] = []

    def reregister(self, url: str, timeout: float = 60.0) -> None:
        self.registered.append(url)


class RecordingRay:
    """The ``ray`` API the supervisor uses (``kill``), recording the calls."""

    def __init__(self) -> None:
        self.killed: list[tuple[object, bool]] = []

    def kill(self, actor: object, no_restart: bool = True) -> None:
        self.killed.append((actor, no_restart))


def _supervisor(endpoint: HealthEndpoint, hang_restart_s: float = 30.0, health_interval_s: float = 2.0):
    """A Replicas supervising one replica at ``endpoint``: what __init__ sets for supervision, the Ray cluster and
    the router stood in for (no replica is started)."""
    import threading

    from jsgl.server.replicas import Replica, Replicas

    replicas = Replicas.__new__(Replicas)
    replicas.hang_restart_s, replicas.health_interval_s = hang_restart_s, health_interval_s
    replicas._stopped, replicas._ray, replicas.router = threading.Event(), RecordingRay(), RecordingRouter()
    replicas.replicas = [Replica(0, endpoint.port, actor="the actor", url=endpoint.url)]
    return replicas


def test_a_replica_back_from_down_is_registered_with_the_router_again():
    endpoint = HealthEndpoint()
    endpoint.up()
    replicas = _supervisor(endpoint)
    (replica,) = replicas.replicas
    router = replicas.router
    try:
        replicas._check(replica)
        assert not replica.down and router.registered == []  # healthy from the start: registered at start-up
        endpoint.down()  # the actor died: nothing listens until Ray restarts it
        replicas._check(replica)
        replicas._check(replica)
        assert replica.down and router.registered == [] and replicas._ray.killed == []  # Ray restarts it alone
        endpoint.up()  # restarted on the same port, with an empty cache
        replicas._check(replica)
        assert router.registered == [endpoint.url] and not replica.down and replica.restarts == 1
        replicas._check(replica)
        assert router.registered == [endpoint.url]  # once per return, not per healthy probe
    finally:
        endpoint.down()


def test_a_hung_replica_is_killed_for_ray_to_restart_and_registered_again_once_back():
    endpoint = HealthEndpoint()
    endpoint.up(status=503)  # answering, not healthy
    replicas = _supervisor(endpoint, hang_restart_s=0.2)
    (replica,) = replicas.replicas
    try:
        replicas._check(replica)
        assert replica.down and replicas._ray.killed == []  # not yet hung for hang_restart_s
        time.sleep(0.25)
        replicas._check(replica)
        assert replicas._ray.killed == [("the actor", False)]  # killed with its restarts left on
        endpoint.up(status=200)
        replicas._check(replica)
        assert replicas.router.registered == [endpoint.url] and replica.restarts == 1
    finally:
        endpoint.down()


def test_the_supervision_thread_registers_a_restarted_replica():
    import threading

    endpoint = HealthEndpoint()
    replicas = _supervisor(endpoint, health_interval_s=0.02)  # down from the start
    supervisor = threading.Thread(target=replicas._supervise, daemon=True)
    supervisor.start()
    try:
        deadline = time.monotonic() + 10
        while not replicas.replicas[0].down and time.monotonic() < deadline:
            time.sleep(0.01)
        endpoint.up()
        while not replicas.router.registered and time.monotonic() < deadline:
            time.sleep(0.01)
        assert replicas.router.registered == [endpoint.url]
    finally:
        replicas._stopped.set()
        supervisor.join(5)
        endpoint.down()
    assert not supervisor.is_alive()


@needs_extra
def test_the_routers_admin_routes_need_its_key():
    """Whoever reaches the router must not list, add or remove its workers (a keyless POST /workers once sent every
    request to a stranger's server); the supervisor's key does."""
    from jsgl.server.router_process import RouterProcess

    router = RouterProcess([], policy="round_robin", control_key="the-supervisors-key")
    try:
        router.wait_for_workers(0)
        keyless = [httpx.get(f"{router.url}/workers", timeout=5),
                   httpx.post(f"{router.url}/workers", json={"url": "http://127.0.0.1:9"}, timeout=5),
                   httpx.delete(f"{router.url}/workers/any", timeout=5)]
        assert [r.status_code for r in keyless] == [401, 401, 401], [r.text for r in keyless]
        wrong = httpx.get(f"{router.url}/workers", headers={"Authorization": "Bearer guess"}, timeout=5)
        assert wrong.status_code == 401 and router.workers() == []
    finally:
        router.stop()
    generated = RouterProcess([], policy="round_robin")
    try:
        assert len(generated.control_key) >= 32
        generated.wait_for_workers(0)
        assert httpx.get(f"{generated.url}/workers", timeout=5).status_code == 401
    finally:
        generated.stop()


@needs_extra
@pytest.mark.slow
def test_a_replica_removed_from_the_router_is_registered_again(replicas):
    """Not only a replica that went down: one the router lost while serving (removed through the admin route) is
    put back by the supervisor, and requests reach both replicas again."""
    router = replicas.router
    victim = router.workers()[0]
    headers = {"Authorization": f"Bearer {router.control_key}"}
    httpx.delete(f"{router.url}/workers/{victim['id']}", headers=headers, timeout=10).raise_for_status()
    deadline = time.monotonic() + 60
    while not any(w["url"] == victim["url"] and w["is_healthy"] for w in router.workers()):
        assert time.monotonic() < deadline, router.workers()
        time.sleep(0.2)
    assert sorted(w["url"] for w in router.workers()) == sorted(replicas.urls)
