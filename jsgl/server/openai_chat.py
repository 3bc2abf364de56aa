"""OpenAI-compatible API, part 2: /v1/chat/completions.

Messages are rendered with the model's own chat template (`tokenizer.apply_chat_template`), so the
prompt is exactly what the model was trained on. `response_format` maps onto the engine's constrained
decoding: `json_schema` -> the given schema, `json_object` -> the schema `{"type": "object"}`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from jsgl.engine.request import GenerateOutput
from jsgl.server.common import APIError, ServerState, check_max_tokens, server_state
from jsgl.server.openai_api import new_id, respond_with_choices, run_choices, sampling_params
from jsgl.server.openai_protocol import ChatCompletionRequest, ChatMessage

router = APIRouter()


def _content(msg: ChatMessage) -> str:
    if msg.content is None or isinstance(msg.content, str):
        return msg.content or ""
    parts = []
    for part in msg.content:
        if part.get("type") != "text":
            raise APIError(f"only text content parts are supported, got {part.get('type')!r}", param="messages")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def render_chat(state: ServerState, req: ChatCompletionRequest) -> str:
    messages = [{"role": m.role, "content": _content(m)} for m in req.messages]
    tok = state.engine.tokenizer
    if not getattr(tok, "chat_template", None):
        raise APIError("this model has no chat template; use /v1/completions", param="messages")
    if req.continue_final_message and messages[-1]["role"] != "assistant":
        raise APIError("continue_final_message needs the last message to be the assistant's",
                       param="continue_final_message")
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=not req.continue_final_message,
                                       continue_final_message=req.continue_final_message)
    except Exception as exc:  # templates raise for roles or orders they do not support
        raise APIError(f"the chat template rejected the messages: {exc}", param="messages") from None


def _constraint(req: ChatCompletionRequest) -> dict[str, Any]:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return {}
    if req.regex is not None or req.json_schema is not None:
        raise APIError("give response_format or regex/json_schema, not both", param="response_format")
    if fmt.type == "json_object":
        return {"json_schema": {"type": "object"}}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError("response_format json_schema needs json_schema.schema", param="response_format")
    return {"json_schema": fmt.json_schema.schema_}


def chat_logprobs(state: ServerState, out: GenerateOutput, top: int) -> dict[str, Any]:
    def entry(lp: float, t: int) -> dict[str, Any]:
        text = state.token_text(t)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    tops = out.output_top_logprobs or [[] for _ in out.token_ids]
    content = []
    for lp, t, row in zip(out.output_logprobs or [], out.token_ids, tops):
        item = entry(lp, t)
        item["top_logprobs"] = [entry(v, i) for v, i in row[:top]] if top else []
        content.append(item)
    return {"content": content}


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
    state = server_state(request)
    if req.tools:
        raise APIError("tools / function calling are not supported by this server", param="tools")
    if req.top_logprobs and not req.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    prompt = render_chat(state, req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = state.max_context  # OpenAI's default: until the context is full (the engine stops there)
    else:
        check_max_tokens(state, max_tokens)
    params = {**sampling_params(req, max_tokens), **_constraint(req)}
    top = req.top_logprobs or 0
    if req.logprobs:
        params.update(return_logprob=True, top_logprobs_num=top)
    cid = new_id("chatcmpl")
    group = await run_choices(state, [prompt], params, req.n, cid)

    def logprobs_of(out: GenerateOutput) -> dict[str, Any] | None:
        return chat_logprobs(state, out, top) if req.logprobs else None

    started: set[int] = set()

    def chunk_fields(i: int, text: str, finish: str | None) -> dict[str, Any]:
        if i not in started:  # the role goes with a choice's first chunk, as OpenAI sends it
            started.add(i)
            return {"delta": {"role": "assistant", "content": text}}
        return {"delta": {"content": text} if text or finish is None else {}}

    return await respond_with_choices(
        request, req, group, cid=cid, model=state.model_name, objects=("chat.completion.chunk", "chat.completion"),
        chunk_fields=chunk_fields, choice_fields=lambda i, out: {"message": {"role": "assistant", "content": out.text}},
        logprobs_of=logprobs_of)
