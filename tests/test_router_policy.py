"""What sglang-router 0.3.2's cache_aware policy does with prompts that match no replica's tree, on stub workers
(no model; the router itself is real): it sends each to the worker with the fewest requests in flight, ties to the
first in its worker order. So prompts sent one at a time all go to one worker, concurrent ones spread, and a worker
restarted and registered again (jsgl/server/replicas.py) gets its share of concurrent ones. docs/serving.md, faults.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from jsgl.server.launch import free_port

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                                                   reason='needs pip install "jsgl[distributed]"')]


class Stubs:
    """Workers that answer what the router calls; /generate counts per port and takes `delay_s`."""

    def __init__(self, n: int) -> None:
        self.counts: collections.Counter[int] = collections.Counter()
        self.delay_s = 0.0
        self.servers = {}
        for _ in range(n):
            self.start(free_port())

    def start(self, port: int) -> None:
        stubs = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _json(self, obj: dict) -> None:
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # /health, /server_info, /model_info, /get_load
                self._json({"model_path": "stub", "served_model_name": "stub", "is_generation": True,
                            "num_tokens": 0})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path.startswith("/generate"):
                    stubs.counts[port] += 1
                    time.sleep(stubs.delay_s)
                self._json({"text": "ok", "meta_info": {"completion_tokens": 1}})

        server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.servers[port] = server

    def stop(self, port: int) -> None:
        server = self.servers.pop(port)
        server.shutdown()
        server.server_close()

    def url(self, port: int) -> str:
        return f"http://127.0.0.1:{port}"

    def send(self, router_url: str, tag: str, n: int = 12, concurrency: int = 1, delay_s: float = 0.0) -> dict:
        """Counts per port of `n` distinct prompts (no shared prefix beyond `tag`) sent `concurrency` at a time."""
        self.counts.clear()
        self.delay_s = delay_s

        def one(i: int) -> None:
            resp = httpx.post(f"{router_url}/generate", timeout=30, json={
                "text": f"{i * 7919} {tag}: tell me something about the number {i}.",
                "sampling_params": {"max_new_tokens": 1}})
            assert resp.status_code == 200, resp.text

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(n)))
        return dict(self.counts)


def test_cache_aware_sends_new_prompts_to_the_least_loaded_then_the_first_worker():
    from jsgl.server.router_process import RouterProcess

    stubs = Stubs(2)
    ports = list(stubs.servers)
    router = RouterProcess([stubs.url(p) for p in ports], policy="cache_aware", health_interval_s=1)
    try:
        router.wait_for_workers(2, timeout=60)
        first = int(router.workers()[0]["url"].rsplit(":", 1)[1])  # the router's own order
        assert stubs.send(router.url, "one at a time") == {first: 12}
        spread = stubs.send(router.url, "four at a time", concurrency=4, delay_s=0.3)
        assert all(spread.get(p, 0) >= 3 for p in ports), spread
        # The first worker goes away and comes back on its port (as Ray restarts a replica), is registered again.
        stubs.stop(first)
        deadline = time.monotonic() + 30
        while any(w["is_healthy"] for w in router.workers() if w["url"] == stubs.url(first)):
            assert time.monotonic() < deadline, router.workers()
            time.sleep(0.2)
        stubs.start(first)
        router.reregister(stubs.url(first))
        again = stubs.send(router.url, "after the restart", concurrency=4, delay_s=0.3)
        assert again.get(first, 0) >= 3, again
        order = int(router.workers()[0]["url"].rsplit(":", 1)[1])
        assert stubs.send(router.url, "in turn, once more") == {order: 12}
    finally:
        router.stop()
        for port in list(stubs.servers):
            stubs.stop(port)
