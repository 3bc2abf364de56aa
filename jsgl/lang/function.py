"""`@function`: a Python function whose first argument is the program state `s`."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

from jsgl.lang.global_config import global_config
from jsgl.lang.ir import GEN_PARAM_NAMES, GenParams


def default_params(**params: Any) -> GenParams:
    """The program-wide sampling defaults that each gen() call may override: any SamplingParams field
    (max_new_tokens, temperature, stop, min_new_tokens, ...) plus return_text_in_logprobs."""
    unknown = set(params) - set(_PARAM_NAMES)
    if unknown:
        raise TypeError(f"unknown sampling parameters: {sorted(unknown)}")
    return GenParams(**params)


_PARAM_NAMES = tuple(name for name in GEN_PARAM_NAMES if name != "dtype")


def split_sampling_kwargs(kwargs: dict[str, Any]) -> tuple[GenParams, dict[str, Any]]:
    """Separate run()'s sampling keywords from the program's own arguments."""
    sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in _PARAM_NAMES}
    return default_params(**sampling), kwargs


class SglFunction:
    """A language-model program. Call `.run(...)`, `.run_batch([...])`, `.trace()` or `.compile()`."""

    def __init__(self, func: Callable[..., Any], num_api_spec_tokens: int | None = None,
                 bind_arguments: dict[str, Any] | None = None) -> None:
        self.func = func
        # API speculative execution: handed to each state for API backends (OpenAI); local backends ignore it.
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise TypeError(f"{func.__name__} must take the program state `s` as its first argument")
        self.arg_names = [p.name for p in params[1:]]
        self.arg_defaults = [p.default for p in params[1:] if p.default is not inspect.Parameter.empty]
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> SglFunction:
        """A copy with some arguments fixed."""
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"{self.__name__} has no arguments {sorted(unknown)}")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def run(self, *args: Any, stream: bool = False, backend: Any = None, **kwargs: Any) -> Any:
        """Run once. Sampling keywords (max_new_tokens, temperature, stop, top_p, ...) set the defaults of
        every gen(); the rest are the program's arguments. Returns the ProgramState."""
        from jsgl.lang.runner import run_program

        params, kwargs = split_sampling_kwargs(kwargs)
        return run_program(self, backend, args, kwargs, params, stream=stream)

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]] | list[tuple],
        *,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        **sampling: Any,
    ) -> list[Any] | Iterator[Any]:
        """Run once per input, concurrently (each input's errors stay in its own state). A compiled
        program (`.compile()`) has this same method, running its graph instead of the Python body."""
        from jsgl.lang.runner import run_program_batch

        params, rest = split_sampling_kwargs(dict(sampling))
        if rest:
            raise TypeError(f"unexpected keywords for run_batch: {sorted(rest)}")
        program, run_one = self._batch_runner()
        return run_program_batch(program, backend, batch_kwargs, params, num_threads, progress_bar, generator_style,
                                 run_one)

    def _batch_runner(self) -> tuple[SglFunction, Any]:
        """(the function whose arguments a batch binds, how to run one input; None: the interpreter)."""
        return self, None

    def trace(self, *, backend: Any = None, **kwargs: Any) -> Any:
        """Build the IR graph without running the model; unbound arguments become placeholders."""
        from jsgl.lang.tracer import trace_program

        return trace_program(self, kwargs, backend)

    def cache(self, backend: Any = None) -> str:
        """Send the program's constant prefix to the backend once (what run_batch does automatically)."""
        from jsgl.lang.runner import cache_program

        return cache_program(self, backend)

    def compile(self, *, backend: Any = None) -> Any:
        """Trace once and return a CompiledFunction that runs the graph with a graph executor."""
        from jsgl.lang.compiler import compile_func

        return compile_func(self, backend)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)

    def __repr__(self) -> str:
        return f"SglFunction({self.__name__})"


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """Decorator: `@function` or `@function(num_api_spec_tokens=...)`."""
    if func is not None:
        return SglFunction(func, num_api_spec_tokens)
    return lambda f: SglFunction(f, num_api_spec_tokens)


def get_default_backend() -> Any:
    return global_config.default_backend
