"""JSON Schema (or a pydantic model) -> regex whose matches are JSON documents valid for the schema.

Layout: with `whitespace=None` (default) the regex matches exactly the layout `json.dumps(obj)`
produces -- `", "` between items, `": "` after keys, nothing inside brackets. A fixed layout keeps
small models on track and maximises jump-forward (`{"name": "` is one forced string). A regex string
instead allows that whitespace at every place JSON allows it (inside brackets, around `:` and `,`);
`""` gives the compact `separators=(",", ":")` layout.

Objects emit their declared properties in declared order (required ones always, optional ones
maybe), never extra properties. Recursive `$ref`s, numeric bounds other than integer ranges and
`minimum: 0` on numbers, `uniqueItems`, `not`/`if`, `patternProperties`, and multi-branch `allOf`
cannot be expressed and raise InvalidRequestError. `oneOf` is treated as `anyOf`; `format` values
other than date/time/date-time/uuid are annotations and are ignored, as JSON Schema's default
format vocabulary does. Schema-less values (`{}`, `true`, objects without properties) allow JSON
nested ANY_VALUE_DEPTH levels deep: regexes cannot count brackets, and every extra level multiplies
the FSM size (interegular's construction time dominates index builds for large schemas).

Conversion is bounded by a BuildBudget (ConstraintBudgetError, naming the limit): nesting depth
(max_schema_depth; never a RecursionError), the regex length that `$ref`s expand to
(max_regex_chars), minLength/maxLength/minItems/maxItems (max_repeat, and max_expanded divided by
what one character / item expands to: 400 string characters by default) and integer bounds
(max_integer_digits).
"""

from __future__ import annotations

import json
import math
from typing import Any

from jsgl.errors import ConstraintBudgetError, InvalidRequestError
from jsgl.fsm.budget import DEFAULT_BUDGET, BuildBudget
from jsgl.fsm.int_range import int_range_regex
from jsgl.fsm.static_check import expanded_size, parse

_HEX = "[0-9a-fA-F]"
# One JSON string character = one decoded character (so minLength/maxLength count right): a raw
# character, a short escape, a \uXXXX escape of a non-surrogate, or an escaped surrogate pair.
STRING_CHAR = (
    r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]'
    rf"|\\u(?:[0-9a-cA-Ce-fE-F]{_HEX}{{3}}|[dD][0-7]{_HEX}{{2}})"
    rf"|\\u[dD][89abAB]{_HEX}{{2}}\\u[dD][c-fC-F]{_HEX}{{2}})"
)
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
_FRACTION_EXP = r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
NUMBER = INTEGER + _FRACTION_EXP
BOOLEAN = r"(?:true|false)"
NULL = "null"

_DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])?"
FORMATS = {
    "date": f'"{_DATE}"',
    "time": f'"{_TIME}"',
    "date-time": f'"{_DATE}T{_TIME}"',
    "uuid": r'"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"',
}

# SGLang frontend dtypes (`gen(dtype=int)`): Python literals, not JSON.
DTYPE_REGEX: dict[type, str] = {
    int: r"[-+]?[0-9]+",
    float: r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?",
    bool: r"(?:True|False)",
    str: r'"(?:[^"\\\n]|\\[^\n])*"',
}


def regex_for_dtype(dtype: type | str) -> str:
    by_name = {t.__name__: t for t in DTYPE_REGEX}
    key = by_name.get(dtype) if isinstance(dtype, str) else dtype
    if key not in DTYPE_REGEX:
        raise InvalidRequestError(f"unsupported dtype {dtype!r}; use one of int, float, bool, str")
    return DTYPE_REGEX[key]  # type: ignore[index]


_META = set(".^$*+?{}[]\\|()")


def literal(text: str) -> str:
    """Regex matching exactly `text` (only metacharacters escaped: interegular-friendly)."""
    return "".join("\\" + c if c in _META else c for c in text)


_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "readOnly",
                "writeOnly", "deprecated", "discriminator", "$defs", "definitions", "format"}
