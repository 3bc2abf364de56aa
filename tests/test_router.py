"""jsgl as a worker of SGLang's own router (`sglang-router`, the `distributed` extra): two `jsgl serve` processes
behind `python -m sglang_router.launch_router --policy cache_aware`. Everything a client does through the router
must work as against one server: SGLang's /generate (plain and streamed, with the fields the router adds to every
request), the OpenAI routes, a client that goes away (the worker must abort the request, not finish it), and the
routes the router calls on its workers (/server_info, /model_info, /get_load, /flush_cache, /health)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from jsgl.server.launch import ServerProcess, free_port, launch_server_process

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_new_tokens": 12}
PROMPT = "The three primary colors are"
WORKER = dict(kv_cache_gb=0.25, max_running_requests=8, chunked_prefill_size=256, timeout=300)


class Router:
    """`sglang-router` in a subprocess, in front of `workers`."""

    def __init__(self, worker_urls: list[str], policy: str = "cache_aware") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="sglang-router-", suffix=".log", delete=False)  # noqa: SIM115
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
               "--worker-urls", *worker_urls, "--policy", policy, "--prometheus-port", str(free_port()),
               "--log-level", "warn"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_for_workers(self, n: int, timeout: float = 60.0) -> None:
        """Until the router has registered `n` healthy workers (it registers them in the background)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_tail()
            with contextlib.suppress(httpx.HTTPError, ValueError):
                workers = httpx.get(f"{self.url}/workers", timeout=2).json()["workers"]
                if sum(w["is_healthy"] for w in workers) == n:
                    return
            time.sleep(0.25)
        raise TimeoutError(f"the router did not register {n} healthy workers; log:\n{self.log_tail()}")

    def log_tail(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-4000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def workers() -> Iterator[list[ServerProcess]]:
    with ThreadPoolExecutor(2) as pool:  # both load at once
        futures = [pool.submit(launch_server_process, **WORKER) for _ in range(2)]
        started = []
        try:
            for future in futures:
                started.append(future.result())
        except BaseException:
            for server in started:
                server.shutdown()
            raise
    yield started
    for server in started:
        server.shutdown()


@pytest.fixture(scope="module")
def router(workers) -> Iterator[Router]:
    router = Router([w.url for w in workers])
    try:
        router.wait_for_workers(2)
        yield router
    finally:
        router.stop()


@pytest.fixture(scope="module")
def client(router) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=router.url, timeout=120) as c:
        yield c


def _generate(base: str, **body) -> dict:
    resp = httpx.post(f"{base}/generate", json={"text": PROMPT, "sampling_params": GREEDY, **body}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_generate_through_the_router_is_what_each_worker_answers(router, workers, client):
    resp = client.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY, "return_logprob": True})
    assert resp.status_code == 200, resp.text  # the router adds model, no_logs, return_bytes, return_entropy
    routed = resp.json()
    assert routed["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"] and routed["text"].strip()
    assert len(routed["meta_info"]["output_token_logprobs"]) == GREEDY["max_new_tokens"]
    for worker in workers:  # the same greedy text whichever worker the router picked
        assert _generate(worker.url)["text"] == routed["text"]
    # Fields SGLang defines and jsgl cannot honour still get a 400 naming them, through the router too.
    refused = client.post("/generate", json={"text": PROMPT, "return_entropy": True})
    assert refused.status_code == 400 and "return_entropy" in refused.text, refused.text


def test_streamed_generate_through_the_router(client):
    whole = client.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY}).json()["text"]
    events = []
    with client.stream("POST", "/generate", json={"text": PROMPT, "sampling_params": GREEDY, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) > 1 and chunks[-1]["text"] == whole  # cumulative text, as SGLang streams it
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_openai_routes_through_the_router(client, workers):
    chat = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8,
            "temperature": 0}
    routed = client.post("/v1/chat/completions", json=chat)
    assert routed.status_code == 200, routed.text
    direct = httpx.post(f"{workers[0].url}/v1/chat/completions", json=chat, timeout=120).json()
    assert routed.json()["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    completion = client.post("/v1/completions", json={"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": 12,
                                                      "temperature": 0})
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] == _generate(workers[1].url)["text"]
    # The router names the model from the workers' /server_info.
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["smollm2-135m"]


def _live(workers: list[ServerProcess]) -> tuple[int, int]:
    infos = [httpx.get(f"{w.url}/get_server_info", timeout=10).json() for w in workers]
    return sum(i["active_requests"] for i in infos), sum(i["client_aborts"] for i in infos)


def _wait_drained(workers: list[ServerProcess], aborts_before: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        active, aborts = _live(workers)
        if active == 0 and aborts > aborts_before:
            return
        time.sleep(0.2)
    raise AssertionError(f"the workers did not abort the request: {_live(workers)} (aborts before {aborts_before})")


LONG = {"text": "Count forever: 1, 2, 3,", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True,
                                                               "temperature": 0}}


def test_a_client_that_goes_away_aborts_its_request_on_the_worker(client, workers, router):
    """A streaming client closing mid-stream, and a plain one timing out: the router drops its connection to the
    worker, which aborts the request (4000 tokens would take minutes) and counts a client abort."""
    _, aborts = _live(workers)
    with httpx.Client(base_url=router.url, timeout=120) as c, c.stream("POST", "/generate",
                                                                      json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()
        assert sum(line.startswith("data: ") for line, _ in zip(lines, range(6))) >= 2
    _wait_drained(workers, aborts)
    _, aborts = _live(workers)
    with httpx.Client(base_url=router.url, timeout=3) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/generate", json=LONG)
    _wait_drained(workers, aborts)
    assert _generate(router.url)["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]  # still serving


def test_worker_routes_the_router_calls(client, workers):
    loads = client.get("/get_loads").json()["workers"]  # each worker's /get_load
    assert sorted(w["worker"] for w in loads) == sorted(w.url for w in workers)
    assert all(w["load"] >= 0 for w in loads), loads  # -1: the worker did not answer
    flushed = client.post("/flush_cache").json()
    assert flushed["workers_flushed"] == 2, flushed
    assert client.get("/health").status_code == 200
