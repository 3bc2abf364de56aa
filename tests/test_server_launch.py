"""`launch_server_process`: `jsgl serve` in a subprocess, healthy, usable as a DSL backend, shut down
cleanly. (Its own module so that no other engine is loaded in this process while the child runs.)"""

from __future__ import annotations

import httpx
import pytest

import jsgl.lang as sgl
from jsgl.server.launch import launch_server_process


@pytest.fixture(scope="module")
def server():
    srv = launch_server_process(model="smollm2-135m", api_key="k3y", kv_cache_gb=0.25, max_running_requests=8,
                                chunked_prefill_size=256, timeout=300)
    yield srv
    srv.shutdown()


def test_subprocess_server_serves_and_shuts_down(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.post(server.url + "/generate", json={"text": "hi"}).status_code == 401  # the key is enforced
    headers = {"Authorization": "Bearer k3y"}
    info = httpx.get(server.url + "/get_server_info", headers=headers).json()
    assert info["kv_cache_gb"] == 0.25 and info["max_running_requests"] == 8  # engine flags reached the child

    @sgl.function
    def qa(s):
        s += "Q: What is the capital of France?\nA:" + sgl.gen("answer", max_tokens=6, stop="\n", temperature=0)

    state = qa.run(backend=server)  # the ServerProcess hands its RuntimeEndpoint to the DSL
    direct = httpx.post(server.url + "/generate", headers=headers, timeout=120, json={
        "text": "Q: What is the capital of France?\nA:",
        "sampling_params": {"max_new_tokens": 6, "stop": "\n", "temperature": 0}}).json()
    assert state["answer"] == direct["text"]
    server.shutdown()
    # SIGTERM -> uvicorn drains and runs the app's shutdown (which stops the engine), then re-raises the
    # signal so the parent sees how the child ended.
    assert server.proc.returncode in (0, -15), server.log_tail()
    assert "jsgl: engine stopped" in server.log_tail()
