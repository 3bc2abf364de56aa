"""JSON schema -> regex (checked with `re`, our CharFSM and `jsonschema`), dtype regexes, index caching."""

from __future__ import annotations

import json
import random
import time
from enum import StrEnum
from functools import cache
from typing import Any, Literal

import jsonschema
import numpy as np
import pytest
from conftest import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from jsgl.engine.request import InvalidRequestError
from jsgl.fsm import (
    DTYPE_REGEX,
    RegexConstraint,
    clear_memory_cache,
    compile_regex,
    get_index,
    get_index_async,
    json_schema_to_regex,
    regex_for_dtype,
)
from jsgl.model.tokenizer import load_tokenizer


class Color(StrEnum):
    red = "red"
    green = "green"


class Address(BaseModel):
    street: str = Field(max_length=8)
    zip: int = Field(ge=1000, le=99999)
    country: Literal["FR", "DE", "中国"] = "FR"


class Person(BaseModel):
    name: str = Field(min_length=1, max_length=6)
    age: int = Field(ge=0, lt=150)
    height: float = Field(ge=0)
    member: bool
    color: Color
    address: Address
    tags: list[str] = Field(min_length=1, max_length=3)
    nickname: str | None = None
    pair: tuple[int, str]
    scores: dict[str, int] = {}
    born: str = Field(json_schema_extra={"format": "date"})


RAW_SCHEMA: dict[str, Any] = {
    "type": "object",
    "definitions": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                              "required": ["x", "y"], "additionalProperties": False}},
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "kind": {"const": "shape"},
        "label": {"type": ["string", "null"], "maxLength": 4},
        "points": {"type": "array", "items": {"$ref": "#/definitions/point"}, "minItems": 1, "maxItems": 3},
        "value": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5}, {"type": "boolean"}]},
        "extra": {},
    },
    "required": ["kind", "points"],
}

SCHEMAS = {"person": Person.model_json_schema(), "raw": RAW_SCHEMA}
CHARS = list("aZ9 _-\"\\/\n\té中ж") + ["😀"]


def resolve(root: dict, schema: dict) -> dict:
    while "$ref" in schema:
        node: Any = root
        for part in schema["$ref"][2:].split("/"):
            node = node[part]
        schema = node
    return schema


def sample(root: dict, schema: Any, rnd: random.Random) -> Any:
    """A random instance valid under the (supported subset of the) schema."""
    if schema in (True, {}):
        return rnd.choice([None, 1, "x", [1, "a"], {"k": True}, 2.5])  # ANY_VALUE_DEPTH = 1
    schema = resolve(root, schema)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rnd.choice(schema["enum"])
    if "anyOf" in schema:
        return sample(root, rnd.choice(schema["anyOf"]), rnd)
    t = schema.get("type")
    t = rnd.choice(t) if isinstance(t, list) else t
    if t == "string":
        if schema.get("format") == "date":
            return f"{rnd.randint(0, 9999):04d}-{rnd.randint(1, 12):02d}-{rnd.randint(1, 31):02d}"
        if schema.get("format") == "uuid":
            return "-".join(f"{rnd.getrandbits(4 * n):0{n}x}" for n in (8, 4, 4, 4, 12))
        n = rnd.randint(schema.get("minLength", 0), schema.get("maxLength", 8))
        return "".join(rnd.choice(CHARS) for _ in range(n))
    if t == "integer":
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -10**6 - 1) + 1)
        hi = schema.get("maximum", schema.get("exclusiveMaximum", 10**6 + 1) - 1)
        return rnd.randint(lo, hi)
    if t == "number":
        v = rnd.choice([rnd.uniform(-1e3, 1e3), float(rnd.randint(-99, 99)), rnd.randint(-99, 99), 1e-7, 1.5e20])
        return abs(v) if "minimum" in schema else v
    if t == "boolean":
        return rnd.random() < 0.5
    if t == "null":
        return None
    if t == "array":
        if "prefixItems" in schema:
            return [sample(root, s, rnd) for s in schema["prefixItems"]]
        n = rnd.randint(schema.get("minItems", 0), schema.get("maxItems", 3))
        return [sample(root, schema.get("items", {}), rnd) for _ in range(n)]
    props = schema.get("properties", {})
    if not props:
        extra = schema.get("additionalProperties", {})
        return {f"k{i}": sample(root, extra, rnd) for i in range(rnd.randint(0, 2))}
    req = set(schema.get("required", []))
    return {k: sample(root, s, rnd) for k, s in props.items() if k in req or rnd.random() < 0.5}


