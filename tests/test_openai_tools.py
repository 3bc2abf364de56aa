"""OpenAI API parameters and function calling against a real server on the real model (SmolLM2-135M),
driven by the official `openai` client.

SmolLM2's chat template ignores `tools`, so these run jsgl's fallback (tools described in the system
message, Hermes-style `<tool_call>` blocks); "required" and named tool choices are constrained, so even
this model makes valid calls. Outputs are short: each new shape costs a compile.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from conftest import assert_server_no_leak

from jsgl.server.tool_calls import ToolCallParser

MODEL = "smollm2-135m"
WEATHER_PARAMS = {"type": "object",
                  "properties": {"city": {"type": "string", "maxLength": 20},
                                 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                            "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Get the local time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                                                  "maxLength": 20}},
                                                        "required": ["city"]}}}
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME["function"]["parameters"]}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def chat(oai, **kwargs):
    return oai.chat.completions.create(**{"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 60,
                                          **kwargs})


def check_calls(calls) -> None:
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(oai, **kwargs):
    """(content, [(name, arguments)], finish_reason) reassembled from a stream's deltas, checking
    OpenAI's shape: a call's first delta has its index, id, type and name, later ones arguments only."""
    content, calls, finish = "", {}, None
    for chunk in chat(oai, stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index][1] += tc.function.arguments
        finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


# ------------------------------------------------------------------------------------------ tool calls
def test_named_tool_round_trip(oai):
    first = chat(oai, tools=[WEATHER, TIME], tool_choice=NAMED)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    check_calls([call])
    assert json.loads(call.function.arguments)["city"] == "Paris"
    # The client appends the call and its result; the model then answers in words.
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    second = chat(oai, messages=history, tools=[WEATHER, TIME], tool_choice="none", max_tokens=20)
    answer = second.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")


def test_required_and_stream_equal_non_stream(oai):
    for kwargs in ({"tool_choice": "required"}, {"tool_choice": "required", "parallel_tool_calls": False},
                   {"tool_choice": NAMED}):
        body = chat(oai, tools=[WEATHER, TIME], max_tokens=100, **kwargs).choices[0]
        assert body.finish_reason == "tool_calls" and body.message.tool_calls, kwargs
        check_calls(body.message.tool_calls)
        if kwargs.get("parallel_tool_calls") is False or kwargs["tool_choice"] == NAMED:
            assert len(body.message.tool_calls) == 1
        content, calls, finish = streamed(oai, tools=[WEATHER, TIME], max_tokens=100, **kwargs)
        assert calls == [(c.function.name, c.function.arguments) for c in body.message.tool_calls]
        assert (content or None) == body.message.content and finish == "tool_calls"


def test_auto_and_none(oai):
    plain = chat(oai, max_tokens=16).choices[0]
    none = chat(oai, tools=[WEATHER], tool_choice="none", max_tokens=16).choices[0]
    assert none.message.content == plain.message.content and none.message.tool_calls is None  # tools left out
    # "auto": the 135M model answers in prose here; whatever it writes, the stream says the same.
    auto = chat(oai, tools=[WEATHER], tool_choice="auto", max_tokens=24).choices[0]
    check_calls(auto.message.tool_calls or [])
    content, calls, finish = streamed(oai, tools=[WEATHER], tool_choice="auto", max_tokens=24)
    assert calls == [(c.function.name, c.function.arguments) for c in auto.message.tool_calls or []]
    assert (content or None) == auto.message.content and finish == auto.finish_reason


def test_parser_is_chunking_independent():
    names = frozenset({"get_weather"})
    text = ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>{"arguments": {}, "name": "get_weather"}</tool_call> <tool_call>x</tool_call>')

    def run(pieces):
        parser = ToolCallParser(names)
        deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish()
        streamed = [tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", [])]
        return "".join(d.get("content", "") for d in deltas), [(c.name, c.arguments) for c in parser.calls], streamed

    content, calls, _ = whole = run([text])
    assert (content, calls) == ("Sure.<tool_call>x</tool_call>",
                                [("get_weather", '{"city": "Pa}ris", "unit": "celsius"}'), ("get_weather", "{}")])
    for size in (1, 2, 3, 7):
        assert run([text[i:i + size] for i in range(0, len(text), size)])[:2] == whole[:2]
    assert len(run(list(text))[2]) > 10  # fed a character at a time, the arguments stream as they come
    # Output that ends inside the close tag (max_tokens) still gives clean arguments.
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_c'
    assert run([cut])[1] == run(list(cut))[1] == [("get_weather", '{"city": "Rome"}')]


# ------------------------------------------------------------------------------------- OpenAI parameters
def test_logit_bias(engine, oai):
    prompt = "The capital of France is"

    def first_token(**kwargs):
        resp = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, **kwargs)
        return resp.choices[0].text

    greedy = first_token()
    greedy_id = engine.tokenizer.encode(greedy, add_special_tokens=False)[0]
    forced_id = engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    assert first_token(logit_bias={str(forced_id): 100}) == engine.tokenizer.decode([forced_id])
    assert first_token(logit_bias={str(greedy_id): -100}) != greedy
    # Chat goes through the same field.
    forced = chat(oai, max_tokens=1, logit_bias={str(forced_id): 100}).choices[0].message.content
    assert forced == engine.tokenizer.decode([forced_id])


def test_seed_n_and_extensions(oai):
    def sample(seed, n=1):
        resp = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                      seed=seed, n=n)
        return [c.text for c in resp.choices], resp

    assert sample(7)[0] == sample(7)[0]
    three, resp = sample(7, n=3)
    assert [c.index for c in resp.choices] == [0, 1, 2] and len(set(three)) > 1
    assert three[0] == sample(7)[0][0] and three[1] == sample(8)[0][0]  # choice k is seeded seed + k
    assert resp.usage.completion_tokens == 36
    # SGLang's extensions through extra_body: min_tokens (-> min_new_tokens), ignore_eos, top_k, regex.
    resp = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=6, temperature=1.0,
                                  extra_body={"min_tokens": 6, "ignore_eos": True, "top_k": 1, "regex": "[0-9]+"})
    assert resp.usage.completion_tokens == 6 and resp.choices[0].text.isdigit()


def test_response_format_json_schema(oai):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    msg = chat(oai, messages=[{"role": "user", "content": "Invent a person. Answer in JSON."}], max_tokens=40,
               response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    jsonschema.validate(json.loads(msg.choices[0].message.content), schema)


def test_unsupported_fields_get_400(http, oai):
    cases = [("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
             ("prediction", {"type": "content", "content": "x"}), ("web_search_options", {}),
             ("functions", [{"name": "f"}]), ("store", True), ("reasoning_effort", "high"),
             ("lora_path", "adapter")]
    for field, value in cases:
        resp = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, field: value})
        assert resp.status_code == 400, (field, resp.text)
        assert f"`{field}`" in resp.json()["error"]["message"]
    # At their defaults (clients send nulls) they are fine.
    ok = chat(oai, max_tokens=2, extra_body={"audio": None, "modalities": ["text"], "prediction": None,
                                             "store": False, "service_tier": "auto", "metadata": {"k": "v"}})
    assert ok.choices[0].message.content is not None
    for body, needle in [({"logit_bias": {"5": 500}}, "logit_bias"), ({"logit_bias": {"99999999": 1}}, "logit_bias"),
                         ({"tool_choice": "required"}, "tool_choice"),
                         ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                          "nope"),
                         ({"tools": [WEATHER], "tool_choice": "required", "regex": "a"}, "tool_choice")]:
        resp = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 2, **body})
        assert resp.status_code == 400 and needle in resp.json()["error"]["message"], (body, resp.text)


def test_retrieve_model(http, oai):
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")
    body = http.get("/v1/models/no-such-model").json()
    assert body["error"]["code"] == 404 and "no-such-model" in body["error"]["message"]


def test_no_leak(http):
    assert_server_no_leak(http)
