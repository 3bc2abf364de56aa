"""JSON schema -> regex (jsgl/fsm/json_schema.py), checked with Python's `re` only (no FSM or token index).

The reference is the `jsonschema` validator (Draft 2020-12): a JSON document in the regex's layout must
fullmatch exactly when jsonschema says it is valid, wherever the converter claims to be exact; where it
deliberately accepts a subset (declared property order, no extra properties, schema-less values one level
deep, formats), the cases are hand-computed and every match is still checked to be valid.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from jsgl.errors import ConstraintBudgetError, InvalidRequestError
from jsgl.fsm.budget import BuildBudget
from jsgl.fsm.json_schema import DTYPE_REGEX, json_schema_to_regex, literal, regex_for_dtype
from jsgl.fsm.static_check import check_regex

LAYOUTS: dict[str | None, dict[str, Any]] = {  # whitespace pattern -> json.dumps layout it must match
    None: {},
    "": {"separators": (",", ":")},
    r"[ \n]*": {"indent": 2},
    r"[ ]?": {},
}
INT = r"-?(?:0|[1-9][0-9]*)"
LIMIT = "the server's limit (e.g. through $refs that repeat other definitions)"
# Values of every JSON type (no integral floats: jsonschema counts 2.0 as an integer, JSON text "2.0" is not).
POOL: list[Any] = [None, True, False, 0, 1, -1, 7, 42, -30, 10**20, -3.5, 0.25, 1e-07, 1.5e-20, "", "a", "ab", "é",
                   "😀", 'q"\\', "\n", [], [1], [1, "a"], [[1]], {}, {"a": 1}, {"b": "x", "a": None}]


def rx(schema: Any, ws: str | None = None, budget: BuildBudget | None = None) -> str:
    return json_schema_to_regex(schema, whitespace=ws, budget=budget)


def full(regex: str, text: str) -> bool:
    return re.fullmatch(regex, text) is not None


def assert_agrees(schema: dict[str, Any], instances: list[Any], ws: str | None = None) -> None:
    """The regex accepts json.dumps(instance) (in the layout of `ws`) iff jsonschema accepts the instance."""
    regex = re.compile(rx(schema, ws))
    validator = jsonschema.Draft202012Validator(schema)
    for inst in instances:
        text = json.dumps(inst, **LAYOUTS[ws])
        assert (regex.fullmatch(text) is not None) == validator.is_valid(inst), (schema, ws, text)


def assert_sound(schema: dict[str, Any], instances: list[Any], ws: str | None = None) -> int:
    """Whatever the regex accepts is valid; returns how many instances matched."""
    regex = re.compile(rx(schema, ws))
    validator = jsonschema.Draft202012Validator(schema)
    hits = 0
    for inst in instances:
        if regex.fullmatch(json.dumps(inst, **LAYOUTS[ws])):
            assert validator.is_valid(inst), (schema, inst)
            hits += 1
    return hits


def error(schema: Any, budget: BuildBudget | None = None, ws: str | None = None) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        json_schema_to_regex(schema, whitespace=ws, budget=budget)
    return info.value


def refused(schema: Any) -> str:
    """Message of an InvalidRequestError raised before conversion (the schema's container)."""
    e = error(schema)
    assert type(e) is InvalidRequestError, e
    return str(e)


def unsupported(schema: Any, budget: BuildBudget | None = None) -> str:
    """What the converter says it cannot express (an InvalidRequestError that is not a budget error)."""
    e = error(schema, budget)
    assert type(e) is InvalidRequestError, e
    prefix = "unsupported JSON schema: "
    assert str(e).startswith(prefix), e
    return str(e).removeprefix(prefix)


def over(schema: Any, budget: BuildBudget, ws: str | None = None) -> str:
    """What a ConstraintBudgetError says is over the budget."""
    e = error(schema, budget, ws)
    assert type(e) is ConstraintBudgetError, e
    prefix = "JSON schema over the server's budget: "
    assert str(e).startswith(prefix), e
    return str(e).removeprefix(prefix)


def fails(msg: str, schema: Any, budget: BuildBudget | None = None) -> None:
    assert unsupported(schema, budget) == msg


def overs(msg: str, schema: Any, budget: BuildBudget, ws: str | None = None) -> None:
    assert over(schema, budget, ws) == msg


# --- scalar types, type lists, enum / const -------------------------------------------------------------------


@pytest.mark.parametrize("ws", list(LAYOUTS))
@pytest.mark.parametrize("types", ["string", "integer", "number", "boolean", "null", ["integer", "null"],
                                   ["string", "boolean"], ["number", "string", "null"]])
def test_types_agree_with_jsonschema(types: Any, ws: str | None) -> None:
    assert_agrees({"type": types}, POOL, ws)


def test_scalar_regexes_exactly() -> None:
    assert rx({"type": "boolean"}) == "(?:true|false)"
    assert rx({"type": "null"}) == "null"
    assert rx({"type": "integer"}) == INT
    assert rx({"type": "integer", "title": "n", "description": "d", "default": 1}) == INT  # annotations ignored
    assert rx({"type": ["integer", "null"]}) == f"(?:{INT}|null)"
    assert rx({"type": "number"}) == INT + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
    assert rx(json.dumps({"type": "boolean"})) == "(?:true|false)"  # a JSON string


ENUMS: list[dict[str, Any]] = [
    {"enum": ["a", 1, None, [1, 2], {"a": 1}]},
    {"enum": [True, "ab", -30]},
    {"const": "é"},
    {"const": {"b": "x", "a": None}},
    {"const": [1, "a"]},
    {"const": []},
    {"const": {}},
    {"const": 0.25},
    {"const": 'q"\\'},
    {"const": "\n"},
]


@pytest.mark.parametrize("ws", list(LAYOUTS))
@pytest.mark.parametrize("schema", ENUMS, ids=[json.dumps(s, ensure_ascii=False) for s in ENUMS])
def test_enum_const_agree_with_jsonschema(schema: dict[str, Any], ws: str | None) -> None:
    assert_agrees(schema, POOL + [[1, 2], [2, 1], {"a": 2}, ["a", 1], 0.255, "A", False], ws)


def test_enum_const_regexes_exactly() -> None:
    assert rx({"enum": ["ab", "é"]}) == r'(?:"ab"|(?:"\\u00e9"|"é"))'  # both json.dumps spellings of "é", sorted
    assert rx({"enum": [1, 1, 2, 1]}) == "(?:1|2)"  # deduplicated, first-seen order
    assert rx({"const": "a.b*"}) == r'(?:"a\.b\*")'
    assert not full(rx({"const": "a.b"}), '"axb"') and not full(rx({"const": 1.5}), "105")
    assert rx({"const": {}}) == r"(?:\{\})" and rx({"const": []}, ws="") == r"(?:\[\])"
    assert rx({"const": [1, {"k": 2}]}) == r'(?:\[1, \{"k": 2\}\])'
    assert rx({"const": [1, {"k": 2}]}, ws="") == r'(?:\[1,\{"k":2\}\])'
    ws_rx = rx({"const": [1, []]}, ws="x")  # the layout's whitespace inside brackets and around separators
    assert ws_rx == r"(?:\[(?:x)1(?:x),(?:x)\[(?:x)\](?:x)\])"
    assert full(ws_rx, "[x1x,x[x]x]") and not full(ws_rx, "[1,[]]")
    assert full(rx({"const": {}}, ws=" "), "{ }") and not full(rx({"const": {}}, ws=" "), "{}")
    fails("empty enum", {"enum": []})


# --- strings --------------------------------------------------------------------------------------------------

LENGTHS = [{}, {"minLength": 0}, {"minLength": 1}, {"maxLength": 0}, {"maxLength": 1}, {"maxLength": 3},
           {"minLength": 2, "maxLength": 3}, {"minLength": 2, "maxLength": 2}, {"minLength": 4},
           {"minLength": 1.0, "maxLength": 2.0}]


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=6), ascii_only=st.booleans(), bounds=st.sampled_from(LENGTHS))
def test_string_lengths_count_decoded_characters(text: str, ascii_only: bool, bounds: dict[str, Any]) -> None:
    """minLength/maxLength count characters after JSON decoding (escapes and surrogate pairs are one)."""
    schema = {"type": "string", **bounds}
    doc = json.dumps(text, ensure_ascii=ascii_only)
    ok = jsonschema.Draft202012Validator(schema).is_valid(text)
    assert full(rx(schema), doc) == ok, (schema, doc)


