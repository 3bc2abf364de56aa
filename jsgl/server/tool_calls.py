"""OpenAI function calling for models whatever their chat template knows about tools.

The tool-call format is the Hermes/Qwen convention, one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Prompt: a template that renders `tools`, assistant `tool_calls` and `tool` messages itself (a probe
render tells) gets them as transformers passes them. Otherwise (SmolLM2's template ignores tools) the
tools are described in the system message in Qwen2.5's words (`TOOLS_PROMPT`), earlier calls are written
into the assistant's content as blocks, and tool results become user messages of
`<tool_response>...</tool_response>` blocks (consecutive results share one message).

Constraints: tool_choice "required" or a named function constrains the output with the engine's `regex`
to blocks whose JSON is `{"name": <const>, "arguments": <the function's parameters schema>}` (in
json.dumps layout, so jump-forward writes the fixed parts), so even a 135M model makes a valid call.
"auto" parses whatever the model writes; "none" leaves the tools out of the prompt.

Parsing: `ToolCallParser` reads the text incrementally and is also what a non-streamed reply runs over
the whole text, so streamed deltas reassemble to exactly the non-streamed message.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from jsgl.fsm import json_schema_to_regex
from jsgl.server.common import APIError
from jsgl.server.openai_protocol import ChatCompletionRequest, FunctionDef, NamedToolChoice, Tool, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -------------------------------------------------------------------------------------------- the plan
@dataclasses.dataclass
class ToolPlan:
    """What a request asks of tools: mode none | auto | required | named."""

    mode: str
    tools: list[Tool]  # the tools the prompt offers (only the named one for a named choice)
    names: frozenset[str]  # the names a call may have
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.mode != "none"


def plan_tools(req: ChatCompletionRequest) -> ToolPlan:
    tools = req.tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError("tools: two functions have the same name", param="tools")
    choice = req.tool_choice
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise APIError(f"tool_choice names function {choice.function.name!r}, which is not in tools",
                           param="tool_choice")
        return ToolPlan("named", chosen, frozenset([choice.function.name]), parallel=False)
    mode = choice or "auto"
    if not tools:
        if mode == "required":
            raise APIError("tool_choice 'required' needs tools", param="tool_choice")
        mode = "none"
    if mode == "none":
        return ToolPlan("none", [], frozenset())
    return ToolPlan(mode, list(tools), frozenset(names), parallel)


# -------------------------------------------------------------------------------------------- the prompt
_NATIVE: dict[str, bool] = {}  # chat template -> does it render tools, tool calls and tool results?


def template_renders_tools(tokenizer: Any) -> bool:
    """Render a probe conversation: a template that shows the probe tool's name, the probe call's name
    and the probe result handles tools itself. Decided once per template."""
    key = str(getattr(tokenizer, "chat_template", None))
    if key not in _NATIVE:
        tool = {"type": "function", "function": {"name": "jsgl_probe_tool", "description": "d",
                                                 "parameters": {"type": "object", "properties": {}}}}
        call = {"id": "call_probe", "type": "function", "function": {"name": "jsgl_probe_call", "arguments": {}}}
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_probe", "content": "jsgl_probe_result"}]
        try:
            text = tokenizer.apply_chat_template(messages, tools=[tool], tokenize=False, add_generation_prompt=True)
            _NATIVE[key] = all(s in text for s in ("jsgl_probe_tool", "jsgl_probe_call", "jsgl_probe_result"))
        except Exception:  # a template that raises on tool messages does not handle them
            _NATIVE[key] = False
    return _NATIVE[key]


def _arguments_object(arguments: str | dict[str, Any]) -> Any:
    """Templates (and our blocks) want the arguments as an object; OpenAI sends a JSON string."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def call_block(call: ToolCall) -> str:
    body = {"name": call.function.name, "arguments": _arguments_object(call.function.arguments)}
    return f"{OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{CLOSE}"


def _tool_spec(tool: Tool) -> dict[str, Any]:
    return {"type": "function", "function": tool.function.model_dump(exclude_none=True)}


