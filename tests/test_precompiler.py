"""The background precompile's bookkeeping (jsgl.engine.precompiler.StepCompiler) on a runner whose compiles are
controlled by the test: the order, a request claiming a shape the background has not reached, a request waiting for
the shape the background is compiling, the pause while the engine steps, stop, and a failed compile."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from jsgl.engine.precompiler import BACKGROUND_THREAD, StepCompiler, compile_plan, order

DECODES = [(b, b, 1, 8192, -1) for b in (1, 2, 4, 8)]
EXTENDS = [(t, b, t, 8192, -1) for t in (16, 32) for b in (8,)] + [(32, 16, 32, 8192, -1)]
PLAN = DECODES + EXTENDS


class ControlledRunner:
    """Records which thread compiled what; a compile of a signature in ``hold`` blocks until it is released."""

    def __init__(self, fail: tuple | None = None):
        self.compiled: list[tuple[tuple, str]] = []
        self.padded: list[tuple] = []
        self.samplers: list[int] = []
        self.hold: dict[tuple, threading.Event] = {}
        self.started: dict[tuple, threading.Event] = {}
        self.fail = fail

    def compile_step(self, signature: tuple) -> SimpleNamespace:
        self.started.setdefault(signature, threading.Event()).set()
        if signature in self.hold:
            assert self.hold[signature].wait(10)
        self.compiled.append((signature, threading.current_thread().name))
        if signature == self.fail:
            raise RuntimeError("planted compile failure")
        return SimpleNamespace(signature=signature, out_info=(None, {"logits": "placed like a step's"}))

    def run_padding(self, signature: tuple, compiled: SimpleNamespace) -> None:
        self.padded.append(signature)

    def run_sampler(self, num_b: int, like: str) -> None:
        self.samplers.append(num_b)

    @staticmethod
    def step_shape(num_items: int, total_new: int, max_new: int, max_len: int, is_decode: bool) -> tuple:
        num_b = max(num_items, 1) if is_decode else max(num_items, 8)
        return num_b, num_b, 1, 8192


def test_order_is_small_batches_then_few_tokens():
    assert order(PLAN)[:5] == [*DECODES, (16, 8, 16, 8192, -1)]
    assert order(PLAN)[-1] == (32, 16, 32, 8192, -1)


def test_background_compiles_the_plan_once_each_with_samplers_and_then():
    runner = ControlledRunner()
    compiler = StepCompiler(runner)
    then = threading.Event()
    compiler.start_background(PLAN, then=then.set)
    assert compiler.wait(30)
    assert [s for s, _ in runner.compiled] == order(PLAN)
    assert {name for _, name in runner.compiled} == {BACKGROUND_THREAD}
    assert compiler.counts == {"start": 0, "background": len(PLAN), "request": 0} and compiler.compiles == len(PLAN)
    assert sorted(runner.samplers) == [1, 2, 4, 8, 16] and then.is_set()  # 16: the 16-request extend's bucket
    assert not runner.padded  # padding runs are the engine thread's, when idle
    assert compiler.warm_next() and runner.padded == [order(PLAN)[0]]
    while compiler.warm_next():
        pass
    assert sorted(runner.padded) == sorted(PLAN)  # all of at most 64 tokens
    assert compiler.background_s is not None


def test_a_request_claims_a_shape_not_reached_and_waits_for_one_in_progress():
    runner = ControlledRunner()
    compiler = StepCompiler(runner)
    in_progress = DECODES[1]
    runner.hold[in_progress] = threading.Event()
    compiler.start_background(PLAN)
    assert runner.started.setdefault(in_progress, threading.Event()).wait(10)
    # Not reached yet: compiled here, at once, on the request path.
    last = order(PLAN)[-1]
    assert compiler.executable(last).signature == last
    assert (last, threading.current_thread().name) in runner.compiled
    # Being compiled by the background: this request waits for that compile, and there is no second one.
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(compiler.executable(in_progress)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and not got
    runner.hold[in_progress].set()
    waiter.join(10)
    assert got[0].signature == in_progress
    assert compiler.wait(30)
    signatures = [s for s, _ in runner.compiled]
    assert sorted(signatures) == sorted(PLAN)  # each once
    assert compiler.counts == {"start": 0, "background": len(PLAN) - 1, "request": 1}
    assert compiler.executable((64, 64, 1, 8192, -1)) is None  # not planned: jit's


def test_the_background_pauses_while_the_engine_steps():
    runner = ControlledRunner()
    compiler = StepCompiler(runner)
    compiler.engine_busy(True)
    compiler.start_background(PLAN)
    time.sleep(0.3)
    assert not runner.compiled
    compiler.engine_busy(False)
    assert compiler.wait(30) and len(runner.compiled) == len(PLAN)


def test_stop_ends_the_background_after_the_shape_in_progress():
    runner = ControlledRunner()
    compiler = StepCompiler(runner)
    runner.hold[DECODES[0]] = threading.Event()
    compiler.start_background(PLAN)
    assert runner.started.setdefault(DECODES[0], threading.Event()).wait(10)
    threading.Timer(0.2, runner.hold[DECODES[0]].set).start()
    compiler.stop()
    assert compiler.wait(0) and [s for s, _ in runner.compiled] == [DECODES[0]]


def test_a_failed_background_compile_is_left_to_jit():
    runner = ControlledRunner(fail=DECODES[2])
    compiler = StepCompiler(runner)
    compiler.start_background(PLAN)
    assert compiler.wait(30)
    assert compiler.executable(DECODES[2]) is None  # dispatch then calls jit, which raises for that request
    compiler.count_jit(DECODES[2])
    assert compiler.counts["request"] == 1 and compiler.unplanned == 1
    assert compiler.counts["background"] == len(PLAN) - 1


def test_compile_all_compiles_before_returning_with_padding_runs():
    runner = ControlledRunner()
    compiler = StepCompiler(runner)
    compiler.compile_all(PLAN)
    assert compiler.counts["start"] == len(PLAN) and sorted(runner.padded) == sorted(PLAN)
    assert sorted(runner.samplers) == [1, 2, 4, 8, 16]
    assert not compiler.warm_next()  # nothing left for the idle engine


def test_the_background_skips_a_shape_the_request_path_is_compiling():
    runner = ControlledRunner()
    compiler = StepCompiler(runner)
    claimed = order(PLAN)[2]
    runner.hold[claimed] = threading.Event()
    compiler.engine_busy(True)  # the background waits while the request compiles
    compiler.start_background(PLAN)
    request = threading.Thread(target=compiler.executable, args=(claimed,))
    request.start()
    assert runner.started.setdefault(claimed, threading.Event()).wait(10)
    compiler.engine_busy(False)  # the background now passes the claimed shape while it is being compiled
    time.sleep(0.3)
    runner.hold[claimed].set()
    request.join(10)
    assert compiler.wait(30)
    assert sorted(s for s, _ in runner.compiled) == sorted(PLAN)  # each once
    assert compiler.counts == {"start": 0, "background": len(PLAN) - 1, "request": 1}


class StoredRunner(ControlledRunner):
    """A runner over a real executable store holding ``stored``: those load from it, and fail to run as one missing
    a kernel would (the donated pools lost with it); the others compile fresh (ControlledRunner)."""

    def __init__(self, store, stored: set[tuple]):
        super().__init__()
        self.store, self.kv_ok, self.resets = store, True, 0
        store.directory.mkdir(parents=True)
        for signature in stored:
            (store.directory / f"{signature}.bin").write_bytes(b"an executable")
        self.compiler = StepCompiler(self)

    def compile_step(self, signature: tuple) -> SimpleNamespace:
        if self.store is not None and self.store.holds(str(signature)):
            self.store.loaded += 1
            return SimpleNamespace(signature=signature, loaded=True, out_info=(None, {"logits": "placed"}))
        return SimpleNamespace(**vars(super().compile_step(signature)), loaded=False)

    def run_padding(self, signature: tuple, compiled: SimpleNamespace) -> None:
        if compiled.loaded:
            self.kv_ok = False
            raise RuntimeError("Function wrapped_slice.1 not found")
        super().run_padding(signature, compiled)

    def kv_intact(self) -> bool:
        return self.kv_ok

    def reset_kv(self) -> None:
        self.kv_ok, self.resets = True, self.resets + 1


def test_a_stored_executable_that_fails_to_run_leaves_none_from_the_store(tmp_path):
    """compile_plan's fallback: the store is removed, and the plan compiles afresh through a new compiler on intact
    pools: no executable loaded from the store is left to serve (the old compiler holds them, the failed one too)."""
    from jsgl.engine.executable_store import ExecutableStore

    store = ExecutableStore("config", root=tmp_path)
    runner = StoredRunner(store, stored=set(DECODES[1:3]))
    compile_plan(runner, PLAN)
    assert runner.store is None and not store.directory.exists()
    assert not [s for s, compiled in runner.compiler.executables.items() if compiled.loaded]
    assert sorted(runner.compiler.executables) == sorted(PLAN)
    assert runner.kv_intact() and runner.resets == 1
    assert set(runner.padded) == set(PLAN)  # every shape ran on padding, fresh (a loaded one raises there)


def test_a_failure_with_nothing_loaded_from_the_store_is_raised(tmp_path):
    from jsgl.engine.executable_store import ExecutableStore

    runner = StoredRunner(ExecutableStore("config", root=tmp_path), stored=set())
    runner.fail = DECODES[0]
    with pytest.raises(RuntimeError, match="planted compile failure"):
        compile_plan(runner, PLAN)
    assert runner.store is not None  # kept: nothing it held failed