def test_string_lengths_and_escapes_by_hand() -> None:
    s13 = rx({"type": "string", "minLength": 1, "maxLength": 3})
    for doc, ok in [('""', False), ('"a"', True), ('"abc"', True), ('"abcd"', False), ('"\\ud83d\\ude00"', True),
                    ('"\\n\\t\\"\\\\\\/\\b\\f\\r"', False), ('"\\n\\t\\/"', True), ('"\\u00e9x"', True),
                    ('"😀😀😀"', True)]:
        assert full(s13, doc) == ok, doc
    s = rx({"type": "string"})
    for doc in ['"a', 'a"', "abc", '"\\x"', '"\\ud800"', '"\\ude00\\ud83d"', '"\x01"', '"a"b"', '"\\u00g0"', "'a'"]:
        assert not full(s, doc), doc  # not a JSON string, or a lone surrogate
    assert full(s, '""') and full(s, '"\\uD83D\\uDE00"') and full(s, '"\\u20AC"')
    empty = rx({"type": "string", "maxLength": 0})
    assert full(empty, '""') and not full(empty, '"a"')
    assert not full(rx({"type": "string", "minLength": 1}), '""')


def test_string_pattern_anchors() -> None:
    both = rx({"type": "string", "pattern": "^[A-Z]{2}-[0-9]$"})
    assert both == '"(?:[A-Z]{2}-[0-9])"'
    assert full(both, '"AB-1"') and not full(both, '"AB-12"') and not full(both, '"A-1"')
    assert rx({"type": "string", "pattern": "^ab"}) == '"(?:ab)"'
    assert rx({"type": "string", "pattern": "ab$"}) == '"(?:ab)"'
    assert rx({"type": "string", "pattern": "a|b"}) == '"(?:a|b)"'  # grouped: the quotes apply to both
    dollar = rx({"type": "string", "pattern": r"^a\$"})  # an escaped `$` is a character, not an anchor
    assert dollar == r'"(?:a\$)"' and full(dollar, '"a$"')
    assert assert_sound({"type": "string", "pattern": "^[A-Z]{2}-[0-9]$"}, ["AB-1", "AB-", "ab-1", "XY-9"]) == 2


