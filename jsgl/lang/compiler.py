"""Compiler mode: trace a program once, then run its graph with a graph executor.

The graph's nodes are those of every traced state; edges are the stream order (`prev_node`), variable
reads (Variable -> the node defining it), fork items (GetForkItem -> Fork) and joins (Join -> each branch's
last node). Running submits the nodes in topological order, each to the executor of its own stream, so the
streams run concurrently exactly as in the interpreter, without re-running the Python body.
"""

from __future__ import annotations

import heapq
import inspect
import threading
from typing import Any

from jsgl.lang.function import SglFunction, split_sampling_kwargs
from jsgl.lang.global_config import global_config
from jsgl.lang.interpreter import ExecutableNode, StreamExecutor
from jsgl.lang.ir import Argument, ConstantText, Expr, Fork, GenParams, GetForkItem, Join, Variable
from jsgl.lang.runner import resolve_backend
from jsgl.lang.state import ProgramState


class _ForkPoint(ExecutableNode):
    """Runs on the parent stream: snapshots the state for the branches (after the prefix hint)."""

    def __init__(self, number: int) -> None:
        super().__init__()
        self.number = number
        self.ready = threading.Event()
        self.snap: dict[str, Any] | None = None

    def execute(self, exe: StreamExecutor) -> None:
        if self.number > 1 and exe.text_ and global_config.enable_prefix_hint:
            exe._prefix_hint()
        self.snap = exe.snapshot()
        self.ready.set()

    def skip(self, exe: StreamExecutor) -> None:
        self.snap = exe.snapshot()  # carries the error into the branches
        self.ready.set()


class _ForkStart(ExecutableNode):
    """First node of a branch: start from the parent's snapshot."""

    def __init__(self, point: _ForkPoint) -> None:
        super().__init__()
        self.point = point

    def execute(self, exe: StreamExecutor) -> None:
        self.point.ready.wait()
        exe.copy_state_from(self.point.snap)


class _Mark(ExecutableNode):
    """Queued on a branch when its join is submitted: set once the branch has run everything before it."""

    def __init__(self) -> None:
        super().__init__()
        self.reached = threading.Event()

    def execute(self, exe: StreamExecutor) -> None:
        self.reached.set()

    skip = execute


class _JoinPoint(ExecutableNode):
    def __init__(self, mode: str, children: list[StreamExecutor], marks: list[_Mark]) -> None:
        super().__init__()
        self.mode, self.children, self.marks = mode, children, marks

    def execute(self, exe: StreamExecutor) -> None:
        for mark in self.marks:
            mark.reached.wait()
        if self.mode == "gather_variable":
            exe.gather_from(self.children, wait=False)
        else:
            exe.append_branches(self.children, wait=False)


def _deps(node: Expr) -> list[Expr]:
    deps = [node.prev_node] if node.prev_node is not None else []
    if isinstance(node, Variable) and isinstance(node.source, Expr):
        deps.append(node.source)
    elif isinstance(node, GetForkItem):
        deps.append(node.fork)
    elif isinstance(node, Join):
        deps.extend(s for s in node.sources if s is not None)
    return deps


