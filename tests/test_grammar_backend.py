"""The grammar-backend seam and llguidance as the second backend: masks on the real SmolLM2 tokenizer
(no model), then the engine on the real model with --grammar-backend llguidance beside the jsgl default."""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import assert_no_leak

from jsgl.engine.request import AbortReason, FinishReason, InvalidRequestError
from jsgl.fsm import GrammarSpec, JsglGrammarBackend, grammar_spec, make_grammar_backend

VOCAB = 49152  # SmolLM2's model vocabulary (= its tokenizer's)
EOS = {0, 2}  # <|endoftext|>, <|im_end|>: the engine's stop ids for this model
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
YES_NO = 'root ::= "yes" | "no"'
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "country": {"type": "string", "maxLength": 16},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        "capital": {"type": "boolean"},
    },
    "required": ["name", "country", "population", "capital"],
}
NAME = r"[A-Z][a-z]{1,10}"
REGEXES = [
    (r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)", "What is the IP of the local host?"),
    (r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", "When did the Berlin wall fall (YYYY-MM-DD)?"),
    (r'\{"name": "' + NAME + r'", "address": \{"city": "' + NAME + r'", "zip": \d{5}\}, "age": \d{1,2}\}',
     "Describe a person as JSON."),
    (r"(北京|上海|广州)是中国的(首都|城市)。", "用中文说：中国的首都是哪里？"),
    (r"[a-z]{2,8}(, [a-z]{2,8}){2}\.", "List some fruits in lowercase, separated by commas."),
]
STRUCTURAL_TAG = json.dumps({
    "type": "structural_tag",
    "structures": [{"begin": "<function=get_weather>", "end": "</function>",
                    "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}],
    "triggers": ["<function="],
})


def allowed(mask: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")).tolist())


@pytest.fixture(scope="module")
def llg(tokenizer):
    import llguidance  # noqa: F401  (a test dependency: missing is a failure, not a skip)
    return make_grammar_backend("llguidance", tokenizer, VOCAB)


@pytest.fixture(scope="module")
def jsgl_backend(tokenizer):
    return make_grammar_backend("jsgl", tokenizer, VOCAB)


def new(backend, kind: str, value, eos=EOS):
    return backend.new_constraint(backend.compile(GrammarSpec(kind, value)).result(), eos)


# ----------------------------------------------------------------------------------- backend units
def test_grammar_spec_and_the_jsgl_backend_refusing_what_it_cannot_compile(jsgl_backend):
    assert grammar_spec(SimpleNamespace(regex=None, json_schema=None, ebnf=None, structural_tag=None)) is None
    spec = grammar_spec(SimpleNamespace(regex=None, json_schema=None, ebnf=YES_NO, structural_tag=None))
    assert spec == GrammarSpec("ebnf", YES_NO)
    with pytest.raises(InvalidRequestError, match="at most one"):
        grammar_spec(SimpleNamespace(regex="a", json_schema=None, ebnf=YES_NO, structural_tag=None))
    assert isinstance(jsgl_backend, JsglGrammarBackend)
    for kind, value in (("ebnf", YES_NO), ("structural_tag", STRUCTURAL_TAG)):
        with pytest.raises(InvalidRequestError, match="--grammar-backend llguidance"):
            jsgl_backend.compile(GrammarSpec(kind, value))


def test_missing_llguidance_is_a_clear_install_hint(monkeypatch, tokenizer):
    import sys

    monkeypatch.setitem(sys.modules, "llguidance", None)  # what an environment without it looks like
    with pytest.raises(ImportError, match="pip install llguidance"):
        make_grammar_backend("llguidance", tokenizer, VOCAB)


def test_tokenizer_built_once_and_mask_padded_to_the_model_vocabulary(tokenizer, llg):
    from jsgl.fsm.llguidance_backend import LlguidanceBackend, ll_tokenizer

    assert ll_tokenizer(tokenizer) is ll_tokenizer(tokenizer) is llg.ll_tokenizer
    c = new(llg, "regex", r"(.|\n)*")
    mask = c.allowed_token_bitmask()
    assert mask.dtype == np.uint32 and mask.shape == ((VOCAB + 31) // 32,)
    assert allowed(mask) & EOS == EOS  # accepting: the request's stop tokens, not llguidance's own EOS set
    only_0 = allowed(new(llg, "regex", r"(.|\n)*", eos={0}).allowed_token_bitmask())
    assert 0 in only_0 and 2 not in only_0  # llguidance's own EOS (2) is not the request's
    padded = LlguidanceBackend(tokenizer, VOCAB + 40)  # a model vocabulary past the tokenizer's
    ids = allowed(padded.new_constraint(padded.compile(GrammarSpec("regex", r"(.|\n)*")).result(), EOS)
                  .allowed_token_bitmask())
    assert len(padded.valid_mask) == (VOCAB + 40 + 31) // 32 and max(ids) < VOCAB and len(ids) > 40000


def test_ebnf_yes_no_masks_eos_and_termination(tokenizer, llg):
    c = new(llg, "ebnf", YES_NO)
    first = allowed(c.allowed_token_bitmask())
    assert first and all("yes".startswith(t) or "no".startswith(t) for t in map(tokenizer.decode, first))
    assert not first & EOS  # nothing accepted yet
    for t in tokenizer("yes", add_special_tokens=False).input_ids:
        c.advance(t)
    assert c.is_terminated() and allowed(c.allowed_token_bitmask()) == EOS
    c.advance(2)  # EOS where the grammar accepts
    assert c.is_terminated() and allowed(c.allowed_token_bitmask()) == EOS
    quiet = new(llg, "ebnf", YES_NO, eos=set())  # ignore_eos: the grammar's end alone stops the request
    for t in tokenizer("no", add_special_tokens=False).input_ids:
        quiet.advance(t)
    assert quiet.is_terminated() and not allowed(quiet.allowed_token_bitmask())
    with pytest.raises(ValueError):
        new(llg, "ebnf", YES_NO).advance(tokenizer("maybe", add_special_tokens=False).input_ids[0])


@pytest.mark.parametrize("regex", [r[0] for r in REGEXES] + [r"\w+@\w+\.com", r'"[^"]{0,30}"'])
def test_llguidance_masks_equal_jsgl_masks_unless_bytes_are_forced(tokenizer, llg, jsgl_backend, regex):
    """Both are exact byte-level masks, except that where the next bytes are forced llguidance allows only
    tokens of their canonical tokenization ('{"' but not '{'): its mask is then a subset of jsgl's."""
    rng = np.random.default_rng(0)
    for _ in range(3):
        cl, cj = new(llg, "regex", regex), new(jsgl_backend, "regex", regex)
        for _ in range(40):
            ml, mj = allowed(cl.allowed_token_bitmask()), allowed(cj.allowed_token_bitmask())
            assert ml <= mj
            if not cl.matcher.compute_ff_bytes():
                assert ml == mj
            choices = sorted(ml - EOS)
            if not choices:
                break
            token = int(rng.choice(choices))
            cl.advance(token)
            cj.advance(token)
        assert cl.is_terminated() == cj.is_terminated()


def test_json_schema_walk_forced_tokens_and_template_cache(tokenizer, llg):
    doc = json.dumps({"name": "Ann Lee", "country": "Peru", "population": 42, "capital": False})
    first = llg.compile(GrammarSpec("json_schema", SCHEMA))
    assert llg.compile(GrammarSpec("json_schema", dict(SCHEMA))) is first  # a compiled template, shared
    c, other = (llg.new_constraint(first.result(), EOS) for _ in range(2))
    tail = llg.forced_tail(c, [])
    assert tail is not None and tail.drop == 0 and '{"name": "'.startswith(tokenizer.decode(tail.tokens))
    for t in tokenizer(doc, add_special_tokens=False).input_ids:  # the tokenizer's own split is always allowed
        assert t in allowed(c.allowed_token_bitmask()), tokenizer.decode([t])
        c.advance(t)
    assert c.is_terminated() and allowed(c.allowed_token_bitmask()) == EOS
    llg.commit_tail(other, tail)  # each request has its own matcher: `other` was still at the start
    assert tokenizer.decode(tail.tokens).encode() + other.matcher.compute_ff_bytes() == b'{"name": "'


def test_objects_are_closed_as_on_the_jsgl_path():
    from jsgl.fsm.llguidance_backend import closed_objects

    schema = {"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "object", "properties": {"b": {"type": "string"}}}},
        "c": {"anyOf": [{"type": "object", "properties": {}}, {"type": "null"}]},
        "d": {"type": "object", "properties": {"e": {"type": "integer"}}, "additionalProperties": True},
        "f": {"const": {"properties": {"g": 1}}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["a"]["items"]["additionalProperties"] is False
    assert props["c"]["anyOf"][0]["additionalProperties"] is False
    assert props["d"]["additionalProperties"] is True  # said explicitly: kept
    assert props["f"] == schema["properties"]["f"]  # data, not a schema
    assert "additionalProperties" not in schema  # the caller's schema is not modified


def test_structural_tag_free_text_then_the_schema(tokenizer, llg):
    c = new(llg, "structural_tag", STRUCTURAL_TAG)
    assert len(allowed(c.allowed_token_bitmask())) > 40000 and c.is_accepting()  # free text, may end anywhere
    for t in tokenizer("Sure. <function=get_weather>", add_special_tokens=False).input_ids:
        c.advance(t)
    assert {tokenizer.decode([t]) for t in allowed(c.allowed_token_bitmask())} <= {"{", '{"'}
    assert not c.is_accepting()


@pytest.mark.parametrize("kind, value, message", [
    ("ebnf", 'root ::= ( "yes" ', "invalid ebnf"),
    ("ebnf", "root ::= undefined_rule", "undefined_rule"),
    ("regex", "(unclosed", "invalid regex"),
    ("json_schema", "{not json", "invalid json_schema"),
    ("json_schema", {"type": "object", "properties": {"x": {"not": {"type": "string"}}}}, "not"),
    ("structural_tag", '{"format": {"type": "const_string", "value": "x"}}', "structural_tag"),
    ("structural_tag", "[1, 2", "structural_tag"),
])
def test_invalid_grammars_are_invalid_request_errors(llg, kind, value, message):
    with pytest.raises(InvalidRequestError, match=message):
        llg.compile(GrammarSpec(kind, value)).result()  # raised by compile (most) or by the Future


# ------------------------------------------------------------------------------- engine, real model
@pytest.fixture(scope="module")
def llg_engine():
    import llguidance  # noqa: F401  (a test dependency: missing is a failure, not a skip)

    from jsgl.engine.engine import Engine

    eng = Engine(model="smollm2-135m", kv_cache_gb=0.25, max_running_requests=16, chunked_prefill_size=256,
                 grammar_backend="llguidance")
    yield eng
    eng.shutdown()


def test_ebnf_yes_no_on_the_model(llg_engine):
    prompts = [CHAT.format(q) for q in ("Is the sky blue? Answer yes or no.", "Is fire cold? yes or no",
                                        "Do fish swim?")]
    greedy = {"ebnf": YES_NO, "max_new_tokens": 8, "temperature": 0}
    outs = llg_engine.generate(prompts + prompts, [greedy] * 3 + [{**greedy, "temperature": 1.0, "seed": i}
                                                                   for i in range(3)])
    for out in outs:
        assert out.text in ("yes", "no") and out.finish_reason == FinishReason.STOP, out
    assert_no_leak(llg_engine)


def test_json_schema_through_llguidance_validates(llg_engine):
    import jsonschema
    cities = ("Tokyo", "Lima", "Cairo", "Oslo", "Nairobi")
    prompts = [CHAT.format(f"Give facts about {c} as JSON: name, country, population, capital.") for c in cities]
    params = [{"json_schema": SCHEMA, "max_new_tokens": 80, "temperature": t, "seed": i}
              for i, t in enumerate((0, 0, 0, 0.8, 0.8))]
    outs = llg_engine.generate(prompts, params)
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.finish_reason == FinishReason.STOP
    assert sum(o.jump_forward_tokens for o in outs) > 0  # llguidance's forced tokens (`{"name": "`, ...)
    assert_no_leak(llg_engine)


def test_same_regex_same_greedy_text_under_both_backends(engine, llg_engine):
    prompts = [CHAT.format(q) for _, q in REGEXES]
    params = [{"regex": r, "max_new_tokens": 64, "temperature": 0, "jump_forward": False} for r, _ in REGEXES]
    jsgl_outs, llg_outs = engine.generate(prompts, params), llg_engine.generate(prompts, params)
    for (regex, _), a, b in zip(REGEXES, jsgl_outs, llg_outs):
        assert re.fullmatch(regex, a.text) and a.text == b.text, (regex, a.text, b.text)
    assert_no_leak(engine)
    assert_no_leak(llg_engine)


def test_bad_or_unsupported_grammars_are_the_requests_400_and_engines_keep_serving(engine, llg_engine,
                                                                                    monkeypatch):
    with pytest.raises(InvalidRequestError, match="ebnf"):
        llg_engine.submit("hello", {"ebnf": 'root ::= ( "yes" '})
    for field, value in (("ebnf", YES_NO), ("structural_tag", STRUCTURAL_TAG)):
        with pytest.raises(InvalidRequestError, match="--grammar-backend llguidance"):
            engine.submit("hello", {field: value})
    # A grammar whose compile outlasts the submit's short wait fails later, still as its own 400.
    backend = llg_engine.constraints.backend
    build = backend._build
    monkeypatch.setattr(backend, "_build", lambda kind, grammar: (time.sleep(0.3), build(kind, grammar))[1])
    unsupported = {"type": "object", "properties": {"y": {"not": {"type": "string"}}}}  # llguidance lacks `not`
    late = llg_engine.generate("hello", {"json_schema": unsupported})
    assert late.finish_reason == FinishReason.ABORT and late.abort_reason == AbortReason.INVALID_REQUEST
    assert "not" in late.error
    monkeypatch.undo()
    for eng in (engine, llg_engine):
        out = eng.generate("hello", {"regex": r"(yes|no)", "max_new_tokens": 4, "temperature": 0})
        assert out.text in ("yes", "no")
        assert_no_leak(eng)
