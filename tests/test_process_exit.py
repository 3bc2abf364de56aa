"""A process that used jsgl exits 0, as a user's script does: no `shutdown()`, an engine left with its background
compile under way, a DSL program, Ctrl-C in the middle of a generate or a program (its requests end, their KV is
freed, the engine serves on), a server thread left serving. Each script runs as its own process, several times:
the failure this guards against (the interpreter tearing down a thread inside XLA at exit: `FATAL: exception not
rethrown`, status 134) came in 4 of 6 runs of the README's first program. The quick loop runs three of them once,
on a tiny checkpoint; the full suite runs the others twice, and the README's program on the default model."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.test_model_families import TINY

RUNS = 2  # runs of a script in the slow tests (the quick loop's run each once)
FATAL_MARKS = ("FATAL", "terminate called", "Traceback", "Segmentation fault", "core dumped")

PRELUDE = """
import gc, os, signal, sys, threading, time
import jsgl
MODEL = sys.argv[1]

def interrupt_when_running(engine):
    # Ctrl-C (SIGINT to this process) once a request is running: the main thread is waiting for it.
    def send():
        while engine.stats()["running_requests"] == 0:
            time.sleep(0.01)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=send, daemon=True).start()

def assert_released(engine):
    deadline = time.monotonic() + 30
    while not engine.idle():
        assert time.monotonic() < deadline, "the engine did not become idle"
        time.sleep(0.01)
    assert engine.allocator.num_free() + engine.prefix_cache.total_size() == engine.allocator.capacity

LONG = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}  # (longer than the wait for a Ctrl-C)
"""

SCRIPTS = {
    # The README's first program: no shutdown().
    "first_program": """
engine = jsgl.Engine(model=MODEL)
print(engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0}).text)
""",
    # One request, then exit while the background compiles the next shape of its plan (inside XLA: 6 of 6 runs
    # aborted so before the fix).
    "compile_in_flight": """
engine = jsgl.Engine(model=MODEL)
engine.generate("Hello", {"max_new_tokens": 2})
compiler, deadline = engine.runner.compiler, time.monotonic() + 60
while not compiler._compiling:
    assert time.monotonic() < deadline, "the background compiled nothing more"
    time.sleep(0.005)
time.sleep(0.5)  # past the trace, into XLA's compile
""",
    # A DSL program, then Ctrl-C in a generate and in a program, on one engine; each time the engine serves on.
    "interrupts": """
@jsgl.function
def qa(s, question):
    s += "Q: " + question + "\\nA:" + jsgl.gen("answer", max_tokens=8, temperature=0)
    s += " So it is " + jsgl.select("verdict", ["true", "false"])

@jsgl.function
def story(s):
    s += "Once upon a time" + jsgl.gen("story", max_tokens=400, ignore_eos=True, temperature=0)
    s += " The end." + jsgl.gen("coda", max_tokens=4)

runtime = jsgl.Runtime(model=MODEL)
engine = runtime.engine
jsgl.set_default_backend(runtime)
state = qa.run(question="Is the sky blue?")
print(state["answer"], state["verdict"])

interrupt_when_running(engine)
try:
    engine.generate(["Once upon a time", "In a galaxy far away"], LONG)
    raise AssertionError("generate was not interrupted")
except KeyboardInterrupt:
    pass
assert_released(engine)

interrupt_when_running(engine)
state = story.run()
try:
    state["coda"]
    raise AssertionError("the program was not interrupted")
except KeyboardInterrupt:
    pass
assert isinstance(state.error(), jsgl.ProgramInterrupted), state.error()
assert_released(engine)
assert engine.generate("Hello", {"max_new_tokens": 4, "ignore_eos": True}).completion_tokens == 4
""",
    # An engine served over HTTP from a thread, left serving at exit.
    "server_thread": """
import httpx
from jsgl.server.launch import ServerThread

server = ServerThread(jsgl.Engine(model=MODEL)).start()
body = {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
assert httpx.post(f"{server.url}/generate", json=body, timeout=120).status_code == 200
""",
    # An engine nobody holds any more stops its threads (it is collected: nothing of it keeps running).
    "collected": """
engine = jsgl.Engine(model=MODEL)
engine.generate("Hello", {"max_new_tokens": 2})
del engine
gc.collect()
deadline = time.monotonic() + 60
while any(t.name.startswith(("jsgl-engine", "jsgl-precompile")) for t in threading.enumerate()):
    assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
    time.sleep(0.05)
""",
}


def run_script(name: str, model: str, tmp_path, runs: int = 1) -> None:
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(PRELUDE) + textwrap.dedent(SCRIPTS[name]) + '\nprint("OK")\n')
    for attempt in range(runs):
        proc = subprocess.run([sys.executable, str(script), model], capture_output=True, text=True, timeout=300)
        fatal = [line for line in proc.stderr.splitlines() if any(mark in line for mark in FATAL_MARKS)]
        assert proc.returncode == 0 and not fatal and proc.stdout.rstrip().endswith("OK"), (
            f"{name}, run {attempt + 1}: exit status {proc.returncode}\n{proc.stderr[-3000:]}")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A tiny Llama of 16 layers: quick to load, its steps' compiles long enough to be caught in."""
    import torch
    import transformers as tf

    from jsgl.model.tokenizer import load_tokenizer

    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = tf.LlamaConfig(**{**TINY, "num_hidden_layers": 16, "max_position_embeddings": 1024})
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    load_tokenizer("smollm2-135m").save_pretrained(folder)
    return str(folder)


QUICK_SCRIPTS = ["collected", "compile_in_flight", "interrupts"]


@pytest.mark.parametrize("name", QUICK_SCRIPTS)
def test_script_exits_cleanly(name, tiny_model, tmp_path):
    run_script(name, tiny_model, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(SCRIPTS) - set(QUICK_SCRIPTS)))
def test_script_exits_cleanly_every_time(name, tiny_model, tmp_path):
    run_script(name, tiny_model, tmp_path, runs=RUNS)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "runs"), [("first_program", RUNS), ("interrupts", 1)])
def test_script_exits_cleanly_on_the_default_model(name, runs, tmp_path):
    run_script(name, "smollm2-135m", tmp_path, runs=runs)
