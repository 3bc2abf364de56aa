"""A build's time and memory limits hold inside the build (issue #41, item 3): a time-limited build ends
within 10% of its limit (in CPU seconds, what the limit counts), a memory-limited one never exceeds it, and
the process that ran it gives its memory back.

Before: `[一-龥]{0,999}` used 1.27 GB and 9.6 s of CPU (past 22 s of wall time on a busy host), and its
child process kept 350 MB afterwards; after the vocabulary walk, up to 2.5 s went by without a budget
check, and the parent killed a child only 5 s of CPU past its limit.
"""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import cache

import pytest

from jsgl.errors import ConstraintBudgetError
from jsgl.fsm import build_process, procfs
from jsgl.fsm.budget import BuildBudget, BuildGuard, BuildMemoryError
from jsgl.fsm.build_process import BuildProcess
from jsgl.fsm.regex_fsm import compile_regex
from jsgl.fsm.token_index import build_token_index
from jsgl.fsm.vocab import VocabBytes, vocab_bytes
from jsgl.model.tokenizer import load_tokenizer

MiB = 1 << 20
HEAVY = r"(\d{1,100}\.){1,99}"  # ~3.5 s of CPU, mostly in interegular
CJK = "[一-龥]{0,999}"  # ~9 ms a state in the byte FSM; grows to 1.27 GB
# How far past a memory limit a build may get: the guard reads the RSS every 5 ms of CPU (RSS_CHECK_S), and
# builds stopped within 1.1 MiB of 128-512 MiB limits; 4 MiB leaves room for a slower machine.
MEMORY_SLACK = 4 * MiB


@cache
def vocab() -> VocabBytes:
    return vocab_bytes(load_tokenizer("smollm2-135m"))


@pytest.fixture(scope="module")
def child() -> Iterator[BuildProcess]:
    proc = BuildProcess()
    build(proc, "(yes|no)")  # booted, and holding the vocabulary: later builds' CPU is their own
    yield proc
    proc.stop()


def build(proc: BuildProcess, regex: str, **budget: float) -> object:
    b = BuildBudget(**budget)  # type: ignore[arg-type]
    return proc.build(regex, vocab(), None, b, BuildGuard(b))


def idle_rss(proc: BuildProcess) -> int:
    build(proc, "(yes|no)")
    proc.ready()  # its "idle": the build's memory is freed and trimmed
    rss = procfs.rss_bytes(proc.pid)  # type: ignore[arg-type]
    assert rss is not None
    return rss


def tampered(proc: BuildProcess, monkeypatch: pytest.MonkeyPatch, **child_budget: float) -> None:
    """Tell the child a bigger budget than the parent holds it to: only the parent's backstop can stop it."""
    send = proc._send

    def send_tampered(message: tuple) -> None:
        if message[0] == "build":
            budget = dataclasses.replace(message[5], **child_budget)
            message = (*message[:5], budget, child_budget.get("max_build_seconds", message[6]), *message[7:])
        send(message)

    monkeypatch.setattr(proc, "_send", send_tampered)


class GapGuard(BuildGuard):
    """Records the longest stretch of CPU between two checks, and where it ended."""

    def __init__(self, budget: BuildBudget) -> None:
        super().__init__(budget, clock=time.process_time)
        self.last, self.longest = time.process_time(), 0.0

    def check(self) -> None:
        now = time.process_time()
        self.longest, self.last = max(self.longest, now - self.last), now
        super().check()


