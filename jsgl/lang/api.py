"""The primitives a program appends to its state: gen, select, roles, and backend settings."""

from __future__ import annotations

import inspect
from typing import Any

from jsgl.lang.choices import ChoicesSamplingMethod, token_length_normalized
from jsgl.lang.global_config import global_config
from jsgl.lang.ir import (
    GEN_PARAM_NAMES,
    Expr,
    ExprList,
    Gen,
    GenParams,
    RoleBegin,
    RoleEnd,
    Select,
    SeparateReasoning,
    _as_expr,
    check_regex,
    dtype_name,
)


def set_default_backend(backend: Any) -> None:
    """Backend for programs run without backend= (a Runtime or any BaseBackend)."""
    global_config.default_backend = backend


def flush_cache(backend: Any = None) -> bool:
    backend = backend or global_config.default_backend
    if backend is None:
        return False
    getattr(backend, "endpoint", backend).flush_cache()
    return True


def get_server_info(backend: Any = None) -> dict[str, Any] | None:
    backend = backend or global_config.default_backend
    return None if backend is None else getattr(backend, "endpoint", backend).get_server_info()


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
    **sampling: Any,
) -> Expr:
    """Generate text into variable `name`; SGLang's signature (max_tokens -> max_new_tokens, min_tokens ->
    min_new_tokens). Unset parameters inherit run()'s. `dtype` (int, float, bool, str) and
    `regex`/`json_schema` constrain the output; `choices` turns this into a select(). `n` > 1: the variable
    is the list of n samples and the text continues with the first, as in SGLang. Other keywords are any
    further sampling parameter of the engine (repetition_penalty, logit_bias, sampling_seed, ebnf, ...)."""
    if choices:
        return Select(name, choices, 0.0 if temperature is None else temperature,
                      choices_method or token_length_normalized)
    check_regex(regex)
    for pattern in [stop_regex] if isinstance(stop_regex, str) else (stop_regex or []):
        check_regex(pattern, stop=True)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if dtype is not None:
        dtype_name(dtype)
    unknown = set(sampling) - _EXTRA_PARAMS
    if unknown:
        raise TypeError(f"gen() got unknown sampling parameters {sorted(unknown)}")
    return Gen(name, GenParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
        stop_regex=stop_regex, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
        return_logprob=return_logprob, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, dtype=dtype, regex=regex, json_schema=json_schema,
        **sampling,
    ))


# Sampling parameters gen() takes as extra keywords: the engine's that gen() has no named argument for
# (max_new_tokens/min_new_tokens are spelled max_tokens/min_tokens there, as in SGLang).
_EXTRA_PARAMS = frozenset(GEN_PARAM_NAMES) - set(inspect.signature(gen).parameters) - {
    "max_new_tokens", "min_new_tokens"}


def gen_int(name: str | None = None, max_tokens: int | None = None, n: int | None = None,
            stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
            stop_regex: str | list[str] | None = None, **kwargs: Any) -> Expr:
    """gen() constrained to an integer (SGLang's leading positional parameters; the rest by keyword)."""
    return gen(name, max_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids, stop_regex=stop_regex,
               dtype=int, **kwargs)


def gen_string(name: str | None = None, max_tokens: int | None = None, n: int | None = None,
               stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
               stop_regex: str | list[str] | None = None, **kwargs: Any) -> Expr:
    """gen() constrained to a double-quoted string of word characters and spaces."""
    return gen(name, max_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids, stop_regex=stop_regex,
               dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> Expr:
    """Append the choice the model scores best (all choices scored in one batch of prompt-logprob
    requests); temperature > 0 samples from softmax(score / temperature) instead."""
    if not choices:
        raise ValueError("select() needs a non-empty list of choices")
    return Select(name, list(choices), temperature, choices_method)


def image(expr: Any) -> Expr:
    """Not supported: jsgl serves text-only models, so this raises NotImplementedError."""
    raise NotImplementedError("jsgl serves text-only models: image inputs are not supported")


def video(path: str, num_frames: int) -> Expr:
    """Not supported: jsgl serves text-only models, so this raises NotImplementedError."""
    raise NotImplementedError("jsgl serves text-only models: video inputs are not supported")


def _role(role: str, expr: Expr | str | None) -> ExprList:
    if expr is None:
        return ExprList([RoleBegin(role), RoleEnd(role)])
    return ExprList([RoleBegin(role), _as_expr(expr), RoleEnd(role)])


def system(expr: Expr | str | None = None) -> ExprList:
    """A system message around `expr`, marked up with the model's chat template."""
    return _role("system", expr)


def user(expr: Expr | str | None = None) -> ExprList:
    """A user message around `expr`, marked up with the model's chat template."""
    return _role("user", expr)


def assistant(expr: Expr | str | None = None) -> ExprList:
    """An assistant message around `expr` (typically a gen), marked up with the chat template."""
    return _role("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")


def separate_reasoning(expr: Expr | None = None, model_type: str | None = None) -> Expr:
    """Run `expr` (a named gen/select, or a list holding them), then split each of its variables with the
    reasoning parser `model_type` ("deepseek-r1", "qwen3", ...; see jsgl.lang.reasoning): the variable
    keeps the answer, `<name>_reasoning_content` gets the reasoning, and the state's text keeps only the
    answer. In a streamed run the text stays as it was streamed (the variables are still split)."""
    if expr is None:
        raise ValueError("separate_reasoning needs the gen()/select() whose output it splits")
    expr = _as_expr(expr)
    return ExprList([expr, SeparateReasoning(model_type, expr)])
