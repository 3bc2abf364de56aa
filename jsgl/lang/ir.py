"""The intermediate representation: the nodes a program appends to its state (paper §2, App. D).

The interpreter executes these nodes one by one on a state's stream; the tracer records them (with the
links `prev_node` along a stream and `source` across streams) to build a graph for the compiler.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import typing
from typing import Any, Optional

from jsgl.engine.sampling_params import SamplingParams

# Regexes behind gen(dtype=...). The trailing blanks of the number forms let the model end the number; the
# matching stop strings (" ", "\n") then trim them from the value.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

_DTYPE_REGEX: dict[str, tuple[str, list[str]]] = {
    "int": (REGEX_INT, [" ", "\n"]),
    "float": (REGEX_FLOAT, [" ", "\n"]),
    "bool": (REGEX_BOOL, []),
    "str": (REGEX_STR, []),
}


def dtype_name(dtype: type | str) -> str:
    name = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", str(dtype))
    if name not in _DTYPE_REGEX:
        raise ValueError(f"unsupported dtype {dtype!r}: use int, float, bool or str")
    return name


def _merged_over(self: Any, defaults: Any) -> Any:
    """These values where set, else the defaults' (gen() overrides run())."""
    out = dataclasses.replace(defaults)
    for f in dataclasses.fields(self):
        value = getattr(self, f.name)
        if value is not None:
            setattr(out, f.name, value)
    return out


def _to_engine_kwargs(self: Any) -> dict[str, Any]:
    """The engine's SamplingParams fields that are set (the rest keep the engine's defaults); dtype
    becomes a regex plus stop strings, as in SGLang."""
    out = {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}
    out.setdefault("max_new_tokens", SamplingParams.max_new_tokens)  # API backends need a number
    if self.dtype is not None:
        regex, extra_stop = _DTYPE_REGEX[dtype_name(self.dtype)]
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        out["regex"] = regex
        out["stop"] = stop + [s for s in extra_stop if s not in stop]
    if out.get("stop_token_ids") is not None:
        out["stop_token_ids"] = list(out["stop_token_ids"])
    return out


SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_HINTS = typing.get_type_hints(SamplingParams)
# Sampling parameters as the frontend sees them: the engine's SamplingParams with every field optional
# (None: not set here, inherit the default), plus what only the frontend reads. Derived, so a parameter
# added to SamplingParams reaches gen()/run() without being written again.
GenParams = dataclasses.make_dataclass(
    "GenParams",
    [(name, Optional[_HINTS[name]], dataclasses.field(default=None)) for name in SAMPLING_FIELDS]  # noqa: UP045
    + [("return_text_in_logprobs", Optional[bool], dataclasses.field(default=None)),  # noqa: UP045
       ("dtype", Any, dataclasses.field(default=None))],
    namespace={"merged_over": _merged_over, "to_engine_kwargs": _to_engine_kwargs, "__module__": __name__},
)
GEN_PARAM_NAMES = tuple(f.name for f in dataclasses.fields(GenParams))


