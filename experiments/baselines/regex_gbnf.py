"""A regular expression as a GBNF grammar, for llama.cpp's constrained sampling.

llama.cpp (and llama-cpp-python's server) constrains generation with GBNF grammars only; the workloads
constrain with regexes (and JSON schemas, which jsgl compiles to regexes). GBNF has every regular
construct (literals, classes, alternation, grouping, `{m,n}` repetition), so the translation is exact:
Python's own regex parser gives the syntax tree, and each node maps to one GBNF expression. Constructs with
no GBNF form (backreferences, lookaround, possessive repeats, inline flags) raise ValueError rather than
loosening the constraint.
"""

from __future__ import annotations

from re import _constants as C  # noqa: N812  (Python's own regex node names)
from re import _parser

# The classes jsgl's regex FSM (interegular) gives these escapes: ASCII, as in `re.ASCII`.
_CATEGORIES = {
    C.CATEGORY_DIGIT: "0-9", C.CATEGORY_WORD: "a-zA-Z0-9_", C.CATEGORY_SPACE: " \\t\\n\\r\\x0b\\x0c",
}
MAX_GBNF_REPEAT = 2000  # llama.cpp's grammar parser treats larger repeat bounds as unbounded
_NEGATED = {C.CATEGORY_NOT_DIGIT: C.CATEGORY_DIGIT, C.CATEGORY_NOT_WORD: C.CATEGORY_WORD,
            C.CATEGORY_NOT_SPACE: C.CATEGORY_SPACE}


def _char(code: int, in_class: bool) -> str:
    """One character in GBNF. llama.cpp's escapes are only \\x \\u \\U \\t \\r \\n \\\\ \\" (and, in recent
    builds, \\[ \\] \\-): class punctuation goes in as \\xNN, which every build reads."""
    ch = chr(code)
    if ch == "\\":
        return "\\\\"
    if code < 0x20 or code == 0x7F or (in_class and ch in "]-^["):
        return {0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}.get(code, f"\\x{code:02x}")
    if ch == '"' and not in_class:
        return '\\"'
    return ch


def _class(items: list, negate: bool = False) -> str:
    parts = []
    for op, av in items:
        if op is C.NEGATE:
            negate = True
        elif op is C.LITERAL:
            parts.append(_char(av, True))
        elif op is C.RANGE:
            parts.append(f"{_char(av[0], True)}-{_char(av[1], True)}")
        elif op is C.CATEGORY and av in _CATEGORIES:
            parts.append(_CATEGORIES[av])
        else:  # a negated category inside a class, e.g. [\D]: no single GBNF class unions with it
            raise ValueError(f"regex class item {op} {av} has no GBNF form")
    return "[" + ("^" if negate else "") + "".join(parts) + "]"


def _sequence(nodes: _parser.SubPattern) -> str:
    out: list[str] = []
    literal: list[str] = []  # consecutive literal characters become one quoted string

    def flush() -> None:
        if literal:
            out.append('"' + "".join(literal) + '"')
            literal.clear()

    for op, av in nodes:
        if op is C.LITERAL:
            literal.append(_char(av, False))
            continue
        flush()
        out.append(_node(op, av))
    flush()
    return " ".join(out) if out else '""'


def _node(op, av) -> str:
    if op is C.NOT_LITERAL:
        return f"[^{_char(av, True)}]"
    if op is C.ANY:
        return "[^\\n]"
    if op is C.IN:
        return _class(av)
    if op is C.CATEGORY:
        if av in _CATEGORIES:
            return f"[{_CATEGORIES[av]}]"
        if av in _NEGATED:
            return f"[^{_CATEGORIES[_NEGATED[av]]}]"
    if op is C.BRANCH:
        return "(" + " | ".join(_sequence(alt) for alt in av[1]) + ")"
    if op is C.SUBPATTERN:
        if av[1] or av[2]:  # (?i:...) and the like change the language: no GBNF form
            raise ValueError(f"regex inline flags {av[1]}/{av[2]} have no GBNF form")
        return "(" + _sequence(av[3]) + ")"
    if op in (C.MAX_REPEAT, C.MIN_REPEAT):  # a lazy repeat matches the same strings when the whole must match
        low, high, item = av
        if high != C.MAXREPEAT and high > MAX_GBNF_REPEAT:
            raise ValueError(f"regex repeat {{{low},{high}}} has no GBNF form (llama.cpp reads bounds over "
                             f"{MAX_GBNF_REPEAT} as none)")
        body = _sequence(item)
        if not (len(item) == 1 and item[0][0] in (C.IN, C.ANY, C.CATEGORY, C.NOT_LITERAL, C.SUBPATTERN, C.BRANCH)
                or (len(item) == 1 and item[0][0] is C.LITERAL)):
            body = f"({body})"
        if high == C.MAXREPEAT:
            return f"{body}*" if low == 0 else f"{body}+" if low == 1 else f"{body}{{{low},}}"
        if (low, high) == (0, 1):
            return f"{body}?"
        return f"{body}{{{low}}}" if low == high else f"{body}{{{low},{high}}}"
    if op is C.AT and av in (C.AT_BEGINNING, C.AT_BEGINNING_STRING, C.AT_END, C.AT_END_STRING):
        return '""'  # the constraint matches the whole output anyway
    raise ValueError(f"regex construct {op} has no GBNF form")


def gbnf_string(text: str) -> str:
    """`text` as a GBNF string literal."""
    return '"' + "".join(_char(ord(ch), False) for ch in text) + '"'


def regex_to_gbnf(regex: str) -> str:
    """A GBNF grammar (rule `root`) accepting exactly the strings `regex` fully matches."""
    parsed = _parser.parse(regex)
    if parsed.state.flags & ~(C.SRE_FLAG_UNICODE | C.SRE_FLAG_ASCII):  # (?i), (?s), ... change the language
        raise ValueError(f"regex flags {parsed.state.flags:#x} have no GBNF form")
    return f"root ::= {_sequence(parsed)}\n"

