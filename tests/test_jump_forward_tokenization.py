"""Jump-forward's retokenization (`JsglGrammarBackend.forced_tail`) and the text after a jump, on tokenizers whose
text is not a plain concatenation of token pieces.

The default model's byte-level BPE round-trips everything and decodes every token alike wherever it stands, so
the engine tests cannot tell a correct retokenization from one that drops or respaces a token. Here: a
SentencePiece-style tokenizer (tests/sentencepiece_tokenizer.py: the Llama 2 / Mistral shape, SentencePiece's
default normalization, no byte fallback) and, for the multi-byte paths, the real SmolLM2 tokenizer. The
invariant a client sees: after a jump the output's tokens decode to the text before it plus the forced text.
"""

from __future__ import annotations

import random
import types
from concurrent.futures import Future

import numpy as np
import pytest
from sentencepiece_tokenizer import sentencepiece_tokenizer

import jsgl.fsm.grammar_backend as grammar_backend
from jsgl.engine.constrained import ConstraintManager
from jsgl.engine.detokenizer import IncrementalDetokenizer
from jsgl.engine.model_runner import StepOutput
from jsgl.engine.output_processor import OutputProcessor
from jsgl.engine.request import FinishReason, SamplingParams
from jsgl.engine.sequence import Sequence
from jsgl.fsm import build_token_index, compile_regex, vocab_bytes
from jsgl.fsm.grammar_backend import ForcedTail, JsglGrammarBackend


@pytest.fixture(autouse=True)
def no_build_workers(monkeypatch):
    """The backend starts FSM build processes when made; these tests build their few indexes in process."""
    monkeypatch.setattr(grammar_backend, "start_build_workers", lambda: None)


def forcing(text: str) -> types.SimpleNamespace:
    """A constraint whose every continuation starts with `text` (all forced_tail asks of it)."""
    return types.SimpleNamespace(jump_forward_text=lambda: text)


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def after(tok, text: str) -> list[int]:
    """`text`'s tokens where it continues an output (after a special token: no "▁" put before it)."""
    ids = ids_of(tok, tok.bos_token + text)
    assert ids[0] == tok.bos_token_id
    return ids[1:]


def jumped(tail: ForcedTail, output_ids: list[int]) -> list[int]:
    return output_ids[:len(output_ids) - tail.drop] + tail.tokens


# ------------------------------------------------------------------------------- SentencePiece-style
def test_the_tokenizer_does_not_round_trip():
    tok = sentencepiece_tokenizer()
    for text, decoded in [("a  b", "a b"), ("ﬁ", "fi"), ("é", "<unk>")]:
        assert tok.decode(ids_of(tok, text)) == decoded
    assert tok.convert_ids_to_tokens(ids_of(tok, "Bergen")) == ["▁Ber", "gen"]  # "gen": no space before it


@pytest.mark.parametrize(("output", "forced"), [
    ("Paris", '",  "age":'),  # two spaces, collapsed by the normalizer
    ("Paris", '", "city": "Zé"'),  # a character the vocabulary lacks: <unk>
    ("John and Mary live in Ber", "gen ﬁ"),  # NFKC turns the ligature into "fi"
])
def test_forced_tail_keeps_the_sampled_token_where_retokenizing_does_not_round_trip(output, forced):
    """`last text + forced` encodes to something that decodes otherwise: the sampled token stays as it was
    sampled (its KV is computed next with the forced tokens), the forced text is tracked as text."""
    tok = sentencepiece_tokenizer()
    backend = JsglGrammarBackend(tok, len(tok))
    output_ids = ids_of(tok, output)
    tail = backend.forced_tail(forcing(forced), output_ids)
    assert tail.drop == 1 and tail.text == forced
    assert tail.tokens == [output_ids[-1], *after(tok, forced)]
    assert tok.decode(jumped(tail, output_ids)).startswith(tok.decode(output_ids))  # the sampled text is kept


@pytest.mark.parametrize(("output", "forced"), [
    ("John and Mary live in Bergen", '", "age":'),  # the last token continues a word: "gen", never "▁gen"
    ("Answer", ': {"'),  # "▁An" "swer"
    ("Oslo is", '", "age":'),  # the last token starts a word
    ("Paris", '", "age":'),  # the output's only token: its text after the prompt keeps the space
])
def test_forced_tail_retokenizes_the_last_token_where_it_stands(output, forced):
    tok = sentencepiece_tokenizer()
    backend = JsglGrammarBackend(tok, len(tok))
    output_ids = ids_of(tok, output)
    tail = backend.forced_tail(forcing(forced), output_ids)
    assert tail.drop == 1 and tail.text == forced
    assert tok.decode(jumped(tail, output_ids)) == tok.decode(output_ids) + forced
    assert tail.tokens[0] == output_ids[-1]  # here the boundary keeps its token; the model saw it sampled