class CompiledFunction:
    """A traced program as a dataflow graph; `.run()` / `.run_batch()` like the function itself."""

    def __init__(self, tracer: Any, function: Any) -> None:
        self.function = function
        self.tracer = tracer
        nodes = tracer.all_nodes()
        self.nodes = self._topological_order(nodes)
        # Streams numbered in order of first appearance; the program's own state is stream 0.
        self.stream_of: dict[int, int] = {}
        pids = {tracer.pid: 0}
        for node in self.nodes:
            pids.setdefault(node.pid, len(pids))
            self.stream_of[node.node_id] = pids[node.pid]
        self.num_streams = len(pids)
        sig = inspect.signature(function.func)
        self.arg_defaults = {
            p.name: p.default for p in list(sig.parameters.values())[1:] if p.default is not inspect.Parameter.empty
        }

    @staticmethod
    def _topological_order(nodes: list[Expr]) -> list[Expr]:
        known = {n.node_id: n for n in nodes}
        indegree = {n.node_id: 0 for n in nodes}
        users: dict[int, list[int]] = {n.node_id: [] for n in nodes}
        for n in nodes:
            for d in _deps(n):
                if d.node_id not in known:
                    raise ValueError(f"{n!r} depends on {d!r}, which is not in the traced program")
                indegree[n.node_id] += 1
                users[d.node_id].append(n.node_id)
        ready = [i for i, k in indegree.items() if k == 0]
        heapq.heapify(ready)  # lowest node id first: a stable order close to the program's own
        order = []
        while ready:
            i = heapq.heappop(ready)
            order.append(known[i])
            for u in users[i]:
                indegree[u] -= 1
                if indegree[u] == 0:
                    heapq.heappush(ready, u)
        if len(order) != len(nodes):
            raise ValueError("the traced program has a dependency cycle")
        return order

    def print_graph(self) -> str:
        lines = []
        for node in self.nodes:
            prev = f"%{node.prev_node.node_id} + " if node.prev_node is not None else ""
            lines.append(f"stream {self.stream_of[node.node_id]:2d}: %{node.node_id} = {prev}{node!r}")
        text = "\n".join(lines)
        print(text)
        return text

    def _argument(self, node: Argument, kwargs: dict[str, Any]) -> str:
        if node.name in kwargs:
            return str(kwargs[node.name])
        if node.name in self.arg_defaults:
            return str(self.arg_defaults[node.name])
        raise TypeError(f"{self.function.__name__}() missing argument {node.name!r}")

    def run_internal(self, backend: Any, kwargs: dict[str, Any], params: GenParams) -> ProgramState:
        kwargs = {**kwargs, **self.function.bind_arguments}
        exes = [StreamExecutor(backend, kwargs, params) for _ in range(self.num_streams)]
        points: dict[int, _ForkPoint] = {}
        try:
            for node in self.nodes:
                exe = exes[self.stream_of[node.node_id]]
                if isinstance(node, Argument):
                    exe.submit(ConstantText(self._argument(node, kwargs)))
                elif isinstance(node, Variable):
                    exe.submit(Variable(node.name, exes[self.stream_of[node.source.node_id]]))
                elif isinstance(node, Fork):
                    points[node.node_id] = _ForkPoint(node.number)
                    exe.submit(points[node.node_id])
                elif isinstance(node, GetForkItem):
                    exe.submit(_ForkStart(points[node.fork.node_id]))
                elif isinstance(node, Join):
                    children = [exes[self.stream_of[s.node_id]] for s in node.sources]
                    marks = [_Mark() for _ in children]
                    for child, mark in zip(children, marks, strict=True):
                        child.submit(mark)
                    exe.submit(_JoinPoint(node.mode, children, marks))
                else:
                    exe.submit(node)  # constant text, gen, select, roles, scopes: shared, never mutated
        except Exception as exc:
            exes[0].record_error(exc)
        finally:
            for exe in exes:
                exe.end()
        return ProgramState(exes[0])

    def run(self, *, backend: Any = None, **kwargs: Any) -> ProgramState:
        params, kwargs = split_sampling_kwargs(kwargs)
        return self.run_internal(resolve_backend(backend), kwargs, params)

    run_batch = SglFunction.run_batch  # one signature: SglFunction's, over this graph (_batch_runner)

    def _batch_runner(self) -> tuple[Any, Any]:
        def run_one(backend: Any, kwargs: dict[str, Any], params: GenParams) -> ProgramState:
            state = self.run_internal(backend, kwargs, params)
            state.sync()
            return state

        return self.function, run_one


def compile_func(function: Any, backend: Any = None) -> CompiledFunction:
    return CompiledFunction(function.trace(backend=backend), function)
