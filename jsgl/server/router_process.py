"""SGLang's own router (`sglang-router`, Rust; the `distributed` extra) in a subprocess, in front of jsgl workers.

    router = RouterProcess(["http://127.0.0.1:30001", "http://127.0.0.1:30002"], policy="cache_aware")
    router.wait_for_workers(2)
    ...
    router.stop()

`reregister(url)` takes a worker out of the router and puts it back (`replicas.py` calls it after a replica
restarted): the router then holds a new entry for it, with an empty prefix tree (as the replica's cache is) and no
in-flight count left from requests it lost. Under cache_aware (0.3.2, `src/policies/cache_aware.rs`) a request
whose text matches more than `cache_threshold` (0.3) of a worker's tree goes to that worker; any other goes to the
worker with the fewest requests in flight, ties to the first in the router's worker order (a map keyed by random
worker ids: fixed for one registration, random across them). So requests sent one at a time to an idle router
with no shared prefix all go to one replica, restarted or not; concurrent ones spread over both
(docs/serving.md, faults).
"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import httpx

from jsgl.errors import MissingExtraError
from jsgl.server.launch import free_port, log_tail, stop_process

POLICIES = ("cache_aware", "round_robin", "power_of_two")
MISSING_EXTRA = 'jsgl --dp needs Ray and sglang-router: pip install "jsgl[distributed]"'


def check_installed() -> None:
    """Raise MissingExtraError (an ImportError) naming the extra when Ray or sglang-router is missing."""
    import importlib.util

    missing = [name for name in ("ray", "sglang_router") if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtraError(f"{MISSING_EXTRA} ({' and '.join(missing)} not installed)")


class RouterProcess:
    """`python -m sglang_router.launch_router` over `worker_urls`, logging to a temporary file."""

    def __init__(self, worker_urls: list[str], policy: str = "cache_aware", host: str = "127.0.0.1",
                 port: int | None = None, health_interval_s: int = 2, control_key: str | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"router policy {policy!r}: one of {', '.join(POLICIES)}")
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        # Its admin routes (/workers: add, remove, list) are on the clients' port: behind a key, or whoever reaches
        # the router could swap the replicas for a server of theirs. A fresh one per start unless given.
        self.control_key = control_key or secrets.token_urlsafe(32)
        self._admin = {"Authorization": f"Bearer {self.control_key}"}
        self.log = tempfile.NamedTemporaryFile(prefix="sglang-router-", suffix=".log", delete=False)  # noqa: SIM115
        # Health checks every few seconds (its default is 60 s: a dead worker would get requests for a minute);
        # a worker added later is polled each second, not every 30 s. No circuit breaker: its state is kept by URL
        # across a worker's removal, so after 10 failed requests a restarted replica got none for 60 s (measured).
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(self.port),
               "--worker-urls", *worker_urls, "--policy", policy, "--prometheus-port", str(free_port()),
               "--log-level", "warn", "--health-check-interval-secs", str(health_interval_s),
               "--health-failure-threshold", "2", "--health-success-threshold", "1",
               "--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "600",
               "--disable-circuit-breaker", "--control-plane-api-keys", f"jsgl:jsgl replicas:admin:{self.control_key}"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def workers(self) -> list[dict]:
        return httpx.get(f"{self.url}/workers", headers=self._admin, timeout=5).json()["workers"]

    def wait_for_workers(self, n: int, timeout: float = 120.0) -> None:
        """Until the router has registered `n` healthy workers (it registers them in the background)."""
        def healthy(workers: list[dict]) -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited ({self.proc.returncode}); log:\n{self.log_tail()}")
            return sum(w["is_healthy"] for w in workers) == n

        self._wait(healthy, timeout, f"register {n} healthy workers")

    def reregister(self, url: str, timeout: float = 60.0) -> None:
        """Remove `url` from the router and add it again (0.3.2: DELETE /workers/{id}, POST /workers; both are
        queued in the router, so each is waited for)."""
        spec = {"url": url}
        for worker in self.workers():
            if worker["url"] == url:
                if worker.get("model_id"):  # the same model key as before: the policy's tree is per model
                    spec["model_id"] = worker["model_id"]
                httpx.delete(f"{self.url}/workers/{worker['id']}", headers=self._admin, timeout=10).raise_for_status()
        self._wait(lambda ws: all(w["url"] != url for w in ws), timeout, f"remove {url}")
        self.register(url, spec, timeout)

    def register(self, url: str, spec: dict | None = None, timeout: float = 60.0) -> None:
        """Add ``url`` as a worker (0.3.2: POST /workers, queued in the router) and wait until it is healthy."""
        httpx.post(f"{self.url}/workers", json=spec or {"url": url}, headers=self._admin, timeout=10).raise_for_status()
        self._wait(lambda ws: any(w["url"] == url and w["is_healthy"] for w in ws), timeout, f"add {url}")

    def _wait(self, done: Callable[[list[dict]], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                if done(self.workers()):
                    return
            time.sleep(0.1)
        raise TimeoutError(f"the router did not {what} within {timeout:.0f} s; log:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return log_tail(self.log.name, chars)

    def stop(self, timeout: float = 10.0) -> None:
        stop_process(self.proc, timeout)