_BY_TYPE = {
    "string": {"minLength", "maxLength", "pattern"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "boolean": set(),
    "null": set(),
    "array": {"items", "prefixItems", "minItems", "maxItems"},
    "object": {"properties", "required", "additionalProperties"},
}
_GENERIC = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "nullable"}
_KNOWN = _GENERIC | _ANNOTATIONS | set().union(*_BY_TYPE.values())
ANY_VALUE_DEPTH = 1  # nesting for schema-less values ({}); each level multiplies FSM build time


_UNBOUNDED = BuildBudget(max_repeat=2**63, max_nesting=2**31)  # to measure our own sub-regexes


def positions(regex: str) -> int:
    """Static size of a regex (static_check.expanded_size, not budget-checked)."""
    return expanded_size(parse(regex), _UNBOUNDED)


STRING_CHAR_POSITIONS = positions(STRING_CHAR)  # 25: maxLength n costs 25 n positions


class _Converter:
    def __init__(self, root: dict[str, Any], whitespace: str | None, budget: BuildBudget) -> None:
        self.root = root
        self.ws = whitespace
        self.budget = budget
        self.depth = 0  # nested subschemas being converted ($ref hops are counted in ref_stack)
        if whitespace is None:
            self.item_sep, self.key_sep, self.inner = ", ", ": ", ""
        else:
            w = f"(?:{whitespace})" if whitespace else ""  # grouped: a `|` in it must not leak
            self.item_sep, self.key_sep, self.inner = f"{w},{w}", f"{w}:{w}", w
        self.ref_stack: list[str] = []

    def fail(self, msg: str) -> InvalidRequestError:
        return InvalidRequestError(f"unsupported JSON schema: {msg}")

    def over(self, msg: str) -> ConstraintBudgetError:
        return ConstraintBudgetError(f"JSON schema over the server's budget: {msg}")

    def convert(self, schema: Any, hop: bool = False) -> str:
        """Regex of one subschema, with nesting and size bounded: the recursion stays far from
        Python's limit (a schema nested 400 deep used to raise RecursionError), and `$ref`s that
        double at every level (1.2 KB of schema -> gigabytes of regex) stop at max_regex_chars."""
        if not hop:
            if self.depth > self.budget.max_schema_depth:  # the root is level 0
                raise self.over(f"it nests deeper than the limit ({self.budget.max_schema_depth} levels)")
            self.depth += 1
        try:
            rx = self._convert(schema)
        finally:
            self.depth -= 0 if hop else 1
        self.check_length(len(rx))
        return rx

    def check_length(self, chars: int) -> None:
        if chars > self.budget.max_regex_chars:
            raise self.over(f"it expands to a regex of more than {self.budget.max_regex_chars} characters, "
                            "the server's limit (e.g. through $refs that repeat other definitions)")

    def _convert(self, schema: Any) -> str:
        if schema is True or schema == {}:
            return self.any_value(ANY_VALUE_DEPTH)
        if schema is False:
            raise self.fail("schema `false` matches nothing")
        if not isinstance(schema, dict):
            raise self.fail(f"expected an object, got {schema!r}")
        unknown = set(schema) - _KNOWN
        if unknown:
            raise self.fail(f"keywords {sorted(unknown)} are not supported")
        if "$ref" in schema:
            return self.ref(schema)
        if "nullable" in schema and schema["nullable"]:
            rest = {k: v for k, v in schema.items() if k != "nullable"}
            return f"(?:{self.convert(rest)}|{NULL})"
        if "const" in schema:
            return self.enum([schema["const"]])
        if "enum" in schema:
            return self.enum(schema["enum"])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return "(?:" + "|".join(self.convert(s) for s in schema[key]) + ")"
        if "allOf" in schema:
            parts = schema["allOf"]
            if len(parts) != 1:
                raise self.fail("allOf with several schemas")
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            return self.convert({**merged, **parts[0]} if set(merged) - _ANNOTATIONS else parts[0])
        types = schema.get("type")
        if types is None:
            types = "object" if "properties" in schema else "array" if "items" in schema else None
            if types is None:
                self.check_keys(schema, set())
                return self.any_value(ANY_VALUE_DEPTH)
        if isinstance(types, list):
            return "(?:" + "|".join(self.typed(schema, t) for t in types) + ")"
        return self.typed(schema, types)

    def check_keys(self, schema: dict[str, Any], allowed: set[str]) -> None:
        extra = set(schema) - allowed - _ANNOTATIONS - _GENERIC
        if extra:
            raise self.fail(f"keywords {sorted(extra)} are not supported here")

    def ref(self, schema: dict[str, Any]) -> str:
        ref = schema["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise self.fail(f"only local $ref are supported, got {ref!r}")
        if ref in self.ref_stack:
            raise self.fail(f"recursive $ref {ref!r}")
        if len(self.ref_stack) >= self.budget.max_schema_depth:
            raise self.over(f"$refs nest deeper than the limit ({self.budget.max_schema_depth})")
        node: Any = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                raise self.fail(f"unresolvable $ref {ref!r}")
            node = node[part]
        self.ref_stack.append(ref)
        try:
            siblings = {k: v for k, v in schema.items() if k != "$ref" and k not in _ANNOTATIONS}
            return self.convert({**node, **siblings} if siblings else node, hop=True)
        finally:
            self.ref_stack.pop()

    def enum(self, values: list[Any]) -> str:
        if not values:
            raise self.fail("empty enum")
        alts: dict[str, None] = {}  # ordered and deduplicated in linear time
        chars = 0
        for v in values:
            rx = self.const(v)
            chars += len(rx) if rx not in alts else 0
            self.check_length(chars)
            alts[rx] = None
        return "(?:" + "|".join(alts) + ")"

    def const(self, value: Any, depth: int = 0) -> str:
        """Regex for one JSON value in this layout (containers get the layout's whitespace)."""
        if depth + self.depth > self.budget.max_schema_depth:
            raise self.over(f"a const/enum value nests deeper than the limit ({self.budget.max_schema_depth} levels)")
        if isinstance(value, dict):
            body = self.item_sep.join(self.const(str(k)) + self.key_sep + self.const(v, depth + 1)
                                      for k, v in value.items())
            return r"\{" + (self.inner + body + self.inner if body else self.inner) + r"\}"
        if isinstance(value, list):
            body = self.item_sep.join(self.const(v, depth + 1) for v in value)
            return r"\[" + (self.inner + body + self.inner if body else self.inner) + r"\]"
        spellings = {literal(json.dumps(value, ensure_ascii=a)) for a in (True, False)}  # "é" or "\u00e9"
        return spellings.pop() if len(spellings) == 1 else "(?:" + "|".join(sorted(spellings)) + ")"

    def typed(self, schema: dict[str, Any], t: str) -> str:
        types = _as_list(schema.get("type", t))
        for x in [t, *types]:
            if x not in _BY_TYPE:
                raise self.fail(f"unknown type {x!r}")
        self.check_keys(schema, set().union(*(_BY_TYPE[x] for x in types)))
        if t == "string":
            return self.string(schema)
        if t in ("integer", "number"):
            return self.number(schema, integer=t == "integer")
        if t == "boolean":
            return BOOLEAN
        if t == "null":
            return NULL
        if t == "array":
            return self.array(schema)
        return self.object(schema)

    def string(self, schema: dict[str, Any]) -> str:
        enforced = "pattern" in schema or schema.get("format") in FORMATS
        if enforced and ("minLength" in schema or "maxLength" in schema):
            # The regex of a pattern or a format we enforce says nothing about length; ignoring the bound would
            # accept strings the schema refuses. (An unknown format is an annotation: the bounds apply.)
            raise self.fail("minLength/maxLength together with pattern or format")
        if "pattern" in schema:
            pattern = schema["pattern"]
            pattern = pattern[1:] if pattern.startswith("^") else pattern
            pattern = pattern[:-1] if pattern.endswith("$") and not pattern.endswith("\\$") else pattern
            return f'"(?:{pattern})"'
        fmt = schema.get("format")
        if fmt in FORMATS:
            return FORMATS[fmt]
        lo, hi = self.count_range(schema, "minLength", "maxLength", STRING_CHAR_POSITIONS, "characters")
        if lo == 0 and hi is None:
            return STRING
        return f'"{STRING_CHAR}{{{lo},{"" if hi is None else hi}}}"'

    def count(self, schema: dict[str, Any], key: str, unit_positions: int, unit: str) -> int | None:
        """A length / item-count keyword, validated and bounded: each counted unit expands to
        `unit_positions` regex positions, so the limit is what keeps the static size in budget."""
        v = schema.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float) or (isinstance(v, float) and not v.is_integer()):
            raise self.fail(f"{key} must be a non-negative integer, got {v!r}")
        if v < 0:
            raise self.fail(f"{key} must be a non-negative integer, got {v!r}")
        limit = min(self.budget.max_repeat, self.budget.max_expanded // max(unit_positions, 1))
        if v > limit:
            raise self.over(f"{key} {int(v)} exceeds the server's limit ({limit} {unit})")
        return int(v)

    def count_range(self, schema: dict[str, Any], lo_key: str, hi_key: str, unit_positions: int,
                    unit: str) -> tuple[int, int | None]:
        lo = self.count(schema, lo_key, unit_positions, unit) or 0
        hi = self.count(schema, hi_key, unit_positions, unit)
        if hi is not None and lo > hi:
            raise self.fail(f"{lo_key} {lo} > {hi_key} {hi}")
        return lo, hi

    def int_bound(self, schema: dict[str, Any], key: str) -> float | None:
        v = schema.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise self.fail(f"{key} must be a finite number, got {v!r}")
        if abs(v) >= 10 ** self.budget.max_integer_digits:
            raise self.over(f"{key} {v:.3g} exceeds the server's limit "
                            f"(integers of at most {self.budget.max_integer_digits} digits)")
        return v

    def number(self, schema: dict[str, Any], integer: bool) -> str:
        lo, hi = self.int_bound(schema, "minimum"), self.int_bound(schema, "maximum")
        xlo, xhi = self.int_bound(schema, "exclusiveMinimum"), self.int_bound(schema, "exclusiveMaximum")
        if not integer:
            if hi is None and xhi is None and xlo is None and lo in (None, 0):
                return NUMBER if lo is None else r"(?:0|[1-9][0-9]*)" + _FRACTION_EXP
            raise self.fail("bounds on numbers (other than minimum: 0)")
        bounds_lo = [math.ceil(lo)] if lo is not None else []
        bounds_lo += [math.floor(xlo) + 1] if xlo is not None else []
        bounds_hi = [math.floor(hi)] if hi is not None else []
        bounds_hi += [math.ceil(xhi) - 1] if xhi is not None else []
        a = max(bounds_lo) if bounds_lo else None
        b = min(bounds_hi) if bounds_hi else None
        if a is None and b is None:
            return INTEGER
        if a is not None and b is not None and a > b:
            raise self.fail(f"empty integer range [{a}, {b}]")
        return int_range_regex(a, b)

    def array(self, schema: dict[str, Any]) -> str:
        sep, open_, close = self.item_sep, r"\[" + self.inner, self.inner + r"\]"
        prefix = [self.convert(s) for s in schema.get("prefixItems", [])]
        items = schema.get("items", True if not prefix else False)
        item = self.convert(items) if items is not False else ""
        lo, hi = self.count_range(schema, "minItems", "maxItems", positions(sep + item), "items of this schema")
        if prefix:  # every prefix item is generated (a valid subset of the arrays the schema allows)
            body = sep.join(prefix)
            if hi is not None and hi < len(prefix):
                raise self.fail(f"maxItems {hi} is smaller than the {len(prefix)} prefixItems")
            if items is False:
                if lo > len(prefix):
                    raise self.fail(f"minItems {lo} needs more than the {len(prefix)} prefixItems, and items is false")
            else:
                more = None if hi is None else hi - len(prefix)
                body += f"(?:{sep}{item}){{{max(lo - len(prefix), 0)},{'' if more is None else more}}}"
            return open_ + body + close
        if items is False:  # no item is allowed: only the empty array
            if lo > 0:
                raise self.fail(f"minItems {lo} with items false: no array is valid")
            return open_ + close
        if hi == 0:
            return open_ + close
        rest = f"(?:{sep}{item}){{{max(lo - 1, 0)},{'' if hi is None else hi - 1}}}"
        body = f"{item}{rest}"
        return open_ + (body if lo >= 1 else f"(?:{body})?") + close

    def object(self, schema: dict[str, Any]) -> str:
        open_, close, sep = r"\{" + self.inner, self.inner + r"\}", self.item_sep
        props: dict[str, Any] = schema.get("properties", {})
        required = set(schema.get("required", []))
        missing = required - set(props)
        if missing:
            raise self.fail(f"required properties without a schema: {sorted(missing)}")
        if not props:
            extra = schema.get("additionalProperties", True)
            if extra is False:
                return open_ + close
            value = self.any_value(ANY_VALUE_DEPTH - 1) if extra is True else self.convert(extra)
            pair = STRING + self.key_sep + value
            return open_ + f"(?:{pair}(?:{sep}{pair})*)?" + close
        pairs = [(literal(json.dumps(k)) + self.key_sep + self.convert(v), k in required)
                 for k, v in props.items()]
        # The first present property carries no separator; every later one is `sep pair`. So
        # branch on which property comes first: only optional properties may be skipped before it.
        # (Quadratic in leading optional properties: the size is checked as the branches grow.)
        branches: list[str] = []
        chars = 0
        for first, (pair, req) in enumerate(pairs):
            tail = "".join(f"{sep}{p}" if r else f"(?:{sep}{p})?" for p, r in pairs[first + 1 :])
            branches.append(pair + tail)
            chars += len(branches[-1])
            self.check_length(chars)
            if req:
                break
        else:
            branches.append("")  # every property optional: the empty object
        return open_ + "(?:" + "|".join(branches) + ")" + close

    def any_value(self, depth: int) -> str:
        scalars = [STRING, NUMBER, BOOLEAN, NULL]
        if depth <= 0:
            return "(?:" + "|".join(scalars) + ")"
        inner = self.any_value(depth - 1)
        sep = self.item_sep
        arr = r"\[" + self.inner + f"(?:{inner}(?:{sep}{inner})*)?" + self.inner + r"\]"
        pair = STRING + self.key_sep + inner
        obj = r"\{" + self.inner + f"(?:{pair}(?:{sep}{pair})*)?" + self.inner + r"\}"
        return "(?:" + "|".join([*scalars, arr, obj]) + ")"


def _as_list(t: Any) -> list[str]:
    return t if isinstance(t, list) else [t]


def json_schema_to_regex(schema: dict[str, Any] | str | type | bool, whitespace: str | None = None,
                         budget: BuildBudget | None = None) -> str:
    """Regex (full-match) for JSON documents valid under `schema`: a dict, a JSON string, or a
    pydantic BaseModel subclass. See the module docstring for `whitespace`. Raises
    InvalidRequestError for what cannot be expressed, ConstraintBudgetError (a subclass) for a
    schema over `budget` (default DEFAULT_BUDGET): nesting depth, regex size, length/item counts,
    integer bounds."""
    if isinstance(schema, type):
        try:
            schema = schema.model_json_schema()  # type: ignore[attr-defined]
        except AttributeError:
            raise InvalidRequestError(f"{schema!r} is not a pydantic model") from None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"json_schema is not valid JSON: {e}") from None
        except RecursionError:
            raise InvalidRequestError("json_schema nests too deeply") from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(f"json_schema must be an object, got {type(schema).__name__}")
    root = schema if isinstance(schema, dict) else {}
    return _Converter(root, whitespace, budget or DEFAULT_BUDGET).convert(schema)