FORMAT_CASES = {
    "date": (["2024-02-29", "0001-12-31", "1999-10-01"], ["2024-13-01", "2024-00-10", "2024-01-32", "24-01-01",
                                                          "2024-1-01", "2024-01-01T00:00:00"]),
    "time": (["23:59:59", "00:00:00.123Z", "12:30:00+02:00", "12:30:00-23:59"],
             ["24:00:00", "12:60:00", "12:00", "12:00:00+2:00", "12:00:00Zx"]),
    "date-time": (["2024-02-29T23:59:59Z", "2024-02-29T00:00:00.5+01:00"],
                  ["2024-02-29 23:59:59", "2024-02-29", "T23:59:59"]),
    "uuid": (["123e4567-e89b-12d3-a456-426614174000", "ABCDEF01-2345-6789-abcd-ef0123456789"],
             ["123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400g", "{123e4567-e89b}"]),
}


@pytest.mark.parametrize("fmt", sorted(FORMAT_CASES))
def test_string_formats(fmt: str) -> None:
    good, bad = FORMAT_CASES[fmt]
    regex = rx({"type": "string", "format": fmt})
    assert all(full(regex, json.dumps(g)) for g in good) and not any(full(regex, json.dumps(b)) for b in bad)


def test_unknown_format_is_an_annotation() -> None:
    schema = {"type": "string", "format": "email", "maxLength": 2}
    assert_agrees(schema, POOL + ["not an email", "xy", "xyz"])


# --- numbers and integers -------------------------------------------------------------------------------------


def test_numbers() -> None:
    numbers = [0, 1, -1, 42, -30, 10**20, -3.5, 0.25, 1e-07, 1.5e-20, -2e-05, 123.456]
    assert_agrees({"type": "number"}, POOL + numbers)
    nonneg = {"type": "number", "minimum": 0}
    assert_agrees(nonneg, POOL + numbers)
    assert rx(nonneg) == r"(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
    assert rx({"type": "number", "minimum": 0.0}) == rx(nonneg)
    for bad in ["1.", ".5", "01", "1e", "+1", "--1", "1.5.2", "0x10", "NaN", "Infinity"]:
        assert not full(rx({"type": "number"}), bad), bad
    for doc in ["1E5", "1e+5", "-0", "0.0", "-0.5e-3"]:
        assert full(rx({"type": "number"}), doc), doc
    for bounds in [{"maximum": 3}, {"exclusiveMaximum": 3}, {"exclusiveMinimum": 0}, {"minimum": 1},
                   {"minimum": -1}, {"minimum": 0, "maximum": 9}]:
        fails("bounds on numbers (other than minimum: 0)", {"type": "number", **bounds}), bounds


BOUND = st.one_of(st.none(), st.integers(-12, 12), st.integers(-24, 24).map(lambda n: n / 2))


@settings(max_examples=80, deadline=None)
@given(lo=BOUND, hi=BOUND, xlo=BOUND, xhi=BOUND)
def test_integer_bounds_agree_with_jsonschema(lo: Any, hi: Any, xlo: Any, xhi: Any) -> None:
    bounds = {k: v for k, v in [("minimum", lo), ("maximum", hi), ("exclusiveMinimum", xlo),
                                ("exclusiveMaximum", xhi)] if v is not None}
    schema = {"type": "integer", **bounds}
    inside = [n for n in range(-16, 17) if jsonschema.Draft202012Validator(schema).is_valid(n)]
    if not inside:
        assert unsupported(schema).startswith("empty integer range [")
        return
    assert_agrees(schema, list(range(-16, 17)) + [-100, 100, 10**20, 2.5, "3", True, None])


def test_integer_bounds_by_hand() -> None:
    assert rx({"type": "integer", "minimum": 3, "maximum": 3}) == "3"
    fails("empty integer range [5, 3]", {"type": "integer", "minimum": 5, "maximum": 3})
    fails("empty integer range [3, 2]", {"type": "integer", "exclusiveMinimum": 2, "exclusiveMaximum": 3})
    assert rx({"type": "integer", "exclusiveMinimum": 2, "exclusiveMaximum": 4}) == "3"
    assert rx({"type": "integer", "minimum": 2.5, "maximum": 3.5}) == "3"
    for key in ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"]:
        for v in [True, "3", float("inf"), float("-inf"), float("nan"), [1]]:
            fails(f"{key} must be a finite number, got {v!r}", {"type": "integer", key: v})


def test_integer_bound_digits_budget() -> None:
    budget = BuildBudget(max_integer_digits=2)
    assert full(rx({"type": "integer", "minimum": -99, "maximum": 99}, budget=budget), "-99")
    digits = "exceeds the server's limit (integers of at most 2 digits)"
    overs(f"maximum 100 {digits}", {"type": "integer", "maximum": 100}, budget)
    overs(f"minimum -100 {digits}", {"type": "integer", "minimum": -100}, budget)
    overs(f"exclusiveMaximum 1.23e+03 {digits}", {"type": "integer", "exclusiveMaximum": 1234.5}, budget)
    above = rx({"type": "integer", "exclusiveMinimum": 99.5}, budget=budget)  # |99.5| < 10**2: allowed
    assert full(above, "100") and not full(above, "99")
    fails("bounds on numbers (other than minimum: 0)", {"type": "number", "maximum": 99}, budget)


# --- arrays ---------------------------------------------------------------------------------------------------

COUNTS = [None, 0, 1, 2, 3]