def test_forced_text_at_the_start_has_no_space_put_before_it():
    tok = sentencepiece_tokenizer()
    tail = JsglGrammarBackend(tok, len(tok)).forced_tail(forcing('{"name": "'), [])
    assert tail.drop == 0 and tail.tokens == after(tok, '{"name": "')
    assert tok.convert_ids_to_tokens(tail.tokens)[0] == '{"'  # not '▁{"': the regex allows no space


PATTERN = r'\{"name": "(Bergen|Oslo|Paris)", "age": [0-9]{1,3}\}'
TARGET = '{"name": "Bergen", "age": 27}'


def test_a_constrained_output_with_jumps_is_its_tokens_text():
    """The engine's path (OutputProcessor, ConstraintManager, RegexConstraint over this vocabulary, the request's
    IncrementalDetokenizer): sampling TARGET's tokens with jumps over the forced text ('{"name": "' at the start,
    'gen", "age":' after "Ber"). The text streamed and the tokens the model sees must both say TARGET: the
    retokenized boundary keeps "gen" glued to "Ber", and " 27" sampled after the jump keeps its space."""
    tok = sentencepiece_tokenizer()
    eos = tok.eos_token_id
    backend = JsglGrammarBackend(tok, len(tok))
    constraints = ConstraintManager(tok, len(tok), {eos}, True, grammar_backend=backend)
    proc = OutputProcessor(constraints, len(tok), 256)
    seq = Sequence(rid="r", prompt_ids=[tok.bos_token_id], params=SamplingParams(max_new_tokens=32, regex=PATTERN),
                   detok=IncrementalDetokenizer(tok, []), seed=0, stop_ids={eos})
    built: Future = Future()
    built.set_result(build_token_index(compile_regex(PATTERN), vocab_bytes(tok)))
    seq.constraint_ready = built
    constraints.activate(seq, 256)
    assert seq.detok.text == '{"name": "' and constraints.jumps == 1
    while not seq.finished:
        assert TARGET.startswith(seq.detok.text), seq.detok.text
        rest = TARGET[len(seq.detok.text):]
        token = after(tok, rest)[0] if rest else eos
        mask = seq.constraint.allowed_token_bitmask()
        assert mask[token >> 5] >> np.uint32(token & 31) & 1, (tok.convert_ids_to_tokens([token]), seq.detok.text)
        step = StepOutput(np.asarray([token], np.int32), None, None)
        proc.absorb(seq, seq.num_tokens - seq.num_computed, True, step, 0)
    assert seq.finish_reason == FinishReason.STOP and constraints.jumps == 2
    assert seq.detok.text == TARGET
    assert tok.decode(seq.output_ids, skip_special_tokens=True) == TARGET
    assert seq.jump_forward_tokens > 0


# ---------------------------------------------------------------------------- byte-level (the default)
def test_forced_tail_on_the_default_tokenizer_decodes_to_the_output_and_the_forced_text(tokenizer):
    """Random outputs and forced strings, multi-byte characters split across tokens among them: the tail always
    decodes to the output's text plus the forced text, and a last token that is part of a character (its text
    alone is incomplete) is kept as sampled."""
    backend = JsglGrammarBackend(tokenizer, len(tokenizer))
    rnd = random.Random(0)
    pool = [chr(c) for c in range(0x20, 0x7F)] + list("éßжΩ中文字😀🎉\n")
    split_characters = 0
    for _ in range(300):
        output_ids = ids_of(tokenizer, "".join(rnd.choice(pool) for _ in range(rnd.randint(1, 10))))
        output_ids = output_ids[:rnd.randint(1, len(output_ids))]
        forced = "".join(rnd.choice(pool) for _ in range(rnd.randint(2, 8)))
        tail = backend.forced_tail(forcing(forced), output_ids)
        assert tail.drop == 1 and tail.text == forced
        assert tokenizer.decode(jumped(tail, output_ids)) == tokenizer.decode(output_ids) + forced, (output_ids, forced)
        if "\ufffd" in tokenizer.decode(output_ids[-1:]):
            split_characters += 1
            assert tail.tokens == [output_ids[-1], *ids_of(tokenizer, forced)], (output_ids, forced, tail)
    assert split_characters > 10