class Expr:
    """A node. `+` with text or another node makes an ExprList, so `"A:" + gen("x")` is one append."""

    _ids = itertools.count()

    def __init__(self) -> None:
        self.node_id = next(Expr._ids)
        self.prev_node: Expr | None = None  # the node before this one on the same stream (tracing only)
        self.pid: Any = None  # the stream (traced state) the node was appended to

    def __add__(self, other: Expr | str) -> ExprList:
        return _concat(self, _as_expr(other))

    def __radd__(self, other: Expr | str) -> ExprList:
        return _concat(_as_expr(other), self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _as_expr(value: Any) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return ConstantText(value)
    raise TypeError(f"cannot append {type(value).__name__} to a program; convert it with str() first")


def _concat(a: Expr, b: Expr) -> ExprList:
    left = a.expr_list if isinstance(a, ExprList) else [a]
    right = b.expr_list if isinstance(b, ExprList) else [b]
    return ExprList(left + right)


class ExprList(Expr):
    def __init__(self, expr_list: list[Expr]) -> None:
        super().__init__()
        self.expr_list = expr_list

    def __repr__(self) -> str:
        return f"ExprList({self.expr_list})"


class ConstantText(Expr):
    def __init__(self, value: str) -> None:
        super().__init__()
        self.value = value

    def __repr__(self) -> str:
        return f"Constant({self.value!r})"


class Argument(Expr):
    """A program argument left unbound while tracing (its value arrives at run time)."""

    def __init__(self, name: str, value: Any = None) -> None:
        super().__init__()
        self.name = name
        self.value = value

    def __format__(self, spec: str) -> str:
        # An f-string would bake the placeholder into constant text, silently breaking the graph.
        raise TypeError(f"argument {self.name!r} cannot go in an f-string in a traced program; use +")

    def __repr__(self) -> str:
        return f"Argument({self.name!r})"


class Gen(Expr):
    def __init__(self, name: str | None, params: GenParams) -> None:
        super().__init__()
        self.name = name
        self.sampling_params = params

    def __repr__(self) -> str:
        return f"Gen({self.name!r})"


class Select(Expr):
    def __init__(self, name: str | None, choices: list[str], temperature: float, choices_method: Any) -> None:
        super().__init__()
        self.name = name
        self.choices = [str(c) for c in choices]
        self.temperature = temperature
        self.choices_method = choices_method

    def __repr__(self) -> str:
        return f"Select({self.name!r}, choices={self.choices})"


class RoleBegin(Expr):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def __repr__(self) -> str:
        return f"RoleBegin({self.role})"


class RoleEnd(Expr):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def __repr__(self) -> str:
        return f"RoleEnd({self.role})"


class Variable(Expr):
    """The value of variable `name` of another node's stream, appended as text when it is ready."""

    def __init__(self, name: str, source: Any = None) -> None:
        super().__init__()
        self.name = name
        # Tracing: the Gen/Select (or scope end) node that defines it. Running: the StreamExecutor owning it.
        self.source = source

    def __repr__(self) -> str:
        src = getattr(self.source, "node_id", None)
        return f"Variable({self.name!r}, source=%{src})"


class VarScopeBegin(Expr):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def __repr__(self) -> str:
        return f"VarScopeBegin({self.name!r})"


class VarScopeEnd(Expr):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def __repr__(self) -> str:
        return f"VarScopeEnd({self.name!r})"


class Fork(Expr):
    def __init__(self, number: int) -> None:
        super().__init__()
        self.number = number

    def __repr__(self) -> str:
        return f"Fork(number={self.number})"


class GetForkItem(Expr):
    def __init__(self, fork: Fork, index: int) -> None:
        super().__init__()
        self.fork = fork
        self.index = index

    def __repr__(self) -> str:
        return f"GetForkItem(%{self.fork.node_id}, index={self.index})"


class Join(Expr):
    """Joining forked branches back into their parent (tracing: depends on each branch's last node)."""

    def __init__(self, mode: str, sources: list[Any]) -> None:
        super().__init__()
        self.mode = mode
        self.sources = sources

    def __repr__(self) -> str:
        ids = [getattr(s, "node_id", None) for s in self.sources]
        return f"Join({self.mode}, sources={['%' + str(i) for i in ids]})"


class ConcatenateAndAppend(Expr):
    """Append each forked branch's new text to the parent, in branch order (join mode concate_and_append)."""

    def __init__(self, states: list[Any]) -> None:
        super().__init__()
        self.states = states


class SeparateReasoning(Expr):
    """After `expr` (a gen/select, or a list of them) ran: split each of its variables into the answer
    (the variable) and the reasoning (`<name>_reasoning_content`), with the parser `model_type`."""

    def __init__(self, model_type: str | None, expr: Expr) -> None:
        super().__init__()
        from jsgl.lang.reasoning import ReasoningParser

        self.model_type = model_type
        self.parser = ReasoningParser(model_type)  # an unknown name fails at the call, not mid-program
        self.expr = expr
        self.targets = _named_outputs(expr)  # the variables it splits
        if not self.targets:
            raise ValueError("separate_reasoning needs a named gen() or select() (its variable is split)")
        self.name = reasoning_var(self.targets[-1])  # as SGLang: the last one's reasoning variable

    @property
    def reasoning_names(self) -> list[str]:
        return [reasoning_var(t) for t in self.targets]

    def __repr__(self) -> str:
        return f"SeparateReasoning(model_type={self.model_type!r}, targets={self.targets})"


def reasoning_var(name: str) -> str:
    return f"{name}_reasoning_content"


def _named_outputs(expr: Expr) -> list[str]:
    if isinstance(expr, (Gen, Select)):
        if not expr.name:
            raise ValueError("separate_reasoning needs the gen()/select() to have a name")
        return [expr.name]
    if isinstance(expr, ExprList):
        return [name for e in expr.expr_list for name in _named_outputs(e)]
    return []


class CommitLazy(Expr):
    """Send the text so far to the backend (a max_new_tokens=0 request): the prefix hint before a fork."""


class Image(Expr):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path


class Video(Expr):
    def __init__(self, path: str, num_frames: int) -> None:
        super().__init__()
        self.path = path
        self.num_frames = num_frames


def check_regex(regex: str | None, stop: bool = False) -> None:
    """Fail at the gen() call, where the user can see which one. Stop regexes are searched with the
    `regex` module (as the engine does), which accepts a superset of `re`."""
    if regex is not None:
        if stop:
            import regex as regex_module

            regex_module.compile(regex)
        else:
            re.compile(regex)
