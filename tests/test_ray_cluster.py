"""`jsgl serve --dp N --ray-address ADDR` (jsgl/server/replicas.py): replicas on an existing Ray cluster.

A Ray head node is started here as its own process (`ray start --head --block`, in a session of its own, with
token authentication and a token of its own), and `jsgl serve` joins it from another process (a `ray.init` in this
one would clash with test_replicas' local cluster). Through the router the replicas answer /generate and
/v1/completions with a single engine's greedy text; the replicas are actors of that cluster (its actor table, its
CPUs in use, processes of its session, reached at its node's IP); SIGTERM stops the router and the actors and
leaves the cluster running, to serve the next `jsgl serve` (one replica, stopped by SIGINT); a client without the
cluster's token gets a clear error and no local cluster. Teardown stops the head and every process of its
session, even on failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from test_replicas import GREEDY, PROMPT, WORKER, needs_extra

from jsgl.server.launch import free_port, launch_server_process

DP = 2
COMPLETION = {"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}

# What a process that joins the cluster runs to read its actor table (GCS, no dashboard needed): class, state,
# pid and node IP of every actor.
ACTOR_TABLE = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(json.dumps([{"cls": a["ActorClassName"], "state": a["State"], "pid": a["Pid"],
                   "ip": a["Address"]["IPAddress"]} for a in ray._private.state.actors().values()]))
"""


class Head:
    """A Ray head node in a process session of its own (`ray start --head --block`)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Token authentication on, with a token only this test knows (not ~/.ray/auth_token): every process
        # that joins needs these two variables, as a real cluster's clients would.
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self.temp_dir = tempfile.mkdtemp(prefix="jsgl-ray-", dir="/tmp")  # short: Ray's socket paths
        self.log = open(Path(self.temp_dir) / "head.log", "wb")  # noqa: SIM115
        ports = {flag: str(free_port()) for flag in (
            "--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
            "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port")}
        cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--port", str(self.port),
               "--num-cpus", str(DP), "--include-dashboard=false", "--disable-usage-stats",
               "--temp-dir", self.temp_dir, *[x for item in ports.items() for x in item]]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        self.pgid = self.proc.pid  # the session's (and process group's) id
        try:
            self._wait_up(timeout=120)
        except BaseException:
            self.stop()
            raise

    def _wait_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"ray start exited ({self.proc.returncode}):\n{self.log_tail()}"
            if "CPU" in self.status():
                return
            time.sleep(1)
        raise TimeoutError(f"the Ray head did not come up in {timeout:.0f} s:\n{self.log_tail()}")

    def status(self) -> str:
        """`ray status --address` (its resources in use), as a client of the cluster."""
        out = subprocess.run([str(Path(sys.executable).parent / "ray"), "status", "--address", self.address],
                             env=self.env, capture_output=True, text=True, timeout=60)
        return out.stdout if out.returncode == 0 else ""

    def cpus_in_use(self, expected: float, timeout: float = 30) -> bool:
        """Whether `ray status` shows `expected` of the head's CPUs in use within `timeout` (it reports the load
        a few seconds late)."""
        deadline = time.monotonic() + timeout
        while f"{float(expected)}/{float(DP)} CPU" not in self.status():
            if time.monotonic() > deadline:
                return False
            time.sleep(1)
        return True

    def actors(self) -> list[dict]:
        out = subprocess.run([sys.executable, "-c", ACTOR_TABLE, self.address], env=self.env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def processes(self) -> list[int]:
        """Live processes of the head's session (zombies excluded)."""
        out = subprocess.run(["ps", "-eo", "pid=,sid=,stat="], capture_output=True, text=True).stdout
        return [int(pid) for pid, sid, stat in (line.split()[:3] for line in out.splitlines())
                if int(sid) == self.pgid and not stat.startswith("Z")]

    def log_tail(self) -> str:
        self.log.flush()
        return (Path(self.temp_dir) / "head.log").read_text(errors="replace")[-3000:]

    def stop(self) -> list[int]:
        """SIGTERM to `ray start` (it stops its processes), then SIGKILL to whatever of its session is left;
        returns what had to be killed."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=45)
        deadline = time.monotonic() + 10
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        return left


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    h = Head()
    try:
        yield h
    finally:
        left = h.stop()
        assert not left, f"the Ray head left processes behind: {left}"
        assert not h.processes()


CONTROL_KEY = "the-supervisors-key"  # --control-plane-api-key: the test reads the router's workers with it

def _serve(head: Head, port: int, log_path: Path, dp: int = DP) -> subprocess.Popen:
    flags = [x for key, value in WORKER.items() for x in (f"--{key.replace('_', '-')}", str(value))]
    cmd = [sys.executable, "-m", "jsgl.cli", "serve", "--dp", str(dp), "--ray-address", head.address,
           "--port", str(port), "--precompile", "off", "--control-plane-api-key", CONTROL_KEY, *flags]
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=head.env, start_new_session=True)


def _wait_serving(proc: subprocess.Popen, log_path: Path, timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    while "replicas of" not in log_path.read_text(errors="replace"):  # printed once the router has them all
        assert proc.poll() is None, f"jsgl serve exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"not serving in {timeout:.0f} s:\n{log_path.read_text()[-4000:]}"
        time.sleep(0.5)


def _kill_group(proc: subprocess.Popen) -> None:
    """What a failed test leaves running: the serve process and its session (router, Ray driver)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _answers(url: str) -> tuple[str, str]:
    generated = httpx.post(f"{url}/generate", json={"text": PROMPT, "sampling_params": GREEDY}, timeout=120)
    assert generated.status_code == 200, generated.text
    completion = httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=120)
    assert completion.status_code == 200, completion.text
    return generated.json()["text"], completion.json()["choices"][0]["text"]


