"""The stream executor: runs the IR nodes of one program state, in order, on its own thread.

Appending to a state only enqueues a node, so `s += gen(...)` returns at once and the Python program goes
on; reading a variable waits for the node that defines it. Forked states get executors of their own, so
their requests reach the engine at the same time and are batched there.
"""

from __future__ import annotations

import queue
import threading
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from jsgl.engine.spanned_prompt import SpannedPrompt
from jsgl.lang import role_spans
from jsgl.lang.global_config import global_config
from jsgl.lang.ir import (
    Argument,
    CommitLazy,
    ConcatenateAndAppend,
    ConstantText,
    Expr,
    ExprList,
    Gen,
    GenParams,
    Image,
    RoleBegin,
    RoleEnd,
    Select,
    SeparateReasoning,
    Variable,
    VarScopeBegin,
    VarScopeEnd,
    Video,
    reasoning_var,
)

# Meta info keys a stream carries per chunk (that chunk's tokens only); the rest are running values.
INCREMENTAL_META_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


def merge_stream_meta(pending: dict[str, Any] | None, meta: dict[str, Any] | None) -> dict[str, Any] | None:
    """The meta info of two consecutive stream chunks as one chunk: per-token lists concatenated, the
    rest (counts, finish_reason) from the later chunk. (SGLang's `_merge_stream_meta_info`.)"""
    if pending is None or meta is None:
        return meta if pending is None else pending
    merged = dict(meta)
    for key in INCREMENTAL_META_KEYS:
        if key in meta or key in pending:
            merged[key] = list(pending.get(key) or []) + list(meta.get(key) or [])
    return merged


class ProgramError(RuntimeError):
    """Raised when reading a variable that was never produced because the program failed earlier."""


class ProgramInterrupted(ProgramError):
    """The state's program was interrupted (Ctrl-C) while its caller waited: its requests were aborted."""


class ExecutableNode(Expr):
    """A node that knows how to run itself (used by the compiler's graph executor)."""

    def execute(self, exe: StreamExecutor) -> None:
        raise NotImplementedError

    def skip(self, exe: StreamExecutor) -> None:
        """Called instead of execute() once the stream has failed; must release anyone waiting on it."""


