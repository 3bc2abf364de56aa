"""Running a program once, or over a batch of inputs on a thread pool."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import tqdm

from jsgl.lang.global_config import global_config
from jsgl.lang.interpreter import StreamExecutor
from jsgl.lang.ir import GenParams
from jsgl.lang.state import ProgramState


def resolve_backend(backend: Any) -> Any:
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        raise ValueError("no backend: pass backend=... or call jsgl.set_default_backend(jsgl.Runtime(...))")
    # A Runtime wraps its backend in `.endpoint` (as in SGLang), so either may be passed.
    return getattr(backend, "endpoint", backend)


def _run_body(state: ProgramState, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
              sync: bool, catch_errors: bool) -> None:
    exe = state.stream_executor
    try:
        state.ret_value = func(state, *args, **kwargs)
    except Exception as exc:
        exe.record_error(exc)
        if not catch_errors:
            raise
    except BaseException:  # a Ctrl-C in the body: its requests end, the nodes it queued are skipped
        exe.interrupt()
        raise
    finally:
        exe.end()
        if sync:
            exe.sync()
    if global_config.verbosity >= 2:
        print(state.text())


def run_program(
    program: Any,
    backend: Any,
    args: tuple,
    kwargs: dict[str, Any],
    default_params: GenParams,
    stream: bool = False,
    sync: bool = False,
    catch_errors: bool = False,
) -> ProgramState:
    """Start `program` on a new state. Returns once the Python body has run (its gens may still be going),
    or at once when streaming (the body then runs on its own thread and errors go to `state.error()`)."""
    backend = resolve_backend(backend)
    kwargs = {**kwargs, **program.bind_arguments}
    exe = StreamExecutor(backend, kwargs, default_params, stream=stream)
    exe.num_api_spec_tokens = program.num_api_spec_tokens
    state = ProgramState(exe)
    if stream:
        threading.Thread(target=_run_body, args=(state, program.func, args, kwargs, sync, True),
                         daemon=True).start()
    else:
        _run_body(state, program.func, args, kwargs, sync, catch_errors)
    return state


def cache_program(program: Any, backend: Any) -> str:
    """Batch prefix hint: the constant text every input starts with, found by tracing, sent once."""
    from jsgl.lang.tracer import extract_prefix_by_tracing

    backend = resolve_backend(backend)
    prefix = extract_prefix_by_tracing(program, backend)
    if len(prefix) >= global_config.prefix_hint_min_chars:
        try:
            backend.cache_prefix(prefix)
        except Exception as exc:
            warnings.warn(f"batch prefix hint failed: {exc!r}", stacklevel=2)
    return prefix


def normalize_batch(program: Any, batch: list | tuple) -> list[dict[str, Any]]:
    """Accept a list of kwargs dicts or of positional argument tuples."""
    if not isinstance(batch, (list, tuple)):
        raise TypeError("run_batch takes a list of argument dicts (or tuples)")
    out = []
    for item in batch:
        if isinstance(item, dict):
            out.append(item)
        elif isinstance(item, (list, tuple)) and len(item) <= len(program.arg_names):
            out.append(dict(zip(program.arg_names, item, strict=False)))
        else:
            raise TypeError(f"batch item {item!r} does not fit the signature {program.arg_names}")
    return out


def num_workers(num_threads: int | str, n: int) -> int:
    if not global_config.enable_parallelism:
        return 1
    if num_threads == "auto":
        num_threads = global_config.batch_threads_auto
    return max(1, min(int(num_threads), n))


def run_batch_with(
    run_one: Callable[[dict[str, Any]], ProgramState],
    batch: list[dict[str, Any]],
    num_threads: int,
    progress_bar: bool,
    generator_style: bool = False,
) -> list[ProgramState] | Iterator[ProgramState]:
    """Run `run_one` over the batch on `num_threads` threads; states come back in input order."""
    if generator_style:
        return _run_batch_iter(run_one, batch, num_threads, progress_bar)
    bar = tqdm.tqdm(total=len(batch), disable=not progress_bar, desc="run_batch")
    try:
        if num_threads == 1:
            states = []
            for kwargs in batch:
                states.append(run_one(kwargs))
                bar.update()
            return states
        with ThreadPoolExecutor(num_threads, thread_name_prefix="jsgl-batch") as pool:
            futures = [pool.submit(run_one, kwargs) for kwargs in batch]
            for f in futures:
                f.add_done_callback(lambda _: bar.update())
            return [f.result() for f in futures]
    finally:
        bar.close()


def _run_batch_iter(run_one: Callable[[dict[str, Any]], ProgramState], batch: list[dict[str, Any]],
                    num_threads: int, progress_bar: bool) -> Iterator[ProgramState]:
    bar = tqdm.tqdm(total=len(batch), disable=not progress_bar, desc="run_batch")
    try:
        with ThreadPoolExecutor(num_threads, thread_name_prefix="jsgl-batch") as pool:
            # Submit in windows so results can be yielded before the whole batch is queued.
            window = max(1, 4 * num_threads)
            for start in range(0, len(batch), window):
                futures = [pool.submit(run_one, kwargs) for kwargs in batch[start:start + window]]
                for f in futures:
                    yield f.result()
                    bar.update()
    finally:
        bar.close()


def run_program_batch(
    program: Any,
    backend: Any,
    batch: list | tuple,
    default_params: GenParams,
    num_threads: int | str = "auto",
    progress_bar: bool = False,
    generator_style: bool = False,
    run_one: Callable[[Any, dict[str, Any], GenParams], ProgramState] | None = None,
) -> list[ProgramState] | Iterator[ProgramState]:
    """Run the program once per input. A failing input fails only its own state (see `state.error()`).
    ``run_one(backend, kwargs, params)`` runs one input to completion (default: the interpreter)."""
    batch = normalize_batch(program, batch)
    if not batch:
        return []
    backend = resolve_backend(backend)
    if global_config.enable_prefix_hint and global_config.enable_precache_with_tracing and len(batch) > 1:
        cache_program(program, backend)
    if run_one is None:
        def run_one(backend: Any, kwargs: dict[str, Any], params: GenParams) -> ProgramState:
            return run_program(program, backend, (), kwargs, params, sync=True, catch_errors=True)

    return run_batch_with(lambda kwargs: run_one(backend, kwargs, default_params), batch,
                          num_workers(num_threads, len(batch)), progress_bar, generator_style)