@pytest.mark.parametrize("ws", list(LAYOUTS))
def test_array_item_counts_agree_with_jsonschema(ws: str | None) -> None:
    instances = [[7] * n for n in range(6)] + [["a"], [1, "a"], [1, 2.5], "x", None, {}]
    for lo, hi in itertools.product(COUNTS, COUNTS):
        schema: dict[str, Any] = {"type": "array", "items": {"type": "integer"}}
        schema |= {"minItems": lo} if lo is not None else {}
        schema |= {"maxItems": hi} if hi is not None else {}
        if lo is not None and hi is not None and lo > hi:
            fails(f"minItems {lo} > maxItems {hi}", schema)
        else:
            assert_agrees(schema, instances, ws)


def test_array_regexes_by_hand() -> None:
    assert rx({"type": "array", "items": {"type": "null"}, "maxItems": 0}) == r"\[\]"
    assert rx({"type": "array", "items": {"type": "null"}, "maxItems": 0}, ws=" ") == r"\[(?: )(?: )\]"
    assert rx({"type": "array", "items": {"type": "null"}}) == r"\[(?:null(?:, null){0,})?\]"
    assert rx({"type": "array", "items": {"type": "null"}, "minItems": 2, "maxItems": 4}) == r"\[null(?:, null){1,3}\]"
    assert rx({"items": {"type": "null"}, "minItems": 1}) == r"\[null(?:, null){0,}\]"  # type inferred
    assert rx({"type": "array", "items": {"type": "null"}, "minItems": 3.0}) == r"\[null(?:, null){2,}\]"


def test_array_prefix_items() -> None:
    pair = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}
    assert rx(pair) == r'\[' + INT + r', "' + rx({"type": "string"})[1:-1] + r'"\]'
    candidates = [[1, "a"], [1], ["a", 1], [1, "a", 2], [], [1, 2]]
    assert assert_sound(pair, candidates) == 1 and full(rx(pair), '[1, "a"]')  # exactly the prefix
    more = {**pair, "items": {"type": "boolean"}, "maxItems": 4}
    assert assert_sound(more, candidates + [[1, "a", True], [1, "a", True, False], [1, "a", True, False, True],
                                            [1, "a", 2]]) == 3
    assert rx({**pair, "items": {"type": "boolean"}}).endswith(r"(?:, (?:true|false)){0,}\]")
    assert rx({**pair, "items": {"type": "boolean"}, "maxItems": 2}).endswith(r"(?:, (?:true|false)){0,0}\]")
    fails("maxItems 1 is smaller than the 2 prefixItems", {**pair, "items": {"type": "boolean"}, "maxItems": 1})
    compact = rx({**pair, "items": {"type": "boolean"}}, ws="")
    assert full(compact, '[1,"a",true,false]') and not full(compact, '[1, "a"]')


def test_bugs_this_file_found_stay_fixed() -> None:
    """Found while writing this file (each accepted documents the schema refuses, or crashed)."""
    # `items: false` alone allows only [] (the regex accepted "[, ]").
    assert_agrees({"type": "array", "items": False}, POOL + [[], [1], [None, None]])
    assert not full(rx({"type": "array", "items": False}), "[, ]")
    fails("minItems 1 with items false: no array is valid", {"type": "array", "items": False, "minItems": 1})
    # minItems beyond the prefix asks for more items (it was ignored).
    grow = {"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "integer"}, "minItems": 3}
    assert assert_sound(grow, [[1], [1, 2], [1, 2, 3], [1, 2, 3, 4], []]) == 2
    fails("minItems 2 needs more than the 1 prefixItems, and items is false",
          {"type": "array", "prefixItems": [{"type": "integer"}], "items": False, "minItems": 2})
    fails("maxItems 0 is smaller than the 1 prefixItems",
          {"type": "array", "prefixItems": [{"type": "integer"}], "items": False, "maxItems": 0})
    # A type list naming an unknown type is refused by name (it was a KeyError: a 500).
    fails("unknown type 'list'", {"type": ["integer", "list"]})
    # Length bounds beside a pattern or an enforced format are refused, not dropped.
    fails("minLength/maxLength together with pattern or format", {"type": "string", "format": "date", "maxLength": 3})
    fails("minLength/maxLength together with pattern or format", {"type": "string", "pattern": "a+", "minLength": 2})


# --- objects --------------------------------------------------------------------------------------------------

PROPS = {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 2}, "c": {"type": "boolean"}}
VALUES = {"a": 5, "b": "xy", "c": False}


@pytest.mark.parametrize("ws", list(LAYOUTS))
@pytest.mark.parametrize("required", [list(r) for n in range(4) for r in itertools.combinations("abc", n)],
                         ids=lambda r: "req-" + "".join(r))
def test_object_required_and_optional_agree_with_jsonschema(required: list[str], ws: str | None) -> None:
    """Every subset of the properties, in declared order: present iff required ones are all there."""
    schema = {"type": "object", "properties": PROPS, "required": required}
    subsets = [{k: VALUES[k] for k in keys} for n in range(4) for keys in itertools.combinations("abc", n)]
    wrong = [{"a": "5"}, {"b": "xyz"}, {"a": 5, "b": "xy", "c": 0}]
    assert_agrees(schema, subsets + wrong + [None, [], "a"], ws)
    # Declared order only, no extra properties (valid JSON Schema instances that the regex leaves out).
    assert not full(rx(schema, ws), json.dumps({"c": False, "a": 5, "b": "xy"}, **LAYOUTS[ws]))
    assert not full(rx(schema, ws), json.dumps({**VALUES, "d": 1}, **LAYOUTS[ws]))