LAYOUTS = {  # whitespace pattern -> how json.dumps lays out a matching document
    None: {},
    "": {"separators": (",", ":")},
    r"[ \n]?": {},
    r"[ \n]*": {"indent": 2},
}


@cache
def schema_regex(name: str, whitespace: str | None) -> str:
    return json_schema_to_regex(SCHEMAS[name], whitespace=whitespace)


@cache
def schema_fsm(name: str, whitespace: str | None):
    return compile_regex(schema_regex(name, whitespace))


@pytest.mark.parametrize(("name", "whitespace"), [
    ("person", None), ("person", ""), ("person", r"[ \n]?"), ("person", r"[ \n]*"), ("raw", None), ("raw", r"[ \n]*"),
], ids=["person-dumps", "person-compact", "person-ws?", "person-indent", "raw-dumps", "raw-indent"])
@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), ascii_only=st.booleans())
def test_valid_instances_fullmatch(name: str, whitespace: str | None, seed: int, ascii_only: bool) -> None:
    import re

    schema, rnd = SCHEMAS[name], random.Random(seed)
    inst = sample(schema, schema, rnd)
    jsonschema.validate(inst, schema)  # the generator itself is right
    text = json.dumps(inst, ensure_ascii=ascii_only, **LAYOUTS[whitespace])
    assert re.fullmatch(schema_regex(name, whitespace), text), text
    assert schema_fsm(name, whitespace).accepts(text), text


def _mutations(inst: dict, rnd: random.Random) -> list[Any]:
    out: list[Any] = []
    for key in inst:
        bad = dict(inst)
        bad[key] = rnd.choice([[1, 2, 3, 4, 5], "oops", 10**9, -3, {"z": 1}, None, 1.5, True])
        out.append(bad)
        out.append({k: v for k, v in inst.items() if k != key})
    return out


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_regex_only_accepts_valid_documents(name: str, seed: int) -> None:
    """Soundness: whatever the regex accepts is schema-valid, checked on mutated instances."""
    import re

    schema, rnd = SCHEMAS[name], random.Random(seed)
    rx = schema_regex(name, None)
    rejected = 0
    for bad in _mutations(sample(schema, schema, rnd), rnd):
        text = json.dumps(bad)
        if re.fullmatch(rx, text):
            jsonschema.validate(bad, schema)
        else:
            rejected += 1
    assert rejected > 0


def test_layouts_and_jump_forward_prefix() -> None:
    class User(BaseModel):
        name: str
        age: int

    assert json_schema_to_regex(User) == r'\{(?:"name": ' + json_schema_to_regex({"type": "string"}) + (
        r', "age": -?(?:0|[1-9][0-9]*))\}')
    tok = load_tokenizer("smollm2-135m")
    for ws, jump in [(None, '{"name": "'), ("", '{"name":"'), (r"[ \n]?", "{")]:
        index = get_index(json_schema_to_regex(User, whitespace=ws), tok)
        assert RegexConstraint(index).jump_forward_text() == jump