class StreamExecutor:
    """Executes the nodes of one state. Attributes ending in `_` are read by backends."""

    def __init__(
        self,
        backend: Any,
        arguments: dict[str, Any],
        default_sampling_para: GenParams,
        chat_template: Any = None,
        stream: bool = False,
        use_thread: bool | None = None,
    ) -> None:
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = arguments
        self.default_sampling_para = default_sampling_para
        self.stream = stream
        self.chat_template = chat_template or backend.get_chat_template()

        self.text_ = ""
        self.messages_: list[dict[str, Any]] = []
        self.role_spans_: list[tuple[int, int]] = []  # the closed roles' contents in text_ (role_spans.py)
        self.variables: dict[Any, Any] = {}
        self.variable_event: dict[Any, threading.Event] = {}
        self.meta_info: dict[Any, Any] = {}
        self._done_vars: set[Any] = set()  # variables that hold a final value (not a failed/partial one)
        # Streamed gens: per variable, (length of the value after the chunk, that chunk's meta info), so a
        # reader can pair each piece of text with exactly the tokens (logprobs) that made it.
        self.stream_log: dict[Any, list[tuple[int, Any]]] = {}
        # Gens followed by separate_reasoning: their variable is ready once split, not once generated.
        self._split_pending: set[Any] = set()
        self._var_lock = threading.Lock()
        self._scope_start: dict[str, int] = {}
        self.inherited_vars: set[Any] = set()  # copied from the parent at fork time (not gathered at join)
        self.cur_role: str | None = None
        self.cur_role_begin_pos = 0
        self.cur_role_suffix = ""
        self.fork_start_text_pos: int | None = None
        self.num_api_spec_tokens: int | None = None  # @function(num_api_spec_tokens=...), for API backends
        self.error_: BaseException | None = None
        self.is_finished = False
        self._in_flight: list[Callable[[], None]] = []  # aborts of the backend's requests under way (interrupt)

        # Streaming readers wait on this; every change of text or variables notifies it.
        self._cond = threading.Condition()
        self._lock = threading.Lock()  # orders submit() against end(), so nothing lands after the sentinel
        self._ended = False
        self.use_thread = global_config.enable_parallelism if use_thread is None else use_thread
        if self.use_thread:
            self.queue: queue.Queue[Expr | None] = queue.Queue()
            self.worker = threading.Thread(target=self._worker, name=f"jsgl-stream-{self.sid[:8]}", daemon=True)
            self.worker.start()
        backend.begin_program(self)

    # Submission and waiting ------------------------------------------------------------------------------

    def submit(self, expr: Expr | str) -> None:
        if isinstance(expr, str):
            expr = ConstantText(expr)
        if not isinstance(expr, Expr):
            raise TypeError(f"cannot append {type(expr).__name__} to a program state")
        self._init_var_event(expr)
        with self._lock:
            if self.use_thread and not self._ended:
                self.queue.put(expr)
                return
        # Inline mode, or a state used again after its program ended (once its thread has drained).
        self.sync()
        self._run_node(expr)

    def sync(self) -> None:
        if self.use_thread:
            try:
                self.queue.join()
            except BaseException:  # a Ctrl-C while waiting: the program stops and its requests end
                self.interrupt()
                raise

    def interrupt(self) -> None:
        """Fail this state as interrupted (its nodes not yet run are skipped) and abort its requests under way,
        so an interrupted program leaves nothing running in the engine."""
        self.record_error(ProgramInterrupted("the program was interrupted"))
        for abort in list(self._in_flight):
            abort()

    @contextmanager
    def abortable(self, abort: Callable[[], None]) -> Iterator[None]:
        """A backend's request under way for this state: ``abort`` ends it if the program is interrupted (from
        the caller's thread, or in this one: a Ctrl-C where the state runs inline)."""
        self._in_flight.append(abort)
        try:
            yield
        except BaseException as exc:
            if not isinstance(exc, Exception):
                abort()
            raise
        finally:
            self._in_flight.remove(abort)

    def end(self) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
            if self.use_thread:
                self.queue.put(None)
        if not self.use_thread:
            self._finish()
        self.backend.end_program(self)

    def _worker(self) -> None:
        while True:
            expr = self.queue.get()
            try:
                if expr is None:
                    return
                self._run_node(expr)
            finally:
                self.queue.task_done()
                if expr is None:
                    self._finish()

    def _finish(self) -> None:
        self.is_finished = True
        self._notify()

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _run_node(self, expr: Expr) -> None:
        if self.error_ is None:
            try:
                self._execute(expr)
            except Exception as exc:  # a failed node fails this state only
                self.record_error(exc)
        if self.error_ is not None:
            self._skip(expr)
        self._notify()

    def record_error(self, exc: BaseException) -> None:
        if self.error_ is None:
            self.error_ = exc
            if global_config.verbosity >= 1:
                warnings.warn(
                    "error in a jsgl program state: "
                    + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                    stacklevel=2,
                )
        for event in list(self.variable_event.values()):
            event.set()  # readers wake up and see the error instead of hanging
        self._notify()

    def _skip(self, expr: Expr) -> None:
        if isinstance(expr, ExprList):
            for e in expr.expr_list:
                self._skip(e)
        elif isinstance(expr, ExecutableNode):
            expr.skip(self)
        elif isinstance(expr, SeparateReasoning):
            for name in [*expr.targets, *expr.reasoning_names]:
                self._split_pending.discard(name)
                if name in self.variable_event:
                    self.variable_event[name].set()
        elif isinstance(expr, (Gen, Select, VarScopeBegin, VarScopeEnd)) and expr.name in self.variable_event:
            self.variable_event[expr.name].set()

    def _init_var_event(self, expr: Expr) -> None:
        if isinstance(expr, ExprList):
            for e in expr.expr_list:
                self._init_var_event(e)
        elif isinstance(expr, (Gen, Select, VarScopeBegin)) and expr.name is not None:
            # A fresh event per definition, so a re-generated name is waited for again.
            self._new_var_event(expr.name)
            self._split_pending.discard(expr.name)
        elif isinstance(expr, SeparateReasoning):
            for name in expr.reasoning_names:
                self._new_var_event(name)
            with self._var_lock:  # against the worker finishing that gen right now (compiled programs)
                for name in expr.targets:
                    # Readers of the gen's variable wait for the split (the raw output would be wrong).
                    if self.variable_event.get(name) is None or self.variable_event[name].is_set():
                        self._new_var_event(name)
                    self._split_pending.add(name)

    def _new_var_event(self, name: Any) -> None:
        self.variable_event[name] = threading.Event()
        self._done_vars.discard(name)
        if self.error_ is not None:
            self.variable_event[name].set()

    # Reading -------------------------------------------------------------------------------------------

    def get_var(self, name: Any) -> Any:
        event = self.variable_event.get(name)
        if event is not None:
            try:
                event.wait()
            except BaseException:  # a Ctrl-C while waiting for the value
                self.interrupt()
                raise
        if name in self._done_vars or (name in self.variables and self.error_ is None):
            return self.variables[name]
        if self.error_ is not None:
            raise ProgramError(f"variable {name!r} is unavailable: the program failed: {self.error_!r}") \
                from self.error_
        raise KeyError(name)

    def set_var(self, name: Any, value: Any) -> None:
        self.variables[name] = value
        self._done_vars.add(name)

    def get_meta_info(self, name: Any, timeout: float | None = None) -> Any:
        event = self.variable_event.get(name)
        if event is not None and not event.wait(timeout):
            raise TimeoutError(f"timed out waiting for {name!r}")
        return self.meta_info.get(name)

    def text(self) -> str:
        self.sync()
        return self.text_

    def prompt_(self, appended: str = "") -> SpannedPrompt:
        """``text_ + appended`` as a prompt whose role contents (an open role's too, ``appended`` in it) are plain
        text: a special token's string the program wrote there is not a control token."""
        spans = list(self.role_spans_)
        if self.cur_role is not None:
            spans.append((self.cur_role_begin_pos, len(self.text_) + len(appended)))
        return SpannedPrompt(self.text_ + appended, tuple(spans))

    def messages(self) -> list[dict[str, Any]]:
        self.sync()
        return self.messages_

    def error(self) -> BaseException | None:
        self.sync()
        return self.error_

    # Fork ----------------------------------------------------------------------------------------------

    def fork(self, size: int = 1) -> list[StreamExecutor]:
        self.sync()  # the branches start from the text as it is after every node submitted so far
        size = int(size)
        if size < 1:
            raise ValueError("fork size must be >= 1")
        if size > 1 and self.text_ and self.error_ is None and global_config.enable_prefix_hint:
            self._prefix_hint()
        children = [
            StreamExecutor(self.backend, self.arguments, self.default_sampling_para, self.chat_template,
                           self.stream, self.use_thread)
            for _ in range(size)
        ]
        for child in children:
            child.copy_state_from(self.snapshot())
            child.num_api_spec_tokens = self.num_api_spec_tokens
        return children

    def _prefix_hint(self) -> None:
        try:
            self.backend.commit_lazy_operations(self)
        except Exception as exc:  # a hint is an optimisation; the branches would compute the prefix anyway
            warnings.warn(f"prefix hint failed: {exc!r}", stacklevel=3)

    def snapshot(self) -> dict[str, Any]:
        return {
            "text": self.text_, "messages": list(self.messages_), "variables": dict(self.variables),
            "done": set(self._done_vars), "meta": dict(self.meta_info), "role": self.cur_role,
            "role_pos": self.cur_role_begin_pos, "role_suffix": self.cur_role_suffix, "error": self.error_,
            "role_spans": list(self.role_spans_),
        }

    def copy_state_from(self, snap: dict[str, Any]) -> None:
        self.text_ = snap["text"]
        self.messages_ = list(snap["messages"])
        self.role_spans_ = list(snap["role_spans"])
        self.variables = dict(snap["variables"])
        self._done_vars = set(snap["done"])
        self.meta_info = dict(snap["meta"])
        self.inherited_vars = set(self.variables)
        self.cur_role, self.cur_role_begin_pos, self.cur_role_suffix = (
            snap["role"], snap["role_pos"], snap["role_suffix"])
        self.fork_start_text_pos = len(self.text_)
        if snap["error"] is not None:
            self.record_error(snap["error"])

    def gather_from(self, children: list[StreamExecutor], wait: bool = True) -> None:
        """Join mode gather_variable: each variable the branches made becomes a list here, in order.
        `wait=False`: the caller has already waited for the branches to reach the join."""
        existing = set(self.variables)
        for child in children:
            if wait:
                child.sync()
            if child.error_ is not None:
                raise ProgramError(f"a forked branch failed: {child.error_!r}") from child.error_
            for name in child.variables:
                if name in child.inherited_vars or name in existing or name is None:
                    continue
                self.variables.setdefault(name, []).append(child.variables[name])
                self._done_vars.add(name)
                self.meta_info.setdefault(name, []).append(child.meta_info.get(name))
                self.variable_event.setdefault(name, threading.Event()).set()

    # Execution -----------------------------------------------------------------------------------------

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, ConstantText):
            self._fill(expr.value)
        elif isinstance(expr, ExprList):
            for e in expr.expr_list:
                self._execute(e)
        elif isinstance(expr, Gen):
            self._execute_gen(expr)
        elif isinstance(expr, Select):
            self._execute_select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, Variable):
            self._fill(str(expr.source.get_var(expr.name)))
        elif isinstance(expr, Argument):
            self._fill(str(self.arguments.get(expr.name, expr.value)))
        elif isinstance(expr, VarScopeBegin):
            self._scope_start[expr.name] = len(self.text_)
        elif isinstance(expr, VarScopeEnd):
            self._set_final(expr.name, self.text_[self._scope_start.pop(expr.name):], None)
        elif isinstance(expr, CommitLazy):
            if global_config.enable_prefix_hint:
                self._prefix_hint()
        elif isinstance(expr, ConcatenateAndAppend):
            self._concatenate_and_append(expr)
        elif isinstance(expr, SeparateReasoning):
            self._separate_reasoning(expr)
        elif isinstance(expr, ExecutableNode):
            expr.execute(self)
        elif isinstance(expr, (Image, Video)):
            raise NotImplementedError("jsgl serves text-only models: image/video inputs are not supported")
        else:
            raise TypeError(f"unknown node {expr!r}")

    def _fill(self, value: str) -> None:
        self.text_ += value

    def _set_final(self, name: Any, value: Any, meta: Any) -> None:
        if name is None:
            return
        self.variables[name] = value
        self.meta_info[name] = meta
        self._done_vars.add(name)
        with self._var_lock:
            if name not in self._split_pending:  # else separate_reasoning releases it once split
                self.variable_event.setdefault(name, threading.Event()).set()

    def resolve_params(self, params: GenParams) -> GenParams:
        """gen()'s parameters over run()'s, then the process-wide output settings where neither set them."""
        out = params.merged_over(self.default_sampling_para)
        if out.skip_special_tokens is None and not global_config.skip_special_tokens_in_output:
            out.skip_special_tokens = False
        if out.spaces_between_special_tokens is None and not global_config.spaces_between_special_tokens_in_out:
            out.spaces_between_special_tokens = False
        return out

    def _execute_gen(self, expr: Gen) -> None:
        params = self.resolve_params(expr.sampling_params)
        name = expr.name
        # n > 1 is not streamed (SGLang cannot either): the samples arrive together, as a list.
        if not self.stream or (params.n or 1) > 1:
            comp, meta = self.backend.generate(self, params)
            # n > 1: the variable holds every sample, the text goes on with the first (as SGLang).
            self.text_ += comp[0] if isinstance(comp, list) else comp
            self._set_final(name, comp, meta)
            return
        value, merged = "", None
        log: list[tuple[int, Any]] = []
        if name is not None:
            with self._cond:
                self.stream_log[name] = log
        for delta, meta in self.backend.generate_stream(self, params):
            with self._cond:  # readers see text, value and log change together
                self.text_ += delta
                value += delta
                # meta_info holds the whole generation so far; each log entry only its own chunk.
                merged = merge_stream_meta(merged, meta)
                if name is not None:
                    self.variables[name] = value
                    self.meta_info[name] = merged
                    log.append((len(value), meta))
                self._cond.notify_all()
        self._set_final(name, value, merged)

    def _execute_select(self, expr: Select) -> None:
        decision = self.backend.select(self, expr.choices, expr.temperature, expr.choices_method)
        self.text_ += decision.decision
        self._set_final(expr.name, decision.decision, decision.meta_info)

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"role {role!r} begins inside role {self.cur_role!r}; roles cannot nest")
        default_system = self.chat_template.default_system_prompt
        if not self.messages_ and role != "system" and default_system:
            # The template would insert this itself; doing it here keeps text_ and messages_ in step.
            self._role_begin("system")
            self._fill(default_system)
            self._role_end("system")
        prefix, suffix = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._fill(prefix)
        self.cur_role, self.cur_role_begin_pos, self.cur_role_suffix = role, len(self.text_), suffix

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"role {role!r} ends but the open role is {self.cur_role!r}")
        content = self.text_[self.cur_role_begin_pos:].lstrip()
        self.role_spans_.append((self.cur_role_begin_pos, len(self.text_)))
        self._fill(self.cur_role_suffix)
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None

    def _concatenate_and_append(self, expr: ConcatenateAndAppend) -> None:
        if global_config.enable_parallel_encoding and self.backend.support_concate_and_append:
            # A backend that splices the branches' KV onto this state's (SGLang's parallel encoding):
            # compute each branch's text, then let the backend join them.
            for child in expr.states:
                child.sync()
                if child.error_ is None:
                    self.backend.commit_lazy_operations(child)
            self.append_branches(expr.states)
            self.backend.concatenate_and_append([c.sid for c in expr.states], self.sid)
            return
        # Otherwise (every jsgl backend): text concatenation, as SGLang does for such backends. The joined
        # state stays exact: the next request reuses the fork point's prefix from the radix cache and
        # computes the branches' text after it.
        self.append_branches(expr.states)

    def _separate_reasoning(self, expr: SeparateReasoning) -> None:
        for name in expr.targets:
            raw = self.variables.get(name)
            self._split_pending.discard(name)
            if isinstance(raw, list):  # n > 1: each sample is split; the text holds the first
                parts = [expr.parser.parse_non_stream(str(r)) for r in raw]
                reasoning: Any = [p[0] for p in parts]
                answer: Any = [p[1] for p in parts]
                raw_text, answer_text = (str(raw[0]), parts[0][1]) if raw else ("", "")
            else:
                raw_text = "" if raw is None else str(raw)
                reasoning, answer = expr.parser.parse_non_stream(raw_text)
                answer_text = answer
            if not self.stream:  # a streamed text was already read as it came; it stays as it was
                self._replace_output(raw_text, answer_text)
            self.variables[name] = answer
            self._done_vars.add(name)
            self._set_final(reasoning_var(name), reasoning, None)
            self.variable_event.setdefault(name, threading.Event()).set()

    def _replace_output(self, raw: str, answer: str) -> None:
        """Put `answer` where the gen's raw output is: the end of the text, or (when a role was closed
        after the gen) its last occurrence, and the same in the last message."""
        if not raw or raw == answer:
            return
        at = self.text_.rfind(raw)
        if at < 0:
            return
        closed_after = at + len(raw) < len(self.text_)  # separate_reasoning(assistant(gen(...)))
        self.text_ = self.text_[:at] + answer + self.text_[at + len(raw):]
        self.role_spans_ = role_spans.replaced(self.role_spans_, at, len(raw), len(answer))
        self.cur_role_begin_pos = role_spans.moved(self.cur_role_begin_pos, at, len(raw), len(answer))
        if closed_after and self.messages_ and raw.strip() and self.messages_[-1]["content"].endswith(raw.strip()):
            last = self.messages_[-1]
            content = last["content"][: len(last["content"]) - len(raw.strip())] + answer.strip()
            self.messages_[-1] = {**last, "content": content.lstrip()}

    def append_branches(self, children: list[StreamExecutor], wait: bool = True) -> None:
        """Join mode concate_and_append: the text each branch added after the fork, in branch order."""
        pieces = []
        spans = []  # the branches' role contents, where their text lands here
        for child in children:
            if wait:
                child.sync()
            if child.error_ is not None:
                raise ProgramError(f"a forked branch failed: {child.error_!r}") from child.error_
            if child.fork_start_text_pos is None or not child.text_.startswith(self.text_[: child.fork_start_text_pos]):
                raise ValueError("concate_and_append: the branches must be forked from this state, unchanged since")
            offset = len(self.text_) + sum(map(len, pieces))
            spans += role_spans.rebased(list(child.prompt_().plain), child.fork_start_text_pos, offset)
            pieces.append(child.text_[child.fork_start_text_pos:])
        # Text-level concatenation; a radix-cached backend reuses the parent's prefix and the first branch.
        self._fill("".join(pieces))
        if self.cur_role is None:  # else the open role holds the whole of it
            self.role_spans_ += spans
