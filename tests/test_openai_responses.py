"""The OpenAI routes' responses as a client reads them, on the real model through the session's server.

Bodies and stream events are parsed with the `openai` package's own pydantic models (`Completion`, `ChatCompletion`,
`ChatCompletionChunk`), validated from the JSON text as sent, so a field of the wrong type or shape fails here even
though the client itself constructs responses without validating them. Then the values clients bill and branch on:
`usage` whatever `n` (a prompt counts once), `finish_reason`, the logprobs' shapes, ids; and the limits
(`max_completion_tokens` on chat, finite `logit_bias`). Outputs are a few tokens, `ignore_eos` where a count
must be exact.
"""

from __future__ import annotations

import json
import math
from typing import Literal

import pytest
from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk

MODEL = "smollm2-135m"
COMPLETION_PROMPTS = ["The capital of France is", "One, two, three, four, five,"]
MESSAGES = [{"role": "user", "content": "Name a color."}]
TOKENS = 3  # per choice, exactly (ignore_eos)
ROUTES = {"completions": ("/v1/completions", {"prompt": COMPLETION_PROMPTS}),
          "chat": ("/v1/chat/completions", {"messages": MESSAGES})}


class StreamedCompletionChoice(CompletionChoice):
    finish_reason: Literal["stop", "length", "content_filter"] | None = None  # null until a choice's last chunk


class StreamedCompletion(Completion):
    """The client's model of a /v1/completions stream event (it reuses `Completion`, whose finish_reason is not
    optional: OpenAI sends null there mid-stream, and the client does not validate)."""

    choices: list[StreamedCompletionChoice]


def post(http, route: str, stream: bool = False, **fields) -> str | list[str]:
    """The response body's JSON text, or a stream's event payloads (JSON texts, [DONE] last)."""
    path, base = ROUTES[route]
    body = {"model": MODEL, "temperature": 0, "ignore_eos": True, "max_tokens": TOKENS, **base, **fields,
            "stream": stream}
    if not stream:
        resp = http.post(path, json=body)
        assert resp.status_code == 200, resp.text
        return resp.text
    with http.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


# ------------------------------------------------------------------------------------------------- usage
@pytest.fixture(scope="module")
def prompt_tokens(engine, http) -> dict[str, tuple[int, int]]:
    """Per route: (prompts, their tokens). The completion prompts' as the engine counts them; the chat prompt's as
    one choice reports it (its rendering is the chat template's business: the other choices must not add to it)."""
    completions = sum(engine.generate(p, {"max_new_tokens": 1}).prompt_tokens for p in COMPLETION_PROMPTS)
    chat = ChatCompletion.model_validate_json(post(http, "chat", n=1)).usage.prompt_tokens
    return {"completions": (len(COMPLETION_PROMPTS), completions), "chat": (1, chat)}


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_usage_counts_each_prompt_once_and_every_choices_tokens(http, prompt_tokens, route, n, stream):
    prompts, tokens = prompt_tokens[route]
    if stream:
        events = post(http, route, stream=True, n=n, stream_options={"include_usage": True})
        final = json.loads(events[-1])
        assert final["choices"] == [] and all(json.loads(e).get("usage") is None for e in events[:-1])
        usage = final["usage"]
        finished = [c["index"] for e in events for c in json.loads(e)["choices"] if c["finish_reason"]]
        assert sorted(finished) == list(range(prompts * n))
    else:
        body = json.loads(post(http, route, n=n))
        assert [c["index"] for c in body["choices"]] == list(range(prompts * n))
        usage = body["usage"]
    assert tokens > 0
    assert usage["prompt_tokens"] == tokens, usage
    assert usage["completion_tokens"] == prompts * n * TOKENS, usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= tokens


# ------------------------------------------------------------------------------------------------ limits
def test_max_completion_tokens_limits_chat_and_wins_over_max_tokens(engine, http, oai):
    """What current OpenAI clients send: max_completion_tokens, which replaces the deprecated max_tokens; with
    both, the newer field is the limit (larger or smaller)."""
    def chat(**limits):
        resp = oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, **limits)
        return resp.usage.completion_tokens, resp.choices[0].finish_reason

    assert chat(max_completion_tokens=3, max_tokens=8, extra_body={"ignore_eos": True}) == (3, "length")
    assert chat(max_completion_tokens=5, max_tokens=2, extra_body={"ignore_eos": True}) == (5, "length")
    # Alone (no ignore_eos: were it ignored, the reply would run to EOS, past 3 tokens or ending "stop").
    assert chat(max_completion_tokens=3, extra_body={"min_tokens": 3}) == (3, "length")
    too_many = engine.max_context + 1
    resp = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                   "max_completion_tokens": too_many, "max_tokens": 4})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_completion_tokens", resp.text