def test_specific_keywords() -> None:
    import re

    opt = json_schema_to_regex({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "null"}}})
    for doc in ["{}", '{"a": 1}', '{"b": null}', '{"a": 1, "b": null}']:
        assert re.fullmatch(opt, doc)
    for doc in ['{, "b": null}', '{"a": 1, }', '{"b": null, "a": 1}']:
        assert not re.fullmatch(opt, doc)
    arr = json_schema_to_regex({"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3})
    assert [bool(re.fullmatch(arr, json.dumps([True] * n))) for n in range(5)] == [False, False, True, True, False]
    s = json_schema_to_regex({"type": "string", "minLength": 2, "maxLength": 3})
    assert [bool(re.fullmatch(s, json.dumps("😀" * n))) for n in range(5)] == [False, False, True, True, False]
    assert re.fullmatch(json_schema_to_regex({"enum": ["é", 3, None, [1, 2]]}), '"\\u00e9"')
    assert re.fullmatch(json_schema_to_regex({"enum": ["é", 3, None, [1, 2]]}), "[1, 2]")
    assert re.fullmatch(json_schema_to_regex({"type": "integer", "exclusiveMinimum": 3}), "4")
    assert not re.fullmatch(json_schema_to_regex({"type": "integer", "exclusiveMinimum": 3}), "3")
    assert json_schema_to_regex(json.dumps({"type": "boolean"})) == "(?:true|false)"
    for ws, layout in LAYOUTS.items():  # enum/const containers follow the layout too
        rx = json_schema_to_regex({"enum": [[1, {"a": []}], {}]}, whitespace=ws)
        assert re.fullmatch(rx, json.dumps([1, {"a": []}], **layout)) and re.fullmatch(rx, json.dumps({}, **layout))
    code = json_schema_to_regex({"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"})
    assert re.fullmatch(code, '"ABC-12"') and not re.fullmatch(code, '"AB-12"')


@pytest.mark.parametrize("schema", [
    {"type": "foo"},
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    {"not": {"type": "string"}},
    {"type": "number", "maximum": 3},
    {"$ref": "#/$defs/missing"},
    {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},
    {"allOf": [{"type": "string"}, {"maxLength": 3}]},
    {"type": "object", "patternProperties": {"^a": {}}},
    "{not json",
    ["a list"],
])
def test_unsupported_schema_raises(schema: Any) -> None:
    with pytest.raises(InvalidRequestError):
        json_schema_to_regex(schema)


def test_dtype_regexes() -> None:
    import re

    cases = {int: (["0", "-12", "+7"], ["1.5", "", "a"]), float: (["1.5", "-.5", "3", "2e-3"], [".", "1.2.3"]),
             bool: (["True", "False"], ["true", "1"]), str: (['"hi"', '"a \\"q\\""'], ['"x', "hi"])}
    for dtype, (good, bad) in cases.items():
        rx = regex_for_dtype(dtype)
        assert rx == DTYPE_REGEX[dtype] == regex_for_dtype(dtype.__name__)
        assert all(re.fullmatch(rx, g) for g in good) and not any(re.fullmatch(rx, b) for b in bad)
        assert all(compile_regex(rx).accepts(g) for g in good)
    with pytest.raises(InvalidRequestError):
        regex_for_dtype(list)


def test_index_caching_memory_disk_async(tmp_path, monkeypatch) -> None:
    tok = load_tokenizer("smollm2-135m")
    monkeypatch.setenv("JSGL_CACHE_DIR", str(tmp_path))
    rx = json_schema_to_regex(Person)
    t0 = time.perf_counter()
    f1, f2 = get_index_async(rx, tok), get_index_async(rx, tok)
    assert f1 is f2  # one build for concurrent requests
    index = f1.result(timeout=60)
    print(f"\nPerson schema regex: {index.num_states} states, built in {index.build_seconds:.2f}s "
          f"(wall {time.perf_counter() - t0:.2f}s)")
    assert get_index_async(rx, tok).result() is index  # memory hit
    files = list((tmp_path / "fsm").glob("*.npz"))
    assert len(files) == 1
    clear_memory_cache()
    loaded = get_index(rx, tok)  # disk hit
    assert loaded is not index
    assert np.array_equal(loaded.masks, index.masks) and np.array_equal(loaded.next_states, index.next_states)
    assert loaded.jump_strings == index.jump_strings and loaded.eos_ids == index.eos_ids
    assert not loaded.mask(0).flags.writeable
    small, padded = get_index("[0-9]+", tok), get_index("[0-9]+", tok, vocab_size=49200)
    assert padded.masks.shape[1] == 1538 and np.array_equal(padded.masks[:, :1536], small.masks)
    assert not padded.masks[:, 1536:].any()