def test_object_regexes_by_hand() -> None:
    req = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert rx(req) == r'\{(?:"a": ' + INT + r")\}"
    opt = {"type": "object", "properties": {"a": {"type": "null"}, "b": {"type": "null"}}}
    assert rx(opt) == r'\{(?:"a": null(?:, "b": null)?|"b": null|)\}'
    mid = {"properties": {"a": {"type": "null"}, "b": {"type": "null"}, "c": {"type": "null"}}, "required": ["b"]}
    assert rx(mid) == r'\{(?:"a": null, "b": null(?:, "c": null)?|"b": null(?:, "c": null)?)\}'  # type inferred
    odd = {"type": "object", "properties": {'a.b"c': {"type": "null"}}, "required": ['a.b"c']}
    assert rx(odd) == r'\{(?:"a\.b\\"c": null)\}' and full(rx(odd), json.dumps({'a.b"c': None}))
    fails("required properties without a schema: ['x', 'y']",
          {"type": "object", "properties": {"a": {}}, "required": ["y", "a", "x"]})


@pytest.mark.parametrize("ws", list(LAYOUTS))
def test_objects_without_properties(ws: str | None) -> None:
    none = {"type": "object", "additionalProperties": False}
    assert_agrees(none, POOL, ws)
    ints = {"type": "object", "additionalProperties": {"type": "integer"}}
    assert_agrees(ints, POOL + [{"k": 1, "j": -2}, {"k": 1, "j": "x"}, {"k": None}], ws)
    for schema in [{"type": "object"}, {"type": "object", "additionalProperties": True}]:
        # Schema-less values one level deep: any object of scalars, nothing nested.
        assert_agrees(schema, [v for v in POOL if not isinstance(v, list | dict)] + [{}, {"a": 1},
                      {"b": "x", "a": None}, {"k": 1.5, "j": True}], ws)
        assert not full(rx(schema, ws), json.dumps({"a": [1]}, **LAYOUTS[ws]))
        assert not full(rx(schema, ws), json.dumps({"a": {}}, **LAYOUTS[ws]))


def test_nested_objects_agree_with_jsonschema() -> None:
    class Address(BaseModel):
        street: str = Field(max_length=4)
        zip: int = Field(ge=1000, le=99999)

    class Person(BaseModel):
        name: str
        address: Address
        tags: list[str] = Field(default=[], max_length=2)
        nick: str | None = None

    schema = Person.model_json_schema()
    assert json_schema_to_regex(Person) == rx(schema)
    addr = {"street": "rue", "zip": 75001}
    docs = [{"name": "a", "address": addr}, {"name": "a", "address": addr, "tags": ["x", "y"], "nick": None},
            {"name": "a", "address": addr, "nick": "z"}, {"name": "a", "address": {"street": "rue", "zip": 999}},
            {"name": "a", "address": {"street": "avenue", "zip": 75001}}, {"name": "a", "address": addr,
                                                                           "tags": ["x", "y", "z"]},
            {"name": 1, "address": addr}, {"address": addr}, {"name": "a"}, {"name": "a", "address": {"zip": 1000}}]
    for ws in LAYOUTS:
        assert_agrees(schema, docs, ws)


# --- schema-less values, combinators, nullable --------------------------------------------------------------


@pytest.mark.parametrize("ws", list(LAYOUTS))
@pytest.mark.parametrize("schema", [True, {}, {"description": "anything"}, {"title": "t", "format": "date"}])
def test_any_value_one_level_deep(schema: Any, ws: str | None) -> None:
    shallow = [v for v in POOL if v != [[1]]] + [[None, True, "x", 2.5], {"k": 1.5, "j": False}]
    regex = rx(schema, ws)
    assert all(full(regex, json.dumps(v, **LAYOUTS[ws])) for v in shallow)
    for deep in [[[1]], {"a": [1]}, [{"a": 1}], {"a": {"b": 1}}, [1, {}], {"a": []}]:
        assert not full(regex, json.dumps(deep, **LAYOUTS[ws])), deep
    for bad in ["", "[1,]", "{1: 2}", "[", "nul", '{"a"}', "01"]:
        assert not full(regex, bad), bad


@pytest.mark.parametrize("ws", list(LAYOUTS))
def test_array_without_items_holds_schemaless_values(ws: str | None) -> None:
    """`{"type": "array"}`: each item is a schema-less value (`{}`, itself one level deep)."""
    regex = rx({"type": "array"}, ws)
    for value in [[], [1], [None, True, "x", 2.5, -3], [[1, "a"], {"k": None}, []]]:
        assert full(regex, json.dumps(value, **LAYOUTS[ws])), value
    for value in [[[[1]]], [{"a": []}], {}, 1, "[]"]:
        assert not full(regex, json.dumps(value, **LAYOUTS[ws])), value
    assert not full(regex, "[, ]") and not full(regex, "[1, ]")
    sized = rx({"type": "array", "minItems": 2, "maxItems": 2}, ws)
    assert full(sized, json.dumps([1, "a"], **LAYOUTS[ws])) and not full(sized, json.dumps([1], **LAYOUTS[ws]))