@pytest.mark.parametrize("bias", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_a_non_finite_logit_bias_is_a_400_naming_the_field(engine, http, bias):
    """JSON has no infinity, but Python's parser reads `Infinity` / `NaN` (what json.dumps writes)."""
    sampling = {"max_tokens": 2, "logit_bias": {"5": bias}}
    generate = {"max_new_tokens": 2, "logit_bias": {"5": bias}}
    for path, body in [("/generate", {"text": "Hi", "sampling_params": generate}),
                       ("/v1/completions", {"model": MODEL, "prompt": "Hi", **sampling}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **sampling})]:
        resp = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        assert resp.status_code == 400, (path, bias, resp.text)
        assert "logit_bias" in resp.json()["error"]["message"], (path, resp.text)


# ------------------------------------------------------------------------- the client's models, per route
def billed(usage: CompletionUsage) -> tuple[int, int, int]:
    """Usage less its cache hits (a later request finds more of the prompt cached)."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def check_envelopes(events: list, obj: str) -> None:
    """Every event of a response: one id, one creation time, the served model, the route's object type."""
    assert len({e.id for e in events}) == 1 and events[0].id
    assert len({e.created for e in events}) == 1 and all(e.model == MODEL and e.object == obj for e in events)
    assert all(e.system_fingerprint is None or isinstance(e.system_fingerprint, str) for e in events)


def test_completions_parse_as_the_openai_clients_models(http):
    fields = {"n": 2, "logprobs": 2}
    body = Completion.model_validate_json(post(http, "completions", **fields), strict=True)
    check_envelopes([body], "text_completion")
    assert body.id.startswith("cmpl-") and [c.index for c in body.choices] == [0, 1, 2, 3]
    for choice in body.choices:
        lp = choice.logprobs
        assert choice.finish_reason == "length" and choice.text == "".join(lp.tokens)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == TOKENS
        assert all(x <= 0 for x in lp.token_logprobs) and all(1 <= len(top) <= 2 for top in lp.top_logprobs)
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert (body.usage.completion_tokens, body.usage.total_tokens) == (4 * TOKENS, body.usage.prompt_tokens + 12)

    events = [StreamedCompletion.model_validate_json(e, strict=True)
              for e in post(http, "completions", stream=True, stream_options={"include_usage": True}, **fields)]
    check_envelopes(events, "text_completion")
    *chunks, usage = events
    assert usage.choices == [] and billed(usage.usage) == billed(body.usage)
    for choice in body.choices:
        mine = [c for e in chunks for c in e.choices if c.index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + ["length"]
        streamed = mine[-1].logprobs  # a prefix cached since: logprobs equal up to rounding, not bit for bit
        assert (streamed.tokens, streamed.text_offset) == (choice.logprobs.tokens, choice.logprobs.text_offset)
        assert streamed.token_logprobs == pytest.approx(choice.logprobs.token_logprobs, abs=1e-3)
        assert all(c.logprobs is None for c in mine[:-1])


def test_chat_completions_parse_as_the_openai_clients_models(http):
    fields = {"n": 2, "logprobs": True, "top_logprobs": 2}
    body = ChatCompletion.model_validate_json(post(http, "chat", **fields), strict=True)
    check_envelopes([body], "chat.completion")
    assert body.id.startswith("chatcmpl-") and [c.index for c in body.choices] == [0, 1]
    for choice in body.choices:
        message, content = choice.message, choice.logprobs.content
        assert choice.finish_reason == "length" and message.role == "assistant" and message.tool_calls is None
        assert len(content) == TOKENS and "".join(t.token for t in content) == message.content
        assert b"".join(bytes(t.bytes) for t in content).decode() == message.content
        for t in content:
            assert t.logprob <= 0 and len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
            assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)
    assert (body.usage.completion_tokens, body.usage.total_tokens) == (2 * TOKENS, body.usage.prompt_tokens + 6)
    # Characters split across tokens: a token's `bytes` are its own (its `token` text shows U+FFFD), so a client
    # joining them gets the content.
    split = ChatCompletion.model_validate_json(post(http, "chat", logprobs=True, max_tokens=12,
                                                    regex="[中文字😀]{1,2}"), strict=True)
    content = split.choices[0].logprobs.content
    assert any("\ufffd" in t.token for t in content), [t.token for t in content]
    assert b"".join(bytes(t.bytes) for t in content) == split.choices[0].message.content.encode()

    events = [ChatCompletionChunk.model_validate_json(e, strict=True)
              for e in post(http, "chat", stream=True, stream_options={"include_usage": True}, **fields)]
    check_envelopes(events, "chat.completion.chunk")
    *chunks, usage = events
    assert usage.choices == [] and billed(usage.usage) == billed(body.usage)
    assert all(e.usage is None for e in chunks)
    for choice in body.choices:
        mine = [c for e in chunks for c in e.choices if c.index == choice.index]
        assert mine[0].delta.role == "assistant" and all(c.delta.role is None for c in mine[1:])
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + ["length"]
        streamed = mine[-1].logprobs.content  # a prefix cached since: equal up to rounding, not bit for bit
        assert [(t.token, t.bytes) for t in streamed] == [(t.token, t.bytes) for t in choice.logprobs.content]
        assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in choice.logprobs.content], abs=1e-3)
        assert all(c.logprobs is None for c in mine[:-1])
