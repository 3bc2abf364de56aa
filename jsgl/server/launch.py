"""Starting a jsgl server from Python: in a subprocess (like SGLang's `Runtime`) or in a thread.

    with launch_server_process(model="smollm2-135m", kv_cache_gb=0.25) as server:
        fn.run(..., backend=server)          # server.endpoint is a RuntimeEndpoint
        httpx.post(server.url + "/generate", json={...})

The subprocess runs `python -m jsgl.cli serve`; we wait for GET /health, and `shutdown()` sends SIGTERM
(uvicorn drains, then the engine stops) and SIGKILLs only if that hangs. `ServerThread` serves an Engine
that already lives in this process (tests, notebooks) without loading the model twice.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_health(url: str, timeout: float, alive: Any = None) -> None:
    """Poll GET {url}/health until it answers 200; `alive()` returning False aborts the wait early."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise RuntimeError("the server exited during startup")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.25)
    raise TimeoutError(f"the server at {url} was not healthy within {timeout:.0f}s")


def log_tail(path: str, chars: int = 4000) -> str:
    """The end of a child's log file ("" if it cannot be read)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, and SIGKILL if it has not exited within ``timeout``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class ServerProcess:
    """A server in a child process. Pass it as `backend=` (or use `.endpoint`) to run DSL programs."""

    def __init__(self, proc: subprocess.Popen, url: str, api_key: str | None, log_path: str) -> None:
        self.proc, self.url, self.api_key, self.log_path = proc, url, api_key, log_path
        self._endpoint: Any = None
        atexit.register(self.shutdown)

    @property
    def endpoint(self) -> Any:
        if self._endpoint is None:
            from jsgl.lang.endpoint_backend import RuntimeEndpoint

            self._endpoint = RuntimeEndpoint(self.url, api_key=self.api_key)
        return self._endpoint

    def log_tail(self, chars: int = 4000) -> str:
        return log_tail(self.log_path, chars)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
        stop_process(self.proc, timeout)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _engine_flags(engine_kwargs: dict[str, Any]) -> list[str]:
    from jsgl.engine.config import EngineConfig

    known = set(EngineConfig.__dataclass_fields__)
    flags = []
    for name, value in engine_kwargs.items():
        if name not in known:
            raise TypeError(f"unknown engine option {name!r}")
        if value is None:
            continue
        if isinstance(value, bool):
            value = "on" if value else "off"
        flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


def launch_server_process(model: str = "smollm2-135m", host: str = "127.0.0.1", port: int | None = None,
                          api_key: str | None = None, timeout: float = 600.0, log_path: str | None = None,
                          env: dict[str, str] | None = None, **engine_kwargs: Any) -> ServerProcess:
    """Start `jsgl serve` in a subprocess and return once it is healthy (engine kwargs become flags).

    Unlike `jsgl serve`, the server compiles step shapes on first use unless ``precompile=`` is given: a
    harness's short-lived servers would spend most of their life precompiling."""
    engine_kwargs.setdefault("precompile", "off")
    port = port or free_port(host)
    cmd = [sys.executable, "-m", "jsgl.cli", "serve", "--model", model, "--host", host, "--port", str(port),
           *_engine_flags(engine_kwargs)]
    if api_key:
        cmd += ["--api-key", api_key]
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="jsgl-server-", suffix=".log")
        os.close(fd)
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = ServerProcess(proc, f"http://{host}:{port}", api_key, log_path)
    try:
        wait_for_health(server.url, timeout, alive=server.alive)
    except BaseException as exc:
        server.shutdown()
        raise RuntimeError(f"jsgl server failed to start ({exc}); log tail:\n{server.log_tail()}") from exc
    return server


class ServerThread:
    """Serve an existing in-process Engine with uvicorn on a background thread."""

    def __init__(self, engine: Any, host: str = "127.0.0.1", port: int | None = None, api_key: str | None = None,
                 log_level: str = "warning", limits: Any = None) -> None:
        import uvicorn

        from jsgl.server.app import create_app

        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.app = create_app(engine, api_key=api_key, limits=limits)
        config = uvicorn.Config(self.app, host=host, port=self.port, log_level=log_level,
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="jsgl-uvicorn", daemon=True)

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        atexit.register(self.stop)  # drained before the engine stops (exit hooks run last registered first)
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        atexit.unregister(self.stop)
        self.server.should_exit = True
        if self.thread.ident is not None:
            self.thread.join(timeout=15)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
