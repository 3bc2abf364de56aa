"""Tracing: run the program's Python body against a recording state to get its IR graph, no model needed.

Each traced state keeps its nodes in order (`prev_node` links them); `s["x"]` returns a Variable node
pointing at the node that defines x (possibly on another state); fork adds a Fork node and gives each
branch a GetForkItem first node; join adds a Join node that depends on every branch's last node.
Python control flow that depends on generated values cannot be traced.
"""

from __future__ import annotations

import uuid
from typing import Any

from jsgl.lang.chat_template import ChatTemplate
from jsgl.lang.ir import (
    Argument,
    ConstantText,
    Expr,
    ExprList,
    Fork,
    Gen,
    GetForkItem,
    Join,
    RoleBegin,
    RoleEnd,
    Select,
    SeparateReasoning,
    Variable,
    VarScopeEnd,
    _as_expr,
)
from jsgl.lang.state import JOIN_MODES, ForkedStates, ProgramState


class StopTracing(Exception):
    """Prefix tracing reached the first node that is not constant text."""


class _Arg(Argument):
    """An unbound argument: usable with `+`, but not convertible to text (that would fake a constant)."""

    def __str__(self) -> str:
        raise TypeError(f"argument {self.name!r} cannot be converted with str() in a traced program")



class TracerProgramState(ProgramState):
    """A ProgramState that records nodes instead of executing them."""

    def __init__(self, backend: Any, arguments: dict[str, Any], only_trace_prefix: bool = False) -> None:
        # No stream executor: ProgramState methods that need one are overridden below.
        self.stream_executor = None
        self.pid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = arguments
        self.only_trace_prefix = only_trace_prefix
        self.nodes: list[Expr] = []
        self.last_node: Expr | None = None
        self.variables: dict[str, Any] = {}
        self.messages_: list[dict[str, str]] = []
        self.cur_role: str | None = None
        self.chat_template: ChatTemplate = backend.get_chat_template() if backend is not None else ChatTemplate()
        self.child_states: list[TracerProgramState] = []
        self.ret_value: Any = None

    # Recording -----------------------------------------------------------------------------------------

    def _append(self, node: Expr) -> None:
        node.pid = self.pid
        node.prev_node = self.last_node
        self.nodes.append(node)
        self.last_node = node

    def __iadd__(self, other: Expr | str) -> TracerProgramState:
        self._record(_as_expr(other))
        return self

    def _record(self, expr: Expr) -> None:
        if isinstance(expr, ExprList):
            for e in expr.expr_list:
                self._record(e)
            return
        if self.only_trace_prefix and not isinstance(expr, (ConstantText, RoleBegin, RoleEnd)):
            raise StopTracing
        if isinstance(expr, (Gen, Select)):
            name = expr.name if expr.name is not None else f"{type(expr).__name__.lower()}_{len(self.variables)}"
            self._append(expr)
            self.variables[name] = expr
        elif isinstance(expr, VarScopeEnd):
            self._append(expr)
            self.variables[expr.name] = expr
        elif isinstance(expr, SeparateReasoning):
            self._append(expr)  # the split variables are defined (final) by this node
            for name in [*expr.targets, *expr.reasoning_names]:
                self.variables[name] = expr
        elif isinstance(expr, RoleBegin):
            default_system = self.chat_template.default_system_prompt
            if not self.messages_ and expr.role != "system" and default_system:
                for node in (RoleBegin("system"), ConstantText(default_system), RoleEnd("system")):
                    self._record(node)
            self.cur_role = expr.role
            self._append(expr)
        elif isinstance(expr, RoleEnd):
            self._append(expr)
            self.messages_.append({"role": expr.role, "content": ""})
            self.cur_role = None
        else:
            self._append(expr)

    # ProgramState API ----------------------------------------------------------------------------------

    def fork(self, size: int = 1, position_ids_offset: list[int] | None = None) -> ForkedStates:
        if self.only_trace_prefix:
            raise StopTracing
        fork = Fork(int(size))
        self._append(fork)
        states = []
        for i in range(int(size)):
            child = TracerProgramState(self.backend, self.arguments, False)
            child._append(GetForkItem(fork, i))
            child.variables = dict(self.variables)
            child.messages_ = list(self.messages_)
            child.cur_role = self.cur_role
            child.inherited = set(self.variables)
            states.append(child)
            self.child_states.append(child)
        return ForkedStates(states, self)

    def _join(self, states: list[Any], mode: str) -> None:
        if mode not in JOIN_MODES:
            raise ValueError(f"unknown join mode {mode!r}")
        self._append(Join(mode, [st.last_node for st in states]))
        if mode == "gather_variable":
            existing = set(self.variables)
            for st in states:
                for name, source in st.variables.items():
                    if name not in st.inherited and name not in existing:
                        self.variables.setdefault(name, []).append(source)

    def get_var(self, name: Any) -> Any:
        if name in self.arguments:
            return self.arguments[name]
        source = self.variables[name]
        if isinstance(source, list):
            return [Variable(name, s) for s in source]
        return Variable(name, source)

    def set_var(self, name: Any, value: Any) -> None:
        raise TypeError("set_var cannot be traced")

    def text(self) -> str:
        raise TypeError("s.text() cannot be traced: the text is not known before running")

    def messages(self) -> list[dict[str, Any]]:
        return self.messages_

    def sync(self) -> None:
        pass

    def error(self) -> BaseException | None:
        return None

    def __contains__(self, name: Any) -> bool:
        return name in self.variables

    def __del__(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"TracerProgramState({len(self.nodes)} nodes, {len(self.child_states)} branches)"

    # Inspection ----------------------------------------------------------------------------------------

    def all_states(self) -> list[TracerProgramState]:
        out = [self]
        for child in self.child_states:
            out.extend(child.all_states())
        return out

    def all_nodes(self) -> list[Expr]:
        return [node for st in self.all_states() for node in st.nodes]

    def count_nodes(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for node in self.all_nodes():
            key = "Argument" if isinstance(node, Argument) else type(node).__name__
            counts[key] = counts.get(key, 0) + 1
        return counts

    def flatten_nodes(self) -> list[Expr]:
        return list(self.nodes)

    def print_graph(self) -> str:
        lines = []
        for k, st in enumerate(self.all_states()):
            for node in st.nodes:
                prev = f"%{node.prev_node.node_id} + " if node.prev_node is not None else ""
                lines.append(f"state {k:2d}: %{node.node_id} = {prev}{node!r}")
        text = "\n".join(lines)
        print(text)
        return text


TracerProgramState.inherited = frozenset()  # the root state inherits no variables


def trace_program(program: Any, arguments: dict[str, Any], backend: Any) -> TracerProgramState:
    from jsgl.lang.global_config import global_config

    backend = backend if backend is not None else global_config.default_backend
    backend = getattr(backend, "endpoint", backend)
    args = {name: _Arg(name) for name in program.arg_names if name not in arguments}
    args.update(arguments)
    args.update(program.bind_arguments)
    tracer = TracerProgramState(backend, args)
    tracer.ret_value = program.func(tracer, **args)
    return tracer


def extract_prefix_by_tracing(program: Any, backend: Any) -> str:
    """The text every run of the program starts with: its leading constants and role markers."""
    args = {name: _Arg(name) for name in program.arg_names}
    args.update(program.bind_arguments)
    tracer = TracerProgramState(backend, args, only_trace_prefix=True)
    try:
        program.func(tracer, **args)
    except Exception:  # StopTracing, or Python code that needs real values: the prefix so far stands
        pass
    template = tracer.chat_template
    text, messages, suffix = "", [], ""
    for node in tracer.nodes:
        if isinstance(node, ConstantText):
            text += node.value
        elif isinstance(node, RoleBegin):
            prefix, suffix = template.get_prefix_and_suffix(node.role, messages)
            text += prefix
        elif isinstance(node, RoleEnd):
            text += suffix
            messages.append({"role": node.role, "content": ""})
        else:
            break
    return text
