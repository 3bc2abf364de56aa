"""Constrained decoding with a compressed FSM (SGLang §4): regex / JSON schema -> token masks + jump-forward.

Typical engine use:
    validate_regex(regex)                             # static checks: InvalidRequestError / ConstraintBudgetError
    fut = get_index_async(regex, tokenizer)           # background build, cached in memory and on disk
    constraint = RegexConstraint(fut.result(), eos_ids)
    mask = constraint.allowed_token_bitmask()         # packed uint32, bit i of word i>>5 = token i
    constraint.advance(token_id)
    text = constraint.jump_forward_text(); ...; constraint.advance_text(text)
    release_index(fut)                                # when the request ends: cancels a build nobody awaits

Builds are bounded by a BuildBudget (budget.py; DEFAULT_BUDGET unless one is passed).

The engine reaches all this through a GrammarBackend (grammar_backend.py): `make_grammar_backend("jsgl" |
"llguidance", tokenizer, vocab_size)`; llguidance (llguidance_backend.py) is imported only when chosen.
"""

from jsgl.fsm.budget import DEFAULT_BUDGET, BuildBudget
from jsgl.fsm.cache import (
    build_stats,
    clear_memory_cache,
    evict_disk_cache,
    get_index,
    get_index_async,
    release_index,
    start_build_workers,
)
from jsgl.fsm.constraint import RegexConstraint
from jsgl.fsm.grammar_backend import (
    GRAMMAR_FIELDS,
    ForcedTail,
    GrammarBackend,
    GrammarSpec,
    JsglGrammarBackend,
    grammar_spec,
    make_grammar_backend,
)
from jsgl.fsm.json_schema import DTYPE_REGEX, json_schema_to_regex, regex_for_dtype
from jsgl.fsm.jump_forward import jump_forward_string, jump_forward_table, jump_target
from jsgl.fsm.regex_fsm import DEAD, CharFSM, compile_regex, validate_regex
from jsgl.fsm.token_index import TokenIndex, build_token_index
from jsgl.fsm.vocab import VocabBytes, vocab_bytes

__all__ = [
    "DEAD",
    "DEFAULT_BUDGET",
    "DTYPE_REGEX",
    "GRAMMAR_FIELDS",
    "BuildBudget",
    "CharFSM",
    "ForcedTail",
    "GrammarBackend",
    "GrammarSpec",
    "JsglGrammarBackend",
    "RegexConstraint",
    "TokenIndex",
    "VocabBytes",
    "build_stats",
    "build_token_index",
    "clear_memory_cache",
    "compile_regex",
    "evict_disk_cache",
    "get_index",
    "get_index_async",
    "grammar_spec",
    "json_schema_to_regex",
    "jump_forward_string",
    "jump_forward_table",
    "jump_target",
    "make_grammar_backend",
    "regex_for_dtype",
    "release_index",
    "start_build_workers",
    "validate_regex",
    "vocab_bytes",
]