def template_inputs(messages: list[dict[str, Any]], plan: ToolPlan, native: bool
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for apply_chat_template. A message dict has role and content (a string), and
    may have tool_calls (ToolCall list), tool_call_id and name."""
    specs = [_tool_spec(t) for t in plan.tools]
    if native:
        out = []
        for m in messages:
            msg = {"role": m["role"], "content": m["content"]}
            if m.get("tool_calls"):
                msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments_object(c.function.arguments)}}
                    for c in m["tool_calls"]]
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    msg[key] = m[key]
            out.append(msg)
        return out, specs or None
    out = []
    for i, m in enumerate(messages):
        content = m["content"]
        if m["role"] == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if i and messages[i - 1]["role"] == "tool":  # results of one turn's calls go together
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            continue
        if m.get("tool_calls"):
            blocks = "\n".join(call_block(c) for c in m["tool_calls"])
            content = f"{content}\n{blocks}" if content else blocks
        out.append({"role": m["role"], "content": content})
    if specs:
        described = TOOLS_PROMPT.format(tools="\n".join(json.dumps(s, ensure_ascii=False) for s in specs))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out, None


# --------------------------------------------------------------------------------------- the constraint
def _call_schema(fn: FunctionDef, defs: dict[str, Any]) -> dict[str, Any]:
    """{"name": const, "arguments": parameters}; the parameters' $defs move to the root, where their
    "#/$defs/..." references point once the schema is wrapped."""
    params = dict(fn.parameters) if fn.parameters is not None else dict(NO_PARAMETERS)
    for key in ("$defs", "definitions"):
        for name, value in (params.pop(key, None) or {}).items():
            if defs.setdefault(key, {}).setdefault(name, value) != value:
                raise APIError(f"tools: two functions define {key}/{name} differently", param="tools")
    return {"type": "object", "properties": {"name": {"const": fn.name}, "arguments": params},
            "required": ["name", "arguments"]}


def constraint_regex(plan: ToolPlan) -> str | None:
    """The engine regex for "required" (one block, or several with parallel_tool_calls) or a named
    function (exactly one block, as OpenAI's forced call); None for "auto" and "none"."""
    if plan.mode not in ("required", "named"):
        return None
    defs: dict[str, Any] = {}
    schemas = [_call_schema(t.function, defs) for t in plan.tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, **defs}
    block = re.escape(OPEN) + r"\n(?:" + json_schema_to_regex(schema) + r")\n" + re.escape(CLOSE)
    # Several calls are blocks joined by newlines (as the prompt renders earlier ones); after a block the
    # model picks EOS (done) or a newline (another call).
    return f"{block}(?:\\n{block})*" if plan.parallel and plan.mode == "required" else block


# ------------------------------------------------------------------------------------------- the parser
@dataclasses.dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# The start of a call, up to the first character of its arguments: once it matches, the call is streamed.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.\-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could begin `tag` (held back until it is decided)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _final_arguments(region: str) -> str:
    """The arguments text of a finished call: `region` is what follows `"arguments": ` up to the close
    tag (or the end of the output), i.e. the arguments, the object's closing brace and whitespace."""
    text = region.rstrip()
    try:
        json.loads(text)
        return text  # the closing brace is missing (the output ended)
    except ValueError:
        pass
    return text[:-1].rstrip() if text.endswith("}") else text


def _parse_block(block: str, names: frozenset[str]) -> tuple[str, str] | None:
    """A whole block the header did not match (other key order, "parameters", ...): (name, arguments)."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False)


class ToolCallParser:
    """Splits model output into content and tool calls, as OpenAI chat deltas.

    `feed(text)` returns the deltas the text completes: {"content": ...}, a call's first delta
    {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]} and its arguments
    pieces {"tool_calls": [{"index", "function": {"arguments": ...}}]}; `finish()` the rest. Text that
    may still turn into a tag, whitespace next to a block and an undecided block are held back; every
    decision depends only on the text, never on how it was chunked. A block that is not a call of a
    known function stays content, verbatim.
    """

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.calls: list[ParsedCall] = []
        self.content_parts: list[str] = []
        self._buf = ""  # outside a block: content not yet emitted; inside: the block's text so far
        self._in_block = False
        self._pre_ws = ""  # whitespace dropped before the block (restored if it is not a call)
        self._after_call = False  # drop whitespace after a call
        self._call: ParsedCall | None = None  # the call being streamed
        self._args_start = 0
        self._args_sent = 0

    @property
    def content(self) -> str | None:
        text = "".join(self.content_parts)
        return None if self.calls and not text else text

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._buf += text
        out: list[dict[str, Any]] = []
        while True:
            if not self._in_block:
                p = self._buf.find(OPEN)
                if p < 0:
                    safe = self._buf[:len(self._buf) - _partial_suffix(self._buf, OPEN)].rstrip()
                    self._content(safe, out)
                    self._buf = self._buf[len(safe):]
                    return out
                before = self._buf[:p].rstrip()
                self._content(before, out)
                self._pre_ws, self._buf, self._in_block = self._buf[len(before):p], self._buf[p + len(OPEN):], True
            if self._call is None:
                m = _HEADER.match(self._buf)
                if m and m.group(1) in self.names:
                    self._start_call(m.group(1), out)
                    self._args_start = m.end()
            q = self._buf.find(CLOSE, self._args_start if self._call else 0)
            if q < 0:
                if self._call is not None:
                    self._stream_arguments(out)
                return out
            self._end_block(self._buf[:q], out, closed=True)
            self._buf = self._buf[q + len(CLOSE):]

    def finish(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._in_block:
            self._end_block(self._buf, out, closed=False)
        else:
            self._content(self._buf, out)
        self._buf = ""
        return out

    # ----------------------------------------------------------------------------------------- helpers
    def _content(self, text: str, out: list[dict[str, Any]]) -> None:
        if self._after_call:
            text = text.lstrip()
        if text:
            self._after_call = False
            self.content_parts.append(text)
            out.append({"content": text})

    def _start_call(self, name: str, out: list[dict[str, Any]]) -> None:
        self._call = ParsedCall(new_call_id(), name)
        self._args_sent = 0
        out.append({"tool_calls": [{"index": len(self.calls), "id": self._call.id, "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})

    def _arguments(self, piece: str, out: list[dict[str, Any]]) -> None:
        if piece:
            out.append({"tool_calls": [{"index": len(self.calls), "function": {"arguments": piece}}]})

    def _stream_arguments(self, out: list[dict[str, Any]]) -> None:
        """Send the arguments so far, but for what may still be the call's end: a final '}' (perhaps
        the call object's own), whitespace, the start of the close tag. What is sent is therefore always
        a prefix of the final arguments (`_final_arguments`)."""
        region = self._buf[self._args_start:]
        ready = region[:len(region) - _partial_suffix(region, CLOSE)].rstrip()
        if ready.endswith("}"):
            ready = ready[:-1].rstrip()
        if len(ready) > self._args_sent:
            self._arguments(ready[self._args_sent:], out)
            self._args_sent = len(ready)

    def _end_block(self, block: str, out: list[dict[str, Any]], closed: bool) -> None:
        call = self._call
        if call is not None:
            region = block[self._args_start:]
            if not closed:  # the output ended inside the close tag
                region = region[:len(region) - _partial_suffix(region, CLOSE)]
            call.arguments = _final_arguments(region)
            self._arguments(call.arguments[self._args_sent:], out)
        else:
            parsed = _parse_block(block, self.names)
            if parsed is None:
                self._content(self._pre_ws + OPEN + block + (CLOSE if closed else ""), out)
            else:
                self._start_call(parsed[0], out)
                call = self._call
                call.arguments = parsed[1]
                self._arguments(call.arguments, out)
        if call is not None:
            self.calls.append(call)
            self._after_call = True
        self._call, self._in_block, self._pre_ws, self._args_start = None, False, "", 0