def test_combinators_agree_with_jsonschema() -> None:
    for key in ["anyOf", "oneOf"]:
        assert_agrees({key: [{"type": "integer", "minimum": 1}, {"type": "string", "maxLength": 1}]}, POOL)
        assert rx({key: [{"type": "null"}, {"const": 1}]}) == "(?:null|(?:1))"
    assert_agrees({"allOf": [{"type": "string", "maxLength": 1}]}, POOL)
    # A single-branch allOf merges with keywords next to it; annotations beside it are dropped.
    assert_agrees({"allOf": [{"type": "integer"}], "minimum": 7}, POOL + [6, 8])
    assert rx({"allOf": [{"type": "integer"}], "title": "t", "description": "d"}) == INT
    assert rx({"allOf": [{"type": "string"}], "format": "date"}) == rx({"type": "string"})
    fails("allOf with several schemas", {"allOf": [{"type": "string"}, {"maxLength": 3}]})
    fails("allOf with several schemas", {"allOf": []})


def test_nullable() -> None:
    nullable = rx({"type": "string", "maxLength": 1, "nullable": True})
    assert nullable == f'(?:{rx({"type": "string", "maxLength": 1})}|null)'
    assert full(nullable, "null") and full(nullable, '"a"') and not full(nullable, '"ab"')
    assert rx({"type": "string", "nullable": False}) == rx({"type": "string"})
    assert not full(rx({"type": "integer", "nullable": False}), "null")


# --- $ref -----------------------------------------------------------------------------------------------------


def test_refs_resolve_and_merge() -> None:
    defs = {"$defs": {"s": {"type": "string"}, "a/b": {"type": "null"}, "c~d": {"type": "boolean"},
                      "~1": {"const": 1}, "n": {"$ref": "#/$defs/s"}},
            "definitions": {"i": {"type": "integer", "minimum": 0}}}
    cases = {"#/$defs/s": rx({"type": "string"}), "#/$defs/a~1b": "null", "#/$defs/c~0d": "(?:true|false)",
             "#/$defs/~01": "(?:1)", "#/definitions/i": rx({"type": "integer", "minimum": 0}),
             "#/$defs/n": rx({"type": "string"}), "#/$defs//s": rx({"type": "string"})}
    for ref, expected in cases.items():
        assert rx({**defs, "$ref": ref}) == expected, ref
    # Keywords next to a $ref apply together with the target; annotations next to it do not matter.
    capped = {**defs, "$ref": "#/$defs/s", "maxLength": 2}
    assert rx(capped) == rx({"type": "string", "maxLength": 2})
    assert rx({**defs, "$ref": "#/$defs/s", "description": "d", "title": "t"}) == rx({"type": "string"})
    # One definition used twice (not recursion), at any depth.
    twice = {**defs, "type": "array", "prefixItems": [{"$ref": "#/$defs/s"}, {"items": {"$ref": "#/$defs/s"}}]}
    assert_agrees(twice, [["a", ["b", "c"]], ["a", []], ["a", [1]], [1, []]])
    ints = {"type": "object", "properties": {"x": {"$ref": "#/$defs/i"}, "y": {"$ref": "#/$defs/i"}},
            "required": ["x", "y"], "$defs": {"i": {"type": "integer", "maximum": 3}}}
    assert_agrees(ints, [{"x": 1, "y": 3}, {"x": 4, "y": 0}, {"x": 0, "y": 4}, {"x": 0}])


def test_ref_errors() -> None:
    fails("only local $ref are supported, got 'http://x/s.json'", {"$ref": "http://x/s.json"})
    fails("only local $ref are supported, got 3", {"$ref": 3})
    fails("unresolvable $ref '#/$defs/missing'", {"$defs": {}, "$ref": "#/$defs/missing"})
    fails("unresolvable $ref '#/$defs/l/0'", {"$defs": {"l": [{}]}, "$ref": "#/$defs/l/0"})
    fails("unresolvable $ref '#/nope/x'", {"$ref": "#/nope/x"})
    loop = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "array", "items": {"$ref": "#/$defs/a"}}},
            "$ref": "#/$defs/a"}
    fails("recursive $ref '#/$defs/a'", loop)
    node = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}
    fails("recursive $ref '#/$defs/n'", node)
    fails("recursive $ref '#'", {"type": "array", "items": {"$ref": "#"}})


# --- whitespace -----------------------------------------------------------------------------------------------


def test_whitespace_patterns() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}},
                                               "b": {"type": "object"}}, "required": ["a"]}
    doc = {"a": [1, 2], "b": {"k": "v"}}
    assert full(rx(schema), '{"a": [1, 2], "b": {"k": "v"}}')
    assert not full(rx(schema), '{"a":[1,2],"b":{"k":"v"}}') and not full(rx(schema), '{ "a": [1, 2]}')
    assert full(rx(schema, ""), '{"a":[1,2],"b":{"k":"v"}}') and not full(rx(schema, ""), json.dumps(doc))
    alt = rx(schema, r" |\t")  # an alternation in the pattern stays inside its group
    assert full(alt, '{\t"a" :\t[ 1\t,\t2 ]\t, "b"\t: {\t"k" :\t"v" } }') and not full(alt, '{  "a" : [ 1 ] }')
    assert not full(alt, '{"a":[1]}')  # exactly one blank at each place
    assert not full(alt, '{"a": [1]}x') and not full(alt, 'x{"a": [1]}')
    indent = rx(schema, r"[ \n]*")
    assert full(indent, json.dumps(doc, indent=2)) and full(indent, json.dumps(doc, indent=4))
    assert full(indent, '{ "a" : [ ] }') and not full(indent, '{"a": []\t}')