def test_every_phase_of_a_build_polls_the_guard() -> None:
    """The limits can only hold to ~10% if no stretch of a build goes unchecked: compile, byte FSM, the
    vocabulary walk and everything after it (liveness, masks, jump-forward) poll at least every 0.1 s of
    CPU, 1% of the default limit (measured: <= 25 ms). Before, after the walk of [\\s\\S]{1,160} 0.3 s went
    by unchecked (2.5 s for [^x]{0,999}), and 0.15 s freeing the byte FSM's memo of [一-龥]{0,200}
    (0.7 s for [一-龥]{0,999})."""
    budget, vb = BuildBudget(max_build_seconds=60), vocab()
    for regex in [r"[\s\S]{1,160}", "[一-龥]{0,200}"]:
        guard = GapGuard(budget)
        build_token_index(compile_regex(regex, guard), vb, None, guard)
        guard.check()  # the stretch from the last check to the end
        print(f"{regex}: longest unchecked stretch {guard.longest * 1e3:.0f} ms of CPU")
        assert guard.longest < 0.1, f"{regex}: {guard.longest:.3f} s of CPU without a budget check"


@pytest.mark.parametrize("regex", [HEAVY, CJK, r"[\s\S]{1,400}"], ids=["interegular", "byte-fsm", "walk"])
def test_time_limited_build_ends_within_10_percent(child: BuildProcess, regex: str) -> None:
    """CPU seconds (what the limit counts: wall time on a loaded 2-core host mostly measures waiting) from
    the request to the error, with the deadline falling in each phase of a build (measured: 1.00-1.01 s)."""
    limit = 1.0
    with pytest.raises(ConstraintBudgetError, match=r"time limit \(1 s\)"):
        build(child, regex, max_build_seconds=limit, max_index_bytes=1 << 40)
    stats = child.last
    assert stats is not None and stats.cpu_seconds is not None
    print(f"{regex}: {stats.cpu_seconds:.2f} s of CPU, {stats.wall_seconds:.2f} s wall, {stats.outcome}")
    assert stats.outcome == "error"  # the child's own guard answered, not the parent's kill
    assert stats.cpu_seconds <= 1.1 * limit