@needs_extra
@pytest.mark.slow
def test_replicas_join_an_existing_cluster_and_leave_it_running(head, tmp_path):
    assert not [a for a in head.actors() if a["state"] == "ALIVE"]
    router_port = free_port()
    log_path = tmp_path / "serve.log"
    proc = _serve(head, router_port, log_path)
    try:
        _wait_serving(proc, log_path)
        url = f"http://127.0.0.1:{router_port}"
        routed = _answers(url)
        with launch_server_process(precompile="off", **WORKER) as single:
            reference = _answers(single.url)
        assert routed == reference and all(routed), (routed, reference)

        # The replicas are that cluster's actors: in its actor table, holding its CPUs (one each), processes of
        # the head's session, and the router reaches them at the IP their node has in the cluster.
        replicas = [a for a in head.actors() if a["cls"] == "ReplicaServer" and a["state"] == "ALIVE"]
        assert len(replicas) == DP, replicas
        assert head.cpus_in_use(DP), head.status()
        session = set(head.processes())
        assert all(a["pid"] in session for a in replicas), (replicas, session)
        assert httpx.get(f"{url}/workers", timeout=10).status_code == 401  # the router's admin routes need the key
        workers = httpx.get(f"{url}/workers", headers={"Authorization": f"Bearer {CONTROL_KEY}"},
                            timeout=10).json()["workers"]
        assert {urlparse(w["url"]).hostname for w in workers} == {a["ip"] for a in replicas}, workers
        assert all(w["is_healthy"] for w in workers) and len(workers) == DP, workers
        for worker in workers:  # each answers at that address (bound to 0.0.0.0)
            assert httpx.get(f"{worker['url']}/health", timeout=10).status_code == 200

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, log_path.read_text()[-4000:]
        assert "replicas and router stopped" in log_path.read_text()
        # The actors are gone, their CPUs free, and the cluster is still up.
        assert not [a for a in head.actors() if a["state"] == "ALIVE"]
        assert head.cpus_in_use(0), head.status()
        assert not {a["pid"] for a in replicas} & set(head.processes())
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=5)
    finally:
        _kill_group(proc)


@needs_extra
@pytest.mark.slow
def test_a_cluster_it_cannot_join_is_named_and_no_local_one_started(head):
    # A client without the cluster's token (Ray's default when it was started where a token exists): a clear
    # error and exit 2, not a traceback, and no local cluster started in its place (Ray's API starts one when
    # called uninitialized, as stop() did after a failed join). Ray's connect retries cut to 2 s.
    env = {key: value for key, value in head.env.items() if key != "RAY_AUTH_TOKEN"}
    env.update(RAY_AUTH_MODE="disabled", RAY_gcs_server_port_wait_time_s="2")
    out = subprocess.run([sys.executable, "-m", "jsgl.cli", "serve", "--dp", "1", "--ray-address", head.address,
                          "--port", str(free_port()), "--precompile", "off"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-4000:]
    assert f"cannot join the Ray cluster at {head.address}" in out.stderr and "RAY_AUTH_MODE=token" in out.stderr
    assert "Traceback" not in out.stderr and "Started a local Ray instance" not in out.stderr, out.stderr[-4000:]
    assert not [a for a in head.actors() if a["state"] == "ALIVE"]


@needs_extra
@pytest.mark.slow
def test_the_cluster_serves_again_and_sigint_stops_it(head, tmp_path):
    # After a serve process left it (the test above), the same cluster takes another: one replica, stopped by
    # SIGINT (Ctrl-C) as SIGTERM stops two.
    router_port = free_port()
    log_path = tmp_path / "serve.log"
    proc = _serve(head, router_port, log_path, dp=1)
    try:
        _wait_serving(proc, log_path)
        generated, completion = _answers(f"http://127.0.0.1:{router_port}")
        assert generated and completion
        replicas = [a for a in head.actors() if a["cls"] == "ReplicaServer" and a["state"] == "ALIVE"]
        assert len(replicas) == 1 and replicas[0]["pid"] in head.processes(), replicas
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0, log_path.read_text()[-4000:]
        assert "replicas and router stopped" in log_path.read_text()
        assert not [a for a in head.actors() if a["state"] == "ALIVE"]
        assert head.cpus_in_use(0), head.status()
    finally:
        _kill_group(proc)
