"""Constrained decoding through the engine on the real model: every output matches, jump-forward pays."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from conftest import wait_idle

from jsgl.engine.request import FinishReason, InvalidRequestError

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
NAME = r"[A-Z][a-z]{1,10}"
REGEXES = {
    "ip": (r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)",
           "What is the IP address of the local host?"),
    "date": (r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", "When did the Berlin wall fall (YYYY-MM-DD)?"),
    "json": (r'\{"name": "' + NAME + r'", "address": \{"city": "' + NAME + r'", "zip": \d{5}\}, "age": \d{1,2}\}',
             "Describe a person as JSON."),
    "literals": (r"(The capital of France is Paris\.|The capital of Germany is Berlin\.|"
                 r"The capital of Italy is Rome\.)", "Name the capital of France."),
    "chinese": (r"(北京|上海|广州)是中国的(首都|城市)。", "用中文说：中国的首都是哪里？"),
}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "country": {"type": "string", "maxLength": 12},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        "coordinates": {"type": "object", "properties": {
            "lat": {"type": "integer", "minimum": -90, "maximum": 90},
            "lon": {"type": "integer", "minimum": -180, "maximum": 180}},
            "required": ["lat", "lon"]},
        "capital": {"type": "boolean"},
    },
    "required": ["name", "country", "population", "coordinates", "capital"],
}


@pytest.mark.parametrize("jump_forward", [True, False])
def test_every_output_fullmatches_its_regex(engine, jump_forward):
    names = list(REGEXES)
    prompts = [CHAT.format(REGEXES[n][1]) for n in names]
    greedy = [{"regex": REGEXES[n][0], "max_new_tokens": 64, "temperature": 0, "jump_forward": jump_forward}
              for n in names]
    sampled = [{**p, "temperature": 0.9, "top_p": 0.95, "seed": i} for i, p in enumerate(greedy)]
    outs = engine.generate(prompts + prompts, greedy + sampled)
    for name, out in zip(names + names, outs):
        assert re.fullmatch(REGEXES[name][0], out.text), (name, out.text)
        assert out.finish_reason == FinishReason.STOP


def test_json_schema_outputs_parse_and_validate(engine):
    prompt = CHAT.format("Give facts about Tokyo as JSON: name, country, population, coordinates, capital.")
    for params in ({"temperature": 0}, {"temperature": 0.8, "seed": 3}):
        out = engine.generate(prompt, {"json_schema": SCHEMA, "max_new_tokens": 96, **params})
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_pydantic_model_schema(engine):
    import pydantic  # a dependency of jsgl (the server's models)

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=10)
        is_capital: bool

    out = engine.generate(CHAT.format("Paris as JSON"), {"json_schema": City.model_json_schema(),
                                                          "max_new_tokens": 40, "temperature": 0})
    City.model_validate_json(out.text)


def test_jump_forward_needs_fewer_forward_passes(engine):
    prompt = CHAT.format("Give facts about Lima as JSON.")
    runs = {}
    for jump in (False, True):
        wait_idle(engine)
        before = engine.stats()["forward_passes"]
        out = engine.generate(prompt, {"json_schema": SCHEMA, "max_new_tokens": 96, "temperature": 0,
                                       "jump_forward": jump})
        runs[jump] = (engine.stats()["forward_passes"] - before, out)
    (plain_passes, plain), (jump_passes, jumped) = runs[False], runs[True]
    assert jumped.jump_forward_tokens > 0 and plain.jump_forward_tokens == 0
    assert jump_passes < plain_passes
    # Sampled (non-jumped) completion tokens bound the passes a request needs.
    assert jump_passes <= jumped.completion_tokens - jumped.jump_forward_tokens + 1
    jsonschema.validate(json.loads(jumped.text), SCHEMA)


def test_constraint_with_stop_string_and_streaming(engine):
    regex = r"[a-z]{2,8}(, [a-z]{2,8}){2}\."  # the comma is forced after at most 8 letters
    handle = engine.submit(CHAT.format("List some fruits in lowercase, separated by commas."),
                           {"regex": regex, "max_new_tokens": 48, "temperature": 0, "stop": ","})
    chunks = list(handle.stream())
    out = handle.result()
    assert "".join(c.text_delta for c in chunks) == out.text
    assert re.fullmatch(r"[a-z]{2,8}", out.text) and out.matched_stop == ","


@pytest.mark.parametrize("params, message", [
    ({"regex": "(unclosed"}, "regex"),
    ({"regex": "a", "json_schema": {"type": "string"}}, "at most one"),
    ({"json_schema": {"type": "object", "properties": {"x": {"not": {"type": "string"}}}}}, ""),
    ({"json_schema": "{not json"}, ""),
])
def test_invalid_constraint_is_a_clear_error_and_engine_keeps_serving(engine, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        engine.submit("hello", params)
    out = engine.generate("hello", {"regex": r"(yes|no)", "max_new_tokens": 4, "temperature": 0})
    assert out.text in ("yes", "no")