# --- unsupported schemas and entry points -------------------------------------------------------------------


def test_unsupported_keywords_and_values() -> None:
    fails("keywords ['not', 'uniqueItems'] are not supported", {"type": "array", "uniqueItems": True, "not": {}})
    fails("keywords ['patternProperties'] are not supported", {"patternProperties": {}})
    fails("keywords ['minimum'] are not supported here", {"type": "string", "minimum": 1})
    fails("keywords ['maxLength'] are not supported here", {"maxLength": 3})  # no type to apply to
    fails("keywords ['items'] are not supported here", {"type": "object", "items": {}})
    assert rx({"type": ["string", "integer"], "maxLength": 2, "minimum": 0}) == \
        f"(?:{rx({'type': 'string', 'maxLength': 2})}|{rx({'type': 'integer', 'minimum': 0})})"
    fails("unknown type 'foo'", {"type": "foo"})
    fails("schema `false` matches nothing", False)
    fails("schema `false` matches nothing", {"type": "array", "items": False, "prefixItems": [False]})
    fails("expected an object, got 'string'", {"type": "object", "properties": {"a": "string"}})
    fails("expected an object, got 3", {"anyOf": [3]})


@pytest.mark.parametrize(("key", "value"), [("minLength", -1), ("maxLength", True), ("maxLength", "8"),
                                            ("minLength", 1.5), ("maxItems", -2), ("minItems", [1])])
def test_bad_counts(key: str, value: Any) -> None:
    schema = {"type": "string" if "Length" in key else "array", key: value}
    fails(f"{key} must be a non-negative integer, got {value!r}", schema)
    fails("minLength 3 > maxLength 2", {"type": "string", "minLength": 3, "maxLength": 2})


def test_entry_point_inputs() -> None:
    class Point(BaseModel):
        x: int
        y: bool = False

    assert rx(Point) == r'\{(?:"x": ' + INT + r'(?:, "y": (?:true|false))?)\}'
    assert full(rx(Point), '{"x": 1, "y": true}') and full(rx(Point), '{"x": -1}')
    assert refused(int) == "<class 'int'> is not a pydantic model"
    assert refused("{not json") == ("json_schema is not valid JSON: Expecting property name enclosed in double quotes: "
                                    "line 1 column 2 (char 1)")
    assert refused("[" * 100_000) == "json_schema nests too deeply"
    assert refused("[1]") == "json_schema must be an object, got list"
    assert refused(3) == "json_schema must be an object, got int"
    assert rx(True) == rx({}) and full(rx(True), "[1, null]")
    assert rx(json.dumps({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})) == \
        rx({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})


def test_dtype_regexes_and_literal() -> None:
    for name, t in [("int", int), ("float", float), ("bool", bool), ("str", str)]:
        assert regex_for_dtype(name) == regex_for_dtype(t) == DTYPE_REGEX[t]
    for dtype in ["list", dict]:
        with pytest.raises(InvalidRequestError) as info:
            regex_for_dtype(dtype)
        assert str(info.value) == f"unsupported dtype {dtype!r}; use one of int, float, bool, str"
    assert literal("a-b c/é") == "a-b c/é"  # only metacharacters are escaped
    assert literal(".^$*+?{}[]\\|()") == "".join("\\" + c for c in ".^$*+?{}[]\\|()")


@settings(max_examples=50, deadline=None)
@given(text=st.text(max_size=8))
def test_literal_matches_exactly_its_text(text: str) -> None:
    assert re.fullmatch(literal(text), text)
    assert re.fullmatch(literal(text), text + "x") is None


# --- budgets --------------------------------------------------------------------------------------------------


def nested_arrays(n: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return schema


def test_schema_depth_limit() -> None:
    budget = BuildBudget(max_schema_depth=3)
    assert full(rx(nested_arrays(3), budget=budget), "[[[1]]]")  # levels 0..3
    overs("it nests deeper than the limit (3 levels)", nested_arrays(4), budget)
    # $ref hops are not levels; siblings at the limit each get the full depth.
    via_ref = {"$defs": {"a": nested_arrays(1)}, "type": "array",
               "items": {"type": "array", "items": {"$ref": "#/$defs/a"}}}
    assert full(rx(via_ref, budget=budget), "[[[1]]]")
    wide = {"type": "object", "properties": {k: nested_arrays(2) for k in "abcdef"}, "required": list("abcdef")}
    assert full(rx(wide, budget=budget), json.dumps({k: [[1]] for k in "abcdef"}))
    overs("it nests deeper than the limit (3 levels)", {"type": "object", "properties": {"a": nested_arrays(3)}},
          budget)
    overs("it nests deeper than the limit (3 levels)", {"anyOf": [nested_arrays(1), nested_arrays(3)]}, budget)
    # The depth is restored after each subschema (a $ref hop included), so a later sibling is measured from its
    # own level: here `b` starts at level 2 and `deep` at level 1, after siblings that come back up.
    after_sibling = {"type": "array", "items": {"properties": {"a": {"type": "null"}, "b": nested_arrays(2)}}}
    overs("it nests deeper than the limit (3 levels)", after_sibling, budget)
    after_ref = {"$defs": {"n": {"type": "null"}}, "properties": {"r": {"$ref": "#/$defs/n"}, "deep": nested_arrays(3)}}
    overs("it nests deeper than the limit (3 levels)", after_ref, budget)
    assert rx({**after_ref, "properties": {"r": {"$ref": "#/$defs/n"}, "deep": nested_arrays(2)}}, budget=budget)
    # const / enum values count their own nesting on top of the schema's.
    assert full(rx({"type": "array", "items": {"const": [1]}}, budget=budget), "[[1]]")  # 1 is at level 4
    too_deep = "a const/enum value nests deeper than the limit (3 levels)"
    overs(too_deep, {"type": "array", "items": {"const": [[1]]}}, budget)
    overs(too_deep, {"enum": [{"a": {"b": [1]}}]}, budget)
    assert full(rx({"enum": [{"a": {"b": 1}}]}, budget=budget), '{"a": {"b": 1}}')


def test_ref_chain_limit() -> None:
    def chain(n: int) -> dict[str, Any]:
        defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n - 1)}
        return {"$defs": {**defs, f"d{n - 1}": {"type": "null"}}, "$ref": "#/$defs/d0"}

    budget = BuildBudget(max_schema_depth=3)
    assert rx(chain(3), budget=budget) == "null"
    overs("$refs nest deeper than the limit (3)", chain(4), budget)


