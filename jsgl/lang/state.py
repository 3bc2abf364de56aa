"""ProgramState (the `s` a program receives) and ForkedStates (what `s.fork(n)` returns)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from jsgl.lang.interpreter import StreamExecutor, merge_stream_meta
from jsgl.lang.ir import ConcatenateAndAppend, Expr, ExprList, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd

_DONE = object()
JOIN_MODES = ("gather_variable", "concate_and_append")


class ProgramState:
    """The state of a running program: append with `+=`, read variables with `s["name"]`."""

    def __init__(self, stream_executor: StreamExecutor) -> None:
        self.stream_executor = stream_executor
        self.ret_value: Any = None

    # Roles: `s.user("hi")` appends a whole message; `with s.user(): ...` brackets what is appended inside.
    def _role(self, role: str, expr: Expr | str | None) -> Any:
        if expr is not None:
            node = ExprList([RoleBegin(role), _expr(expr), RoleEnd(role)])
            self += node
            return node
        return self._role_scope(role)

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self += RoleBegin(role)
        yield
        self += RoleEnd(role)

    def system(self, expr: Expr | str | None = None) -> Any:
        return self._role("system", expr)

    def user(self, expr: Expr | str | None = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Expr | str | None = None) -> Any:
        return self._role("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Everything appended inside the block becomes variable `name`."""
        self += VarScopeBegin(name)
        yield
        self += VarScopeEnd(name)

    # Fork / join ---------------------------------------------------------------------------------------

    def fork(self, size: int = 1, position_ids_offset: list[int] | None = None) -> ForkedStates:
        """`size` copies of this state that continue independently (and in parallel)."""
        if position_ids_offset is not None:
            raise NotImplementedError("position_ids_offset is not supported")
        return ForkedStates([ProgramState(e) for e in self.stream_executor.fork(size)], self)

    @contextmanager
    def copy(self) -> Iterator[ProgramState]:
        """A scratch branch (a fork of one); its new variables are gathered back when the block ends."""
        forks = self.fork(1)
        try:
            yield forks[0]
        finally:
            forks.join()

    def _join(self, states: list[ProgramState], mode: str) -> None:
        children = [st.stream_executor for st in states]
        if mode == "gather_variable":
            try:
                self.stream_executor.gather_from(children)
            except Exception as exc:  # a failed branch fails the parent (its lists would be short)
                self.stream_executor.record_error(exc)
        elif mode == "concate_and_append":
            self += ConcatenateAndAppend(children)  # runs on the parent's thread, after the branches end
        else:
            raise ValueError(f"unknown join mode {mode!r}; expected one of {JOIN_MODES}")
        for child in children:
            child.end()

    # Reading -------------------------------------------------------------------------------------------

    def text(self) -> str:
        return self.stream_executor.text()

    def messages(self) -> list[dict[str, Any]]:
        return self.stream_executor.messages()

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> BaseException | None:
        """The exception that stopped this state, or None (waits for the state to finish its queue)."""
        return self.stream_executor.error()

    def get_var(self, name: Any) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: Any, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: Any) -> Any:
        return self.stream_executor.get_meta_info(name)

    def __iadd__(self, other: Expr | str) -> ProgramState:
        if other is None:
            raise ValueError("cannot append None to a program state")
        self.stream_executor.submit(other)
        return self

    def __getitem__(self, name: Any) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: Any, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: Any) -> bool:
        return name in self.stream_executor.variables

    def __del__(self) -> None:
        # Stop the executor thread once nobody holds the state (it drains its queue first).
        exe = getattr(self, "stream_executor", None)
        if exe is not None:
            exe.end()

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"

    # Streaming -----------------------------------------------------------------------------------------

    def text_iter(self, var_name: Any = None, return_meta_data: bool = False) -> Iterator[Any]:
        """Yield the text (or one variable) as it is produced; one piece if the program was not streamed.
        `return_meta_data`: yield (piece, meta_info) pairs instead, where a streamed gen's meta info covers
        exactly the tokens of that piece (`output_token_logprobs` of those tokens, plus the running
        `completion_tokens` and `output_token_logprobs_length`), as SGLang's text_async_iter gives them."""
        for piece, meta in self._pieces(var_name):
            yield (piece, meta) if return_meta_data else piece

    def _pieces(self, var_name: Any) -> Iterator[tuple[str, Any]]:
        exe = self.stream_executor
        if not exe.stream:
            if var_name is None:
                yield self.text(), None
            else:
                yield self.get_var(var_name), exe.get_meta_info(var_name)
            return
        pos, seen, pending = 0, 0, None  # text yielded, log entries consumed, meta of text-less chunks
        while True:
            with exe._cond:
                exe._cond.wait_for(lambda p=pos, n=seen: self._stream_ready(var_name, p, n), timeout=1.0)
                current, done = self._stream_view(var_name)
                log = exe.stream_log.get(var_name, []) if var_name is not None else []
                new_entries = log[seen:]
                seen = len(log)
            piece = current[pos:]
            pos += len(piece)
            for _, meta in new_entries:
                pending = merge_stream_meta(pending, meta)
            if piece:
                meta, pending = pending, None
                if meta is None and var_name is not None:
                    meta = exe.meta_info.get(var_name)  # not a streamed gen (select, var_scope)
                yield piece, meta
            if done and pos >= len(current):
                return  # meta of chunks with no text after the last piece is dropped, as SGLang does

    def _stream_view(self, var_name: Any) -> tuple[str, bool]:
        exe = self.stream_executor
        if var_name is None:
            return exe.text_, exe.is_finished
        value = exe.variables.get(var_name, "")
        event = exe.variable_event.get(var_name)
        done = exe.is_finished or (event is not None and event.is_set())
        if isinstance(value, list):  # n > 1: the samples arrive at once; the text shows the first
            value = value[0] if value else ""
        return (value if isinstance(value, str) else str(value)), done

    def _stream_ready(self, var_name: Any, pos: int, seen: int) -> bool:
        current, done = self._stream_view(var_name)
        log = self.stream_executor.stream_log.get(var_name, []) if var_name is not None else []
        return done or len(current) > pos or len(log) > seen

    async def text_async_iter(self, var_name: Any = None, return_meta_data: bool = False) -> AsyncIterator[Any]:
        """Async version of text_iter; with return_meta_data, yields (piece, meta_info) pairs."""
        loop = asyncio.get_running_loop()
        it = self.text_iter(var_name, return_meta_data)
        while True:
            item = await loop.run_in_executor(None, next, it, _DONE)
            if item is _DONE:
                return
            yield item


def _expr(value: Expr | str) -> Expr:
    from jsgl.lang.ir import _as_expr

    return _as_expr(value)


class ForkedStates:
    """A list of forked states. `forks += x` appends to every branch (x(i) if x is a function)."""

    def __init__(self, states: list[Any], src_state: Any) -> None:
        self.states = states
        self.src_state = src_state

    def join(self, mode: str = "gather_variable") -> None:
        """gather_variable: the parent gets each new variable as a list over branches.
        concate_and_append: the branches' new text is appended to the parent, in order."""
        self.src_state._join(self.states, mode)

    def __getitem__(self, i: int) -> Any:
        return self.states[i]

    def __setitem__(self, i: int, value: Any) -> None:
        # `forks[i] += x` assigns the same state back; anything else is a mistake.
        if value is not self.states[i]:
            raise TypeError("cannot replace a forked state")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.states)

    def __iadd__(self, other: Callable[[int], Any] | Expr | str | list | tuple) -> ForkedStates:
        for i, state in enumerate(self.states):
            if callable(other) and not isinstance(other, Expr):
                state += other(i)
            elif isinstance(other, (list, tuple)):
                state += other[i]
            else:
                state += other
        return self


ProgramStateGroup = ForkedStates  # SGLang's name
