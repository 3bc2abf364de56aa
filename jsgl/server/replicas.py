"""Data parallelism: N engine replicas as Ray actors behind SGLang's router (`jsgl serve --dp N`).

    from jsgl.engine.config import EngineConfig
    with Replicas(EngineConfig(model="smollm2-135m"), dp=2, policy="cache_aware") as replicas:
        httpx.post(replicas.url + "/generate", json={...})   # the router's address

Ray places and restarts the replicas: each actor loads an engine and serves it with uvicorn on its own port
(`max_restarts=-1`: a dead actor comes back on the same port). `sglang-router` (a subprocess) routes to them.
A supervision thread health-checks every replica: once one that was down is healthy again, the router is told
(re-registration), and one
that hangs (no answer for `hang_restart_s`) is killed so that Ray restarts it. `--ray-address` joins an
existing cluster; otherwise a local one is started (and stopped with the replicas).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from typing import Any

import httpx

from jsgl.errors import RefusedError
from jsgl.server.launch import free_port
from jsgl.server.limits import ServerLimits
from jsgl.server.router_process import RouterProcess, check_installed

log = logging.getLogger("jsgl.replicas")


class ClusterJoinError(RefusedError, ConnectionError):
    """`ray_address` names no Ray cluster this process can join."""


def join_error(address: str, exc: BaseException) -> ClusterJoinError:
    """What `ray.init(address=...)` failed on, with the likely fix: Ray (2.60) turns token authentication on
    for a head started where a token exists (~/.ray/auth_token), and a process joining by address uses a token
    only when told to (RAY_AUTH_MODE=token)."""
    chain, cause = [], exc
    while cause is not None:
        chain.append(f"{type(cause).__name__}: {cause}")
        cause = cause.__cause__
    text = " ".join(chain)
    if "Authentication" in text or "InvalidAuthToken" in text:
        hint = ("the cluster uses token authentication: set RAY_AUTH_MODE=token here, with its token in "
                "RAY_AUTH_TOKEN (or ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH)")
    else:
        hint = "is a head node running there (`ray start --head --port PORT`) and reachable from here?"
    return ClusterJoinError(f"cannot join the Ray cluster at {address}: {hint} ({str(exc).splitlines()[0]})")


class ReplicaServer:
    """One replica, run as a Ray actor: an engine served by uvicorn on a thread of the actor's process."""

    def __init__(self, config: Any, host: str, port: int, api_key: str | None = None,
                 limits: ServerLimits | None = None) -> None:
        import uvicorn

        from jsgl.engine.engine import Engine
        from jsgl.server.app import create_app

        self.engine = Engine(config=config)
        app = create_app(self.engine, api_key=api_key, owns_engine=True, limits=limits)
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=5,
                                                    log_level=os.environ.get("JSGL_LOG_LEVEL", "warning")))
        self.thread = threading.Thread(target=self.server.run, name="jsgl-replica-uvicorn", daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the replica's server did not start on {host}:{port}")
            time.sleep(0.05)

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        """uvicorn's graceful shutdown, then the engine's (the app owns it)."""
        self.server.should_exit = True
        self.thread.join(timeout=20)


@dataclasses.dataclass
class Replica:
    """What the supervisor knows of one replica."""

    index: int
    port: int
    actor: Any
    url: str = ""
    down: bool = False  # seen unhealthy since its last registration with the router
    bad_since: float | None = None  # answering, but not healthy (or not at all in time), since
    restarts: int = 0  # times it came back and was registered again


def thread_env(dp: int, cores: int | None = None) -> dict[str, str]:
    """Each replica's share of this machine's cores: the CPU kernels' threads (and OpenMP's); at one thread, XLA's
    Eigen pool off. XLA_FLAGS holds only `--` flags: a string that does not start with one is read as a file name
    (fatal), and XLA has no intra-op thread count flag."""
    cores = cores or len(os.sched_getaffinity(0))
    threads = max(1, cores // dp)
    env = {"JSGL_CPU_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    if threads == 1:  # one thread: XLA's Eigen pool would only compete with the other replicas
        env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_multi_thread_eigen=false".strip()
    return env


class Replicas:
    """`dp` engine replicas (Ray actors) behind `sglang-router`; `.url` is the router's address."""

    def __init__(self, config: Any, dp: int = 2, policy: str = "cache_aware", ray_address: str | None = None,
                 host: str = "127.0.0.1", port: int | None = None, limits: ServerLimits | None = None,
                 gpus_per_replica: float | None = None, hang_restart_s: float = 30.0,
                 health_interval_s: float = 2.0, start_timeout: float = 900.0,
                 control_key: str | None = None) -> None:
        check_installed()
        import ray

        if dp < 1:
            raise ValueError(f"dp must be at least 1, got {dp}")
        self.config, self.dp, self.policy = config, dp, policy
        self.hang_restart_s, self.health_interval_s = hang_restart_s, health_interval_s
        self._ray, self._own_ray = ray, False
        self._stopped = threading.Event()
        self.router: RouterProcess | None = None
        self.replicas: list[Replica] = []
        try:
            self._start_ray(ray_address, dp)
            self._start_replicas(host, limits, gpus_per_replica, start_timeout)
            self.router = RouterProcess([r.url for r in self.replicas], policy=policy, host=host, port=port,
                                        health_interval_s=max(1, round(health_interval_s)), control_key=control_key)
            self.router.wait_for_workers(dp, timeout=start_timeout)
        except BaseException:
            self.stop()
            raise
        self.url = self.router.url
        atexit.register(self.stop)  # a script that exits without stop() leaves no router or replica behind
        self._supervisor = threading.Thread(target=self._supervise, name="jsgl-replicas-supervisor", daemon=True)
        self._supervisor.start()

    def _start_ray(self, address: str | None, dp: int) -> None:
        ray = self._ray
        if ray.is_initialized():
            return
        main = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGTERM) if main else None
        try:
            self._init_ray(address, dp)
        finally:
            if main:  # ray.init's own SIGTERM handler exits at once (sys.exit): the caller's decides, as before
                signal.signal(signal.SIGTERM, previous)

    def _init_ray(self, address: str | None, dp: int) -> None:
        ray = self._ray
        if address:
            try:
                ray.init(address=address, logging_level=logging.WARNING, configure_logging=True)
            except ConnectionError as exc:
                raise join_error(address, exc) from exc
        else:  # a local cluster that can place every replica (one CPU each) even on a smaller machine
            ray.init(num_cpus=max(dp, os.cpu_count() or 1), include_dashboard=False, logging_level=logging.WARNING,
                     configure_logging=True)
            self._own_ray = True

    def _start_replicas(self, host: str, limits: ServerLimits | None, gpus: float | None, timeout: float) -> None:
        ray = self._ray
        if gpus is None:  # a GPU per tp rank when the cluster has them for every replica, else CPU replicas
            tp = getattr(self.config, "tp", 1)
            gpus = tp if ray.cluster_resources().get("GPU", 0) >= self.dp * tp else 0
        env = thread_env(self.dp) if not gpus else {}
        bind = host if self._own_ray else "0.0.0.0"  # another node's replica must be reachable from here
        actor_class = ray.remote(ReplicaServer)
        for i in range(self.dp):
            port = free_port(host)  # chosen once: a restarted actor serves on the same port
            actor = actor_class.options(
                max_restarts=-1, max_task_retries=0, num_cpus=1, num_gpus=gpus,
                max_concurrency=4, runtime_env={"env_vars": env} if env else None,
            ).remote(self.config, bind, port, None, limits)
            self.replicas.append(Replica(i, port, actor))
        for replica in self.replicas:  # all load at once
            ray.get(replica.actor.pid.remote(), timeout=timeout)
            node = host if self._own_ray else self._actor_ip(replica.actor)
            replica.url = f"http://{node}:{replica.port}"
            log.info("replica %d serving at %s", replica.index, replica.url)

    def _actor_ip(self, actor: Any) -> str:
        ray = self._ray
        return ray.get(actor.__ray_call__.remote(lambda self: ray.util.get_node_ip_address()))

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def _probe(self, url: str) -> str:
        """'ok', 'down' (nothing listens: dead or restarting), or 'bad' (no answer in time, or not healthy)."""
        try:
            resp = httpx.get(f"{url}/health", timeout=min(5.0, self.hang_restart_s))
        except (httpx.ConnectError, httpx.RemoteProtocolError):
            return "down"
        except httpx.HTTPError:
            return "bad"
        return "ok" if resp.status_code == 200 else "bad"

    def _supervise(self) -> None:
        while not self._stopped.wait(self.health_interval_s):
            for replica in self.replicas:
                if self._stopped.is_set():
                    return
                try:
                    self._check(replica)
                except Exception:  # the loop must outlive any one failed check
                    log.exception("supervising replica %d", replica.index)
            try:
                self._register_missing()
            except Exception:
                log.exception("checking the router's workers")

    def _register_missing(self) -> None:
        """Put back every serving replica the router lost, whoever removed it (not only those that went down)."""
        assert self.router is not None
        registered = {worker["url"] for worker in self.router.workers()}
        for replica in self.replicas:
            if not replica.down and replica.url not in registered and not self._stopped.is_set():
                log.warning("replica %d at %s was missing from the router: registered again", replica.index,
                            replica.url)
                self.router.register(replica.url)

    def _check(self, replica: Replica) -> None:
        asked = time.monotonic()  # a hang counts from the first unanswered probe's start, not its timeout
        state = self._probe(replica.url)
        if state == "ok":
            if replica.down:
                assert self.router is not None
                # A new worker entry: none of its old tree entries (its cache is empty now) or load counts
                self.router.reregister(replica.url)
                replica.down, replica.restarts = False, replica.restarts + 1
                log.warning("replica %d at %s is back and registered with the router again", replica.index,
                            replica.url)
            replica.bad_since = None
            return
        if not replica.down:
            log.warning("replica %d at %s is %s", replica.index, replica.url,
                        "down (Ray restarts it)" if state == "down" else "not answering")
        replica.down = True
        if state == "down":
            replica.bad_since = None
            return
        now = time.monotonic()
        replica.bad_since = replica.bad_since or asked
        if now - replica.bad_since >= self.hang_restart_s:  # hung: its process lives, so Ray would not act
            log.warning("replica %d hung for %.0f s: killing it for Ray to restart", replica.index,
                        now - replica.bad_since)
            self._ray.kill(replica.actor, no_restart=False)
            replica.bad_since = None

    def stats(self) -> list[dict[str, Any]]:
        """Each replica's /get_server_info (engine stats and config)."""
        return [httpx.get(f"{r.url}/get_server_info", timeout=30).json() for r in self.replicas]

    def stop(self) -> None:
        """The router, then each replica (gracefully, then killed), then Ray if it was started here."""
        atexit.unregister(self.stop)
        self._stopped.set()
        supervisor = getattr(self, "_supervisor", None)
        if supervisor is not None and supervisor is not threading.current_thread():
            supervisor.join(timeout=15)
        if self.router is not None:
            self.router.stop()
        ray = self._ray
        if not ray.is_initialized():  # Ray did not start or join: its API would start a local cluster now
            self.replicas = []
            return
        stops = []
        for replica in self.replicas:
            with contextlib.suppress(Exception):
                stops.append(replica.actor.stop.remote())
        with contextlib.suppress(Exception):
            ray.wait(stops, num_returns=len(stops), timeout=20)
        for replica in self.replicas:
            with contextlib.suppress(Exception):
                ray.kill(replica.actor, no_restart=True)
        self.replicas = []
        if self._own_ray and ray.is_initialized():
            ray.shutdown()
            self._own_ray = False

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
