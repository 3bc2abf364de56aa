"""Static size of a regex: bound its cost from Python's parse tree before interegular ever sees it.

The measure is the number of *positions* once counted repeats are expanded (`a{3}` -> 3, `(ab){2,4}`
-> 8, nested repeats multiply, `*`/`+` count their body once): roughly the NFA's size, and the
length of the state chain that `{m,n}` makes interegular build. Measured: the typical JSON schemas
of the tests are 1-3 K positions; `[\\s\\S]{1,2000}` is 2 K but its index would be 903 MB (the
build's byte budget stops it), `.{0,1000000}` is 1 M (stopped here in microseconds).

Large character classes cost too (every named character goes through interegular's alphabet):
`[\U00010000-\U0010FFFF]` (1 M characters) ran into the 10 s deadline, twenty `[\u0100-\uffff]`
took 4 s; the CJK range `[一-龥]` (21 K) takes 0.5 s.
"""

from __future__ import annotations

import re
from re import _constants as C  # type: ignore[attr-defined]
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Any

from jsgl.errors import ConstraintBudgetError, InvalidRequestError
from jsgl.fsm.budget import BuildBudget

_REPEATS = {C.MAX_REPEAT, C.MIN_REPEAT, getattr(C, "POSSESSIVE_REPEAT", C.MAX_REPEAT)}
_ONE = {C.LITERAL, C.NOT_LITERAL, C.IN, C.ANY, C.CATEGORY, C.RANGE}


def parse(pattern: str) -> Any:
    """Python's parse tree of `pattern` (InvalidRequestError for a syntax error or extreme nesting)."""
    try:
        return sre_parse.parse(pattern)
    except re.error as e:
        raise InvalidRequestError(f"invalid regex {pattern!r}: {e}") from None
    except RecursionError:  # thousands of nested groups: over any budget's max_nesting
        raise ConstraintBudgetError("regex groups nest too deeply to parse") from None


def expanded_size(tree: Any, budget: BuildBudget, depth: int = 0) -> int:
    """Positions of `tree` with counted repeats expanded. Raises ConstraintBudgetError for a repeat
    count or nesting over budget."""
    if depth > budget.max_nesting:
        raise ConstraintBudgetError(f"regex groups nest deeper than the server's limit ({budget.max_nesting})")
    total = 0
    for op, arg in tree:
        if op in _ONE:
            total += 1
        elif op is C.SUBPATTERN:
            total += expanded_size(arg[-1], budget, depth + 1)
        elif op is C.BRANCH:
            total += sum(expanded_size(alt, budget, depth + 1) for alt in arg[1])
        elif op in _REPEATS:
            lo, hi, body = arg
            count = lo if hi is C.MAXREPEAT else hi
            if count > budget.max_repeat:
                which = f"{{{lo},}}" if hi is C.MAXREPEAT else f"{{{lo},{hi}}}"
                raise ConstraintBudgetError(
                    f"regex repeat {which} exceeds the server's limit ({budget.max_repeat} repetitions)")
            total += expanded_size(body, budget, depth + 1) * max(count, 1)
        elif op in (C.ASSERT, C.ASSERT_NOT):
            total += expanded_size(arg[1], budget, depth + 1)
        # AT (anchors), GROUPREF and the like add no positions (interegular rejects most of them anyway).
    return total


def class_chars(tree: Any) -> int:
    """Characters named by the pattern's character classes and literals, each class once (repeats
    reuse it). interegular and the byte FSM handle every named character one by one."""
    total = 0
    for op, arg in tree:
        if op is C.IN:
            total += sum(a[1] - a[0] + 1 if o is C.RANGE else 1 for o, a in arg if o is not C.NEGATE)
        elif op in _ONE:
            total += 1
        elif op is C.SUBPATTERN:
            total += class_chars(arg[-1])
        elif op is C.BRANCH:
            total += sum(class_chars(alt) for alt in arg[1])
        elif op in _REPEATS:
            total += class_chars(arg[2])
        elif op in (C.ASSERT, C.ASSERT_NOT):
            total += class_chars(arg[1])
    return total


def check_regex(pattern: str, budget: BuildBudget) -> int:
    """Reject a pattern that is obviously over budget; returns its expanded size (the build's cost
    estimate, used to order the build queue)."""
    if len(pattern) > budget.max_regex_chars:
        raise ConstraintBudgetError(
            f"regex of {len(pattern)} characters exceeds the server's limit ({budget.max_regex_chars})")
    tree = parse(pattern)
    size = expanded_size(tree, budget)
    if size > budget.max_expanded:
        raise ConstraintBudgetError(
            f"regex expands to {size} positions through its repeats, over the server's limit "
            f"({budget.max_expanded})")
    chars = class_chars(tree)
    if chars > budget.max_class_chars:
        raise ConstraintBudgetError(
            f"regex character classes name {chars} characters, over the server's limit ({budget.max_class_chars})")
    return size