def test_parent_kills_a_child_past_its_time_limit(child: BuildProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backstop, for a child that does not stop itself (a loop without checks): killed 10% past the
    limit, give or take a poll (20 ms) and a /proc tick (10 ms). It was 5 s past."""
    tampered(child, monkeypatch, max_build_seconds=1e9)
    limit = 1.0
    with pytest.raises(ConstraintBudgetError, match=r"time limit \(1 s\)"):
        build(child, HEAVY + "x", max_build_seconds=limit)
    stats = child.last
    assert stats is not None and stats.cpu_seconds is not None
    print(f"killed after {stats.cpu_seconds:.2f} s of CPU, {stats.wall_seconds:.2f} s wall")
    assert stats.outcome == "killed: time"
    assert limit < stats.cpu_seconds <= 1.1 * limit + 0.05  # over the limit: the CPU backstop, not the wall one


@pytest.mark.parametrize("limit, cpu_kill, wall_kill", [(10.0, 11.0, 101.0), (1.0, 1.1, 10.1), (0.1, 0.15, 1.05)])
def test_the_parent_kills_10_percent_past_the_limit_and_never_sooner_than_the_minimum_grace(
        limit: float, cpu_kill: float, wall_kill: float) -> None:
    """The backstop's times (the tests above run 1 s limits, where 10% and the minimum grace are close): 10% past
    the limit however long it is, so a long build is not killed while its own check answers; at least
    GRACE_MIN_S past it for a short one (a /proc tick and a poll)."""
    assert build_process.kill_limits(limit) == pytest.approx((cpu_kill, wall_kill))


def test_memory_limited_build_never_exceeds_it_and_its_process_is_replaced(child: BuildProcess) -> None:
    """The build stops at the limit (its peak RSS, VmHWM reset when it started, is at most MEMORY_SLACK
    over), the error says which limit, and the process is replaced: its memory returns to the OS. Before,
    the child reached 1.27 GB on this pattern and kept 350 MB afterwards."""
    baseline = idle_rss(child)
    old_pid, replaced = child.pid, child.replacements
    limit = 192 * MiB
    with pytest.raises(BuildMemoryError, match=r"memory limit \(192 MiB\)"):
        build(child, CJK, max_build_memory_bytes=limit)
    stats = child.last
    assert stats is not None and stats.peak_rss is not None
    print(f"peak {stats.peak_rss / MiB:.1f} MiB for a {limit / MiB:.0f} MiB limit, after {stats.cpu_seconds:.2f} s")
    assert stats.outcome == "error"  # the child's guard answered
    assert limit - 16 * MiB < stats.peak_rss <= limit + MEMORY_SLACK
    assert child.replacements == replaced + 1 and child.pid != old_pid
    assert procfs.rss_bytes(old_pid) is None  # type: ignore[arg-type]
    after = idle_rss(child)
    print(f"idle RSS {baseline / MiB:.0f} MiB before, {after / MiB:.0f} MiB in the replacement")
    assert after <= baseline + 16 * MiB


def test_parent_kills_a_child_past_its_memory_limit(child: BuildProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backstop, for a child that does not stop itself: killed once its RSS is 10% over the limit (read
    every 20 ms: the walk grows ~10 MB in that time), and replaced."""
    tampered(child, monkeypatch, max_build_memory_bytes=1 << 40)
    limit = 160 * MiB
    replaced = child.replacements
    with pytest.raises(BuildMemoryError, match=r"memory limit \(160 MiB\)"):
        build(child, r"[\s\S]{1,399}", max_build_memory_bytes=limit, max_index_bytes=1 << 40)
    stats = child.last
    assert stats is not None and stats.peak_rss is not None
    print(f"killed at a peak of {stats.peak_rss / MiB:.1f} MiB")
    assert stats.outcome == "killed: memory" and child.replacements == replaced + 1
    assert stats.peak_rss <= 1.1 * limit + 32 * MiB


RLIMIT_CHILD = r"""
import pickle, sys, threading
from jsgl.fsm import budget, build_worker, procfs
budget.RSS_CHECK_S = 1e9  # the guard never reads the RSS: RLIMIT_DATA alone must stop the build
vb = pickle.load(sys.stdin.buffer)  # not the tokenizer (~270 MB): the process is sized like a build child
limit = 160 << 20
b = budget.BuildBudget(max_build_seconds=60, max_build_memory_bytes=limit, max_index_bytes=1 << 40)
kind, payload = build_worker._build(("build", r"[\s\S]{1,398}", "v", None, None, b, 60.0, None, 0),
                                    {"v": vb}, threading.Event())
print(kind, type(payload).__name__, payload, procfs.peak_rss_bytes() / limit)
"""


def test_data_rlimit_stops_what_the_guard_misses() -> None:
    """RLIMIT_DATA works beside the child's imports and turns an allocation past 10% over the limit into the
    memory error, however the build allocates."""
    run = subprocess.run([sys.executable, "-c", RLIMIT_CHILD], input=pickle.dumps(vocab()), capture_output=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr.decode()
    out = run.stdout.decode()
    print(out)
    kind, name, *rest = out.split()
    peak_fraction = float(rest[-1])
    assert (kind, name) == ("error", "BuildMemoryError") and "memory limit (160 MiB)" in out
    assert peak_fraction <= 1.1 + MEMORY_SLACK / (160 * MiB)


def test_a_child_that_keeps_memory_is_replaced(child: BuildProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a build the child trims its heap; still over its idle size by RETIRE_ABOVE_BYTES, it exits and
    the parent starts another. (Forced here with a negative threshold; a 1.2 GB build left 55 MiB trimmed.)"""
    idle_rss(child)
    pid, replaced = child.pid, child.replacements
    monkeypatch.setattr(build_process, "RETIRE_ABOVE_BYTES", -(1 << 40))
    build(child, "(maybe|so)")
    child.ready()
    assert child.replacements == replaced + 1 and child.pid != pid
    monkeypatch.undo()
    pid = child.pid
    idle_rss(child)  # the default threshold keeps a child after ordinary builds
    assert child.pid == pid
