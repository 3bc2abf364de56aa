"""Soak test: `jsgl serve` under many concurrent clients sending a mix of valid, aborted and hostile requests.

Every valid request must get a complete answer (200, a finish reason of stop/length, a regex answer that
matches its regex), every invalid or hostile one a 4xx, and at the end no request may be live, no KV slot
may leak (free + cached == total), and the server's RSS must not have grown after warm-up. Reports
requests/s and p50/p99 latency per kind.

    python experiments/soak.py --duration 300 --clients 16         # launches `jsgl serve` in a subprocess
    python experiments/soak.py --url http://127.0.0.1:30000 --pid 1234
    jsgl bench soak --duration 60
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

RSS_SAMPLE_S = 5.0
PROMPTS = ["The capital of France is", "One, two, three,", "def fibonacci(n):", "Q: What is 2+2?\nA:",
           "A short poem about the sea:", "List three colors:"]
REGEX = r"(yes|no|maybe)"
NUMBER_REGEX = r"[0-9]{1,3}(\.[0-9])?"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}

# Hostile requests from the isolation review; each must get a 4xx (raw JSON: some are not valid for json.dumps).
HOSTILE = [
    '{"text": "Hi", "return_logprob": true, "top_logprobs_num": 49152}',
    '{"text": "Hi", "sampling_params": {"temperature": Infinity, "regex": "[a-z]+"}}',
    '{"text": "Hi", "sampling_params": {"regex": "[\\\\s\\\\S]{1,2000}"}}',
    '{"text": "Hi", "sampling_params": {"json_schema": "{\\"type\\": \\"string\\", \\"maxLength\\": 1000000}"}}',
    '{"text": "Hi", "sampling_params": {"stop": [' + ", ".join(f'"s{i}"' for i in range(2000)) + ']}}',
    '{"text": "bad \\ud800 surrogate"}',
    '{"text": "Hi", "sampling_params": {"regex": "[^\\\\s\\\\S]"}}',
    '{"text": ["x", "y"], "rid": "one-id-for-two"}',
    '{"text": "Hi", "sampling_params": {"max_new_tokens": -1}}',
    '{"text": "Hi", "sampling_params": {"no_such_param": 1}}',
]


@dataclasses.dataclass
class Outcome:
    kind: str
    ok: bool
    seconds: float
    detail: str = ""


@dataclasses.dataclass
class SoakReport:
    seconds: float
    outcomes: list[Outcome]
    rss_warm_mb: float | None  # at the end of the warm-up
    rss_end_mb: float | None
    compiles_warm: int  # step signatures compiled by the end of the warm-up (each costs host memory)
    server_info: dict[str, Any]
    # (seconds since the start, requests answered, RSS MB) every RSS_SAMPLE_S after the warm-up: a leak grows
    # with the requests; the radix tree filling the KV pool levels off (the 8-phase soak in test_soak.py).
    rss_samples: list[tuple[float, int, float]] = dataclasses.field(default_factory=list)

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    def latency(self, kind: str | None = None) -> tuple[float, float]:
        values = sorted(o.seconds for o in self.outcomes if kind is None or o.kind == kind)
        if not values:
            return float("nan"), float("nan")
        return values[len(values) // 2], values[min(len(values) - 1, int(0.99 * len(values)))]

    def leaks(self) -> list[str]:
        info, problems = self.server_info, []
        if info.get("active_requests") != 0 or not info.get("idle"):
            problems.append(f"requests still live: {info.get('active_requests')}")
        if info.get("free_slots", 0) + info.get("cache_tokens", 0) != info.get("total_slots"):
            problems.append(f"KV slots leak: free {info.get('free_slots')} + cached {info.get('cache_tokens')} "
                            f"!= total {info.get('total_slots')}")
        return problems

    def summary(self) -> str:
        kinds = sorted({o.kind for o in self.outcomes})
        lines = [f"{len(self.outcomes)} requests in {self.seconds:.0f} s = {len(self.outcomes) / self.seconds:.1f}/s; "
                 f"{len(self.failures)} wrong; p50/p99 latency {self.latency()[0]:.2f}/{self.latency()[1]:.2f} s"]
        for kind in kinds:
            n = sum(o.kind == kind for o in self.outcomes)
            p50, p99 = self.latency(kind)
            lines.append(f"  {kind:<14} {n:>5}  p50 {p50:6.2f} s  p99 {p99:6.2f} s")
        if self.rss_warm_mb is not None:
            lines.append(f"server RSS after warm-up {self.rss_warm_mb:.0f} MB, at the end {self.rss_end_mb:.0f} MB "
                         f"(step signatures compiled: {self.compiles_warm} -> {self.server_info.get('compiles')})")
        if self.rss_samples:
            lines.append("  RSS MB at (s, requests): " + ", ".join(f"{mb:.0f} ({t:.0f}, {n})"
                                                                 for t, n, mb in self.rss_samples))
        lines += [f"LEAK: {p}" for p in self.leaks()]
        lines += [f"WRONG: {o.kind}: {o.detail}" for o in self.failures[:10]]
        return "\n".join(lines)


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class Client:
    """One simulated user: picks a request kind at random and checks the answer."""

    def __init__(self, url: str, rng: random.Random, hostile_share: float, api_key: str | None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url, timeout=120, headers=headers)
        self.rng, self.hostile_share = rng, hostile_share
        self.kinds: dict[str, Callable[[], str]] = {
            "generate": self.generate, "stream": self.stream, "regex": self.regex, "json": self.json_schema,
            "select": self.select, "chat": self.chat, "disconnect": self.disconnect, "abort": self.abort,
            "oversize": self.oversize,
        }

    def one(self) -> Outcome:
        kind = "hostile" if self.rng.random() < self.hostile_share else self.rng.choice(list(self.kinds))
        t0 = time.perf_counter()
        try:
            detail = self.hostile() if kind == "hostile" else self.kinds[kind]()
        except Exception as exc:  # a transport error or a malformed answer is a failure too
            detail = f"{type(exc).__name__}: {exc}"
        return Outcome(kind, detail == "", time.perf_counter() - t0, detail)

    def _params(self, **extra: Any) -> dict[str, Any]:
        return {"max_new_tokens": self.rng.randint(1, 24), "temperature": self.rng.choice([0, 0.7]), **extra}

    def _complete(self, resp: httpx.Response) -> tuple[str, dict[str, Any]]:
        if resp.status_code != 200:
            return f"status {resp.status_code}: {resp.text[:200]}", {}
        body = resp.json()
        reason = (body.get("meta_info", {}).get("finish_reason") or {}).get("type")
        if reason not in ("stop", "length"):
            return f"finish_reason {reason!r}", body
        return "", body

    def generate(self) -> str:
        return self._complete(self.http.post("/generate", json={"text": self.rng.choice(PROMPTS),
                                                                 "sampling_params": self._params()}))[0]

    def stream(self) -> str:
        body = {"text": self.rng.choice(PROMPTS), "stream": True, "sampling_params": self._params()}
        last = None
        with self.http.stream("POST", "/generate", json=body) as resp:
            if resp.status_code != 200:
                return f"status {resp.status_code}"
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = json.loads(line[6:])
        reason = ((last or {}).get("meta_info", {}).get("finish_reason") or {}).get("type")
        return "" if reason in ("stop", "length") else f"stream ended with {reason!r}"

    def regex(self) -> str:
        pattern = self.rng.choice([REGEX, NUMBER_REGEX])
        error, body = self._complete(self.http.post("/generate", json={
            "text": self.rng.choice(PROMPTS), "sampling_params": self._params(regex=pattern, max_new_tokens=16)}))
        if error:
            return error
        finished = body["meta_info"]["finish_reason"]["type"] == "stop"
        if finished and not re.fullmatch(pattern, body["text"]):
            return f"{body['text']!r} does not match {pattern}"
        return ""

    def json_schema(self) -> str:
        error, body = self._complete(self.http.post("/generate", json={
            "text": "A person as JSON:", "sampling_params": {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 48,
                                                             "temperature": 0}}))
        if error:
            return error
        if body["meta_info"]["finish_reason"]["type"] == "stop":
            value = json.loads(body["text"])
            if not (isinstance(value, dict) and set(value) == {"name", "age"}):
                return f"not the schema: {body['text']!r}"
        return ""

    def select(self) -> str:
        """What `select` sends: prompt logprobs of each choice, nothing generated."""
        prompt = self.rng.choice(PROMPTS)
        texts = [prompt + c for c in (" yes", " no", " maybe")]
        resp = self.http.post("/generate", json={"text": texts, "sampling_params": {"max_new_tokens": 0},
                                                  "return_logprob": True, "logprob_start_len": 0})
        if resp.status_code != 200:
            return f"status {resp.status_code}"
        if any(len(b["meta_info"]["input_token_logprobs"]) != b["meta_info"]["prompt_tokens"] for b in resp.json()):
            return "prompt logprobs missing"
        return ""

    def chat(self) -> str:
        resp = self.http.post("/v1/chat/completions", json={
            "model": "default", "messages": [{"role": "user", "content": self.rng.choice(PROMPTS)}],
            "max_tokens": self.rng.randint(1, 16), "temperature": 0})
        if resp.status_code != 200:
            return f"status {resp.status_code}"
        return "" if resp.json()["choices"][0]["finish_reason"] in ("stop", "length") else "bad finish"

    def disconnect(self) -> str:
        """Hang up mid-stream: the server must abort the request and free its KV."""
        body = {"text": self.rng.choice(PROMPTS), "stream": True,
                "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        with httpx.Client(base_url=str(self.http.base_url), timeout=60, headers=self.http.headers) as one_off:
            with one_off.stream("POST", "/generate", json=body) as resp:
                if resp.status_code != 200:
                    return f"status {resp.status_code}"
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        break
        return ""

    def abort(self) -> str:
        rid = f"soak-{self.rng.getrandbits(64):016x}"
        result: dict[str, Any] = {}
        body = {"text": self.rng.choice(PROMPTS), "rid": rid,
                "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        thread = threading.Thread(target=lambda: result.update(r=self.http.post("/generate", json=body)))
        thread.start()
        time.sleep(self.rng.uniform(0.05, 0.3))
        self.http.post("/abort_request", json={"rid": rid})
        thread.join(120)
        resp = result.get("r")
        if resp is None or resp.status_code != 200:
            return f"aborted request answered {getattr(resp, 'status_code', None)}"
        reason = resp.json()["meta_info"]["finish_reason"]["type"]
        return "" if reason in ("abort", "length") else f"finish_reason {reason!r}"

    def oversize(self) -> str:
        resp = self.http.post("/generate", json={"text": "word " * 20_000, "sampling_params": {"max_new_tokens": 1}})
        return "" if resp.status_code == 400 else f"oversize prompt answered {resp.status_code}"

    def hostile(self) -> str:
        raw = self.rng.choice(HOSTILE)
        resp = self.http.post("/generate", content=raw.encode("utf-8", "surrogatepass"),
                              headers={"Content-Type": "application/json"})
        if not 400 <= resp.status_code < 500:
            return f"hostile request answered {resp.status_code}: {raw[:60]}"
        return ""


def _server_info(url: str, api_key: str | None, wait_idle: bool) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, timeout=30, headers=headers) as http:
        info: dict[str, Any] = http.get("/get_server_info").json()
        for _ in range(600 if wait_idle else 0):  # aborted requests finish within a step or two
            if info["idle"] and info["active_requests"] == 0:
                break
            time.sleep(0.1)
            info = http.get("/get_server_info").json()
    return info


def run_soak(url: str, duration_s: float, clients: int = 8, hostile_share: float = 0.15, seed: int = 0,
             server_pid: int | None = None, api_key: str | None = None, warmup_s: float = 0.0) -> SoakReport:
    """`warmup_s` of the same load first (checked too), then the server's RSS and compile count are taken,
    then `duration_s` more: growth after warm-up is what a long-running server would keep growing."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    start = time.monotonic()
    deadline = start + warmup_s + duration_s
    warm: dict[str, Any] = {"rss": None, "compiles": 0}

    def user(i: int) -> None:
        client = Client(url, random.Random(seed * 1000 + i), hostile_share, api_key)
        while time.monotonic() < deadline:
            outcome = client.one()
            with lock:
                outcomes.append(outcome)

    samples: list[tuple[float, int, float]] = []

    def sample_warm() -> None:
        time.sleep(warmup_s)
        warm["rss"] = rss_mb(server_pid) if server_pid else None
        warm["compiles"] = _server_info(url, api_key, wait_idle=False).get("compiles", 0)
        while server_pid and time.monotonic() < deadline:
            mb = rss_mb(server_pid)
            if mb is not None:
                samples.append((time.monotonic() - start, len(outcomes), mb))
            time.sleep(RSS_SAMPLE_S)

    threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(clients)]
    threads.append(threading.Thread(target=sample_warm, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(warmup_s + duration_s + 300)
    seconds = time.monotonic() - start
    info = _server_info(url, api_key, wait_idle=True)
    return SoakReport(seconds, outcomes, warm["rss"], rss_mb(server_pid) if server_pid else None,
                      warm["compiles"], info, samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="an existing server (default: launch one)")
    parser.add_argument("--pid", type=int, default=None, help="the existing server's pid, for its RSS")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds measured after the warm-up")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds of load before RSS is taken")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--hostile-share", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-gb", type=float, default=0.25)
    args = parser.parse_args(argv)
    if args.url:
        report = run_soak(args.url, args.duration, args.clients, args.hostile_share, args.seed, args.pid,
                          warmup_s=args.warmup)
    else:
        from jsgl.server.launch import launch_server_process

        with launch_server_process(kv_cache_gb=args.kv_cache_gb) as server:
            report = run_soak(server.url, args.duration, args.clients, args.hostile_share, args.seed,
                              server.proc.pid, warmup_s=args.warmup)
    print(report.summary())
    return 1 if report.failures or report.leaks() else 0


if __name__ == "__main__":
    raise SystemExit(main())
