"""OpenAI-compatible API, part 2: /v1/chat/completions.

Messages are rendered with the model's own chat template (`tokenizer.apply_chat_template`), so the
prompt is exactly what the model was trained on; `developer` messages are system messages. What the client
wrote is text: a special token's string in it (`<|im_end|>`) is tokenized as ordinary text, so no message can
close its turn and open another (chat_spans.py); only the template's own markers are control tokens. Function
calling (`tools`, `tool_choice`, `parallel_tool_calls`, assistant `tool_calls` and `tool` messages in the
history) is tool_calls.py's: the prompt, the constraint for "required" / a named function, and the
parser that turns the output into `message.tool_calls` (or streamed `delta.tool_calls`) with
finish_reason "tool_calls".
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from jsgl.engine.request import GenerateOutput
from jsgl.engine.spanned_prompt import SpannedPrompt
from jsgl.server.chat_spans import render_chat_spans
from jsgl.server.common import APIError, ServerState, check_max_tokens, server_state
from jsgl.server.openai_api import new_id, openai_finish_reason, respond_with_choices, run_choices, sampling_params
from jsgl.server.openai_protocol import ChatCompletionRequest, ChatMessage
from jsgl.server.tool_calls import (
    CLOSE,
    ToolCallParser,
    ToolPlan,
    constraint_regex,
    plan_tools,
    template_inputs,
    template_renders_tools,
)

router = APIRouter()
# Variables the server sets itself: chat_template_kwargs may not replace them. `chat_template` too: a client's
# own template would write any control token it likes, around any message.
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "tokenize",
                                       "add_generation_prompt", "continue_final_message", "return_dict",
                                       "chat_template"})


def _content(msg: ChatMessage) -> str:
    if msg.content is None or isinstance(msg.content, str):
        return msg.content or ""
    parts = []
    for part in msg.content:
        if part.get("type") != "text":
            raise APIError(f"only text content parts are supported, got {part.get('type')!r}", param="messages")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _message(msg: ChatMessage) -> dict[str, Any]:
    role = "system" if msg.role == "developer" else msg.role  # OpenAI's newer name for the system role
    out: dict[str, Any] = {"role": role, "content": _content(msg)}
    if msg.tool_calls:
        if role != "assistant":
            raise APIError("only assistant messages carry tool_calls", param="messages")
        out["tool_calls"] = msg.tool_calls
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    if msg.name is not None:
        out["name"] = msg.name
    return out


def render_chat(state: ServerState, req: ChatCompletionRequest, plan: ToolPlan) -> SpannedPrompt:
    tok = state.engine.tokenizer
    if not getattr(tok, "chat_template", None):
        raise APIError("this model has no chat template; use /v1/completions", param="messages")
    if req.continue_final_message and req.messages[-1].role != "assistant":
        raise APIError("continue_final_message needs the last message to be the assistant's",
                       param="continue_final_message")
    messages = [_message(m) for m in req.messages]
    uses_tools = plan.active or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if uses_tools:
        messages, tools = template_inputs(messages, plan, template_renders_tools(tok))
    else:
        messages, tools = [{"role": m["role"], "content": m["content"]} for m in messages], None
    extra = dict(req.chat_template_kwargs or {})
    if _RESERVED_TEMPLATE_KWARGS & set(extra):
        raise APIError(f"chat_template_kwargs may not set {sorted(_RESERVED_TEMPLATE_KWARGS & set(extra))}",
                       param="chat_template_kwargs")
    if tools:
        extra["tools"] = tools
    try:
        return render_chat_spans(tok, messages, add_generation_prompt=not req.continue_final_message,
                                 continue_final_message=req.continue_final_message, **extra)
    except Exception as exc:  # templates raise for roles or orders they do not support
        raise APIError(f"the chat template rejected the messages: {exc}", param="messages") from None


def _tool_params(req: ChatCompletionRequest, plan: ToolPlan, params: dict[str, Any]) -> dict[str, Any]:
    """The constraint for "required" / a named function; one call at most without parallel calls."""
    regex = constraint_regex(plan)
    if regex is not None:
        if any(params.get(k) is not None for k in ("regex", "json_schema", "ebnf", "structural_tag")):
            raise APIError("tool_choice 'required' or a named function cannot be combined with response_format, "
                           "regex, json_schema or ebnf: only one constraint can hold", param="tool_choice")
        return {"regex": regex}
    if plan.mode == "auto" and not plan.parallel:  # the first call's end stops the output
        stop = params.get("stop") or []
        return {"stop": [*([stop] if isinstance(stop, str) else stop), CLOSE]}
    return {}


def chat_logprobs(state: ServerState, out: GenerateOutput, top: int) -> dict[str, Any]:
    def entry(lp: float, t: int) -> dict[str, Any]:
        return {"token": state.token_text(t), "logprob": lp, "bytes": list(state.token_bytes(t))}

    tops = out.output_top_logprobs or [[] for _ in out.token_ids]
    content = []
    for lp, t, row in zip(out.output_logprobs or [], out.token_ids, tops):
        item = entry(lp, t)
        item["top_logprobs"] = [entry(v, i) for v, i in row[:top]] if top else []
        content.append(item)
    return {"content": content}


def _tool_finish(parser: ToolCallParser, finish: str | None) -> str | None:
    return "tool_calls" if parser.calls and finish == "stop" else finish


def _tool_deltas(parser: ToolCallParser, text: str, finish: str | None, first: bool) -> list[dict[str, Any]]:
    """One engine chunk of a choice with tools: its events' fields (content pieces merged, each tool-call
    delta its own event; the role goes with the first, the finish reason with the last)."""
    deltas = parser.feed(text) + (parser.finish() if finish is not None else [])
    merged: list[dict[str, Any]] = []
    for d in deltas:
        if "content" in d and merged and "content" in merged[-1]:
            merged[-1] = {"content": merged[-1]["content"] + d["content"]}
        else:
            merged.append(d)
    if first:
        merged = [{"role": "assistant", "content": ""}, *merged] if not merged or "content" not in merged[0] \
            else [{"role": "assistant", **merged[0]}, *merged[1:]]
    events: list[dict[str, Any]] = [{"delta": d} for d in merged]
    if finish is not None:
        if not events:
            events.append({"delta": {}})
        events[-1]["finish_reason"] = _tool_finish(parser, finish)
    return events


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
    state = server_state(request)
    if req.top_logprobs and not req.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    plan = plan_tools(req)
    prompt = render_chat(state, req, plan)
    # max_tokens is deprecated in favor of max_completion_tokens (OpenAI's reference): the newer field wins.
    limit_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(req, limit_field)
    if max_tokens is not None:  # (None: OpenAI's default, until the context is full; the engine stops there)
        check_max_tokens(state, max_tokens, limit_field)
    params = sampling_params(req, max_tokens)
    if plan.active:  # the JSON schema -> regex conversion is bounded but not free: off the event loop
        params.update(await asyncio.to_thread(_tool_params, req, plan, params))
    top = req.top_logprobs or 0
    if req.logprobs:
        params.update(return_logprob=True, top_logprobs_num=top)
    cid = new_id("chatcmpl")
    group = await run_choices(state, [prompt], params, req.n, cid)

    def logprobs_of(out: GenerateOutput) -> dict[str, Any] | None:
        return chat_logprobs(state, out, top) if req.logprobs else None

    started: set[int] = set()
    parsers: dict[int, ToolCallParser] = {}

    def chunk_fields(i: int, text: str, finish: str | None) -> dict[str, Any] | list[dict[str, Any]]:
        first = i not in started
        started.add(i)
        if plan.active:
            return _tool_deltas(parsers.setdefault(i, ToolCallParser(plan.names)), text, finish, first)
        if first:  # the role goes with a choice's first chunk, as OpenAI sends it
            return {"delta": {"role": "assistant", "content": text}}
        return {"delta": {"content": text} if text or finish is None else {}}

    def choice_fields(i: int, out: GenerateOutput) -> dict[str, Any]:
        if not plan.active:
            return {"message": {"role": "assistant", "content": out.text}}
        parser = ToolCallParser(plan.names)  # the same parser as a stream: the same calls
        parser.feed(out.text)
        parser.finish()
        message: dict[str, Any] = {"role": "assistant", "content": parser.content}
        if parser.calls:
            message["tool_calls"] = [c.as_openai() for c in parser.calls]
        return {"message": message, "finish_reason": _tool_finish(parser, openai_finish_reason(out))}

    return await respond_with_choices(
        request, req, group, cid=cid, model=state.model_name, objects=("chat.completion.chunk", "chat.completion"),
        chunk_fields=chunk_fields, choice_fields=choice_fields, logprobs_of=logprobs_of)