def test_regex_length_limit() -> None:
    schema = {"type": "array", "items": {"enum": ["alpha", "beta"]}}
    n = len(rx(schema))
    assert rx(schema, budget=BuildBudget(max_regex_chars=n)) == rx(schema)
    overs(f"it expands to a regex of more than {n - 1} characters, {LIMIT}", schema, BuildBudget(max_regex_chars=n - 1))
    # An enum is measured as it grows, counting each distinct value once.
    assert rx({"enum": ["abcd"] * 500}, budget=BuildBudget(max_regex_chars=20)) == '(?:"abcd")'
    overs(f"it expands to a regex of more than 20 characters, {LIMIT}", {"enum": [f"v{i}" for i in range(10)]},
          BuildBudget(max_regex_chars=20))
    # Objects are measured as their branches (one per leading optional property) grow.
    props = {f"p{i}": {"type": "null"} for i in range(30)}
    obj = {"type": "object", "properties": props}
    size = len(rx(obj))
    half = f"it expands to a regex of more than {size // 2} characters, {LIMIT}"
    overs(half, obj, BuildBudget(max_regex_chars=size // 2))
    overs(half, {"type": "object", "properties": props, "required": ["p29"]}, BuildBudget(max_regex_chars=size // 2))


def test_many_optional_properties_fail_fast() -> None:
    """Each leading optional property adds a branch (quadratic size): the size is checked as branches are
    added, so 5000 optional properties are refused after one 110 K branch, not after building ~275 MB."""
    props = {f"p{i}": {"type": "null"} for i in range(5000)}
    start = time.process_time()
    overs(f"it expands to a regex of more than 100000 characters, {LIMIT}", {"type": "object", "properties": props},
          BuildBudget())
    assert time.process_time() - start < 0.5  # ~0.03 s of CPU; building every branch takes seconds


def test_huge_enum_fails_fast() -> None:
    """An enum is measured as its alternatives are added: 6000 values of 1000 characters are refused after ~100 of
    them, without escaping and joining 6 MB of alternatives."""
    values = [f"{i:04d}" + "x" * 996 for i in range(6000)]
    start = time.process_time()
    overs(f"it expands to a regex of more than 100000 characters, {LIMIT}", {"enum": values}, BuildBudget())
    assert time.process_time() - start < 0.25  # ~0.02 s of CPU; converting every value takes ~1 s


def test_count_limits() -> None:
    repeat = BuildBudget(max_repeat=5)
    assert full(rx({"type": "string", "maxLength": 5}, budget=repeat), '"abcde"')
    overs("maxLength 6 exceeds the server's limit (5 characters)", {"type": "string", "maxLength": 6}, repeat)
    overs("minLength 6 exceeds the server's limit (5 characters)", {"type": "string", "minLength": 6}, repeat)
    overs("maxItems 6 exceeds the server's limit (5 items of this schema)",
          {"type": "array", "items": {"type": "null"}, "maxItems": 6}, repeat)
    # Under max_expanded, a count may reach max_expanded // (what one more unit adds to the static size).
    unbounded = BuildBudget(max_expanded=10**9, max_repeat=10**6)
    budget = BuildBudget(max_expanded=300)
    for schema, key in [({"type": "string"}, "maxLength"),
                        ({"type": "array", "items": {"type": "integer"}}, "maxItems"),
                        ({"type": "array", "items": {"enum": ["x", "yy"]}}, "minItems")]:
        for ws in [None, "", " "]:
            five, four = (check_regex(rx({**schema, key: n}, ws), unbounded) for n in (5, 4))
            unit = five - four
            limit = 300 // unit
            assert rx({**schema, key: limit}, ws, budget)
            unit_name = "characters" if key == "maxLength" else "items of this schema"
            overs(f"{key} {limit + 1} exceeds the server's limit ({limit} {unit_name})", {**schema, key: limit + 1},
                  budget, ws)
    # An array of nothing more (`items: false` after prefixItems) costs one position per separator.
    nothing = {"type": "array", "prefixItems": [{"type": "null"}], "items": False}
    assert rx({**nothing, "maxItems": 10}, "", BuildBudget(max_expanded=10)) == r"\[null\]"
    overs("maxItems 11 exceeds the server's limit (10 items of this schema)", {**nothing, "maxItems": 11},
          BuildBudget(max_expanded=10), "")
