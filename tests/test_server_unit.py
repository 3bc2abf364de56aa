"""Server and backend logic that needs no model: API speculative execution against a scripted fake API,
the token-piece and chat-template helpers (tokenizer only)."""

from __future__ import annotations

import re
import types

import pytest

import jsgl.lang as sgl
from jsgl.lang.openai_backend import OpenAI, _Speculation, _take

# ------------------------------------------------------------------------------------ speculation core


def _spec(text, ends=None, finished=False):
    return _Speculation(anchor="", text=text, ends=ends, finished=finished, signature=(), meta={})


def test_take_stop_length_and_exhaustion():
    # tokens: " Bob" "\n" "Age" ":" " 45" "\n"
    text = " Bob\nAge: 45\n"
    ends = [4, 5, 8, 9, 12, 13]
    assert _take(_spec(text, ends), 0, ["\n"], 8) == " Bob"
    assert _take(_spec(text, ends), 9, ["\n"], 8) == " 45"  # a later gen, after the template's "\nAge:"
    assert _take(_spec(text, ends), 0, ["\n"], 1) == " Bob"  # one token: ends by length, before the stop
    assert _take(_spec(text, ends), 5, [], 2) == "Age:"  # no stop: max_tokens tokens
    assert _take(_spec(text, ends), 0, ["45"], 3) == " Bob\nAge"  # stop completes after the limit
    assert _take(_spec(text, ends), 0, ["Age", "\n"], 8) == " Bob"  # the stop completed first wins
    assert _take(_spec(text), 0, ["zzz"], 8) is None  # ran out, no token info: needs a real call
    assert _take(_spec(text, finished=True), 0, ["zzz"], 8) == text  # the model ended there by itself


# A scripted "API": the model continues DOC (greedily, word by word); anything else gets "??".
DOC = ("Name: Carol\nAge: 27\nCity: Rome\n"
       "Name: Dan\nAge: 52\nCity: Oslo\n")


def _words(text: str) -> list[str]:
    return re.findall(r"\s*\S+|\s+", text)


class FakeCompletions:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    def create(self, *, model, prompt, max_tokens, stop=None, logprobs=None, extra_body=None, **kw):
        self.calls.append({"prompt": prompt, "max_tokens": max_tokens, "stop": stop})
        rest = DOC[len(prompt):] if DOC.startswith(prompt) else "??"
        pieces, finish = _words(rest)[:max_tokens], "length"
        if len(_words(rest)) <= max_tokens:
            finish = "stop"
        text = "".join(pieces)
        for s in [stop] if isinstance(stop, str) else (stop or []):
            if s in text:
                text, finish = text[: text.index(s)], "stop"
        choice = types.SimpleNamespace(text=text, finish_reason=finish, index=0,
                                       logprobs=types.SimpleNamespace(tokens=pieces) if logprobs is not None else None)
        usage = types.SimpleNamespace(prompt_tokens=len(_words(prompt)), completion_tokens=len(pieces))
        return types.SimpleNamespace(id="fake", choices=[choice], usage=usage)


def _backend() -> tuple[OpenAI, FakeCompletions]:
    backend = OpenAI("fake-instruct", api_key="x", is_chat_model=False)
    fake = FakeCompletions()
    backend.client = types.SimpleNamespace(completions=fake)
    return backend, fake


def _card(s, city_label):
    s += "Name:" + sgl.gen("name", stop="\n", max_tokens=4) + "\n"
    s += "Age:" + sgl.gen("age", stop="\n", max_tokens=4) + "\n"
    s += city_label + sgl.gen("city", stop="\n", max_tokens=4) + "\n"


def test_speculation_serves_matching_template_with_one_call():
    plain_backend, plain_calls = _backend()
    plain = sgl.function(_card).run(city_label="City:", backend=plain_backend)
    backend, fake = _backend()
    spec = sgl.function(_card, num_api_spec_tokens=16).run(city_label="City:", backend=backend)
    assert [spec[k] for k in ("name", "age", "city")] == [plain[k] for k in ("name", "age", "city")] \
        == [" Carol", " 27", " Rome"]
    assert len(plain_calls.calls) == 3 and len(fake.calls) == 1
    assert fake.calls[0]["stop"] is None and fake.calls[0]["max_tokens"] == 16  # the first gen ignored its stop
    assert backend.usage.spec_hits == 2 and backend.usage.api_calls == 1


def test_speculation_mismatch_falls_back_to_a_call():
    backend, fake = _backend()
    # The template says "Town:" where the model speculated "City:": the third gen needs its own call.
    st = sgl.function(_card, num_api_spec_tokens=16).run(city_label="Town:", backend=backend)
    assert st["name"] == " Carol" and st["age"] == " 27" and st["city"] == "??"
    assert len(fake.calls) == 2 and backend.usage.spec_hits == 1
    assert fake.calls[1]["prompt"].endswith("Town:")


def test_speculation_too_short_makes_a_new_call():
    backend, fake = _backend()
    st = sgl.function(_card, num_api_spec_tokens=4).run(city_label="City:", backend=backend)
    assert [st["name"], st["age"], st["city"]] == [" Carol", " 27", " Rome"]
    assert len(fake.calls) == 2  # 4 words cover name and age; the city needs a fresh speculation


# ------------------------------------------------------------------------------------ tokenizer helpers
@pytest.fixture(scope="module")
def tokenizer():
    from jsgl.model.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m")


def test_token_pieces_concatenate_to_text(tokenizer):
    from jsgl.server.common import token_pieces

    for text in ["Hello, world!", "café 日本語 🙂 done", "  spaces\n\nand lines"]:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        pieces = token_pieces(tokenizer, ids)
        assert len(pieces) == len(ids) and "".join(pieces) == tokenizer.decode(ids)


def test_remote_template_renders_like_tokenizer(tokenizer):
    from jsgl.lang.endpoint_backend import TemplateRenderer

    renderer = TemplateRenderer(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token, "m")
    conversations = [[{"role": "user", "content": "hi"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]]
    for messages in conversations:
        for gen_prompt in (False, True):
            assert renderer.apply_chat_template(messages, add_generation_prompt=gen_prompt) == \
                tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)


def test_chat_logprob_bytes_are_each_tokens_own_and_join_to_the_text(tokenizer):
    """OpenAI's `bytes` let a client rebuild characters split across tokens: a token's own bytes, never those of
    the U+FFFD its text alone shows."""
    from jsgl.engine.request import FinishReason, GenerateOutput
    from jsgl.server.common import ServerState
    from jsgl.server.openai_chat import chat_logprobs

    text = "中文字 😀 café"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # some tokens are parts of characters
    out = GenerateOutput("r", text, ids, FinishReason.STOP, output_logprobs=[-0.5] * len(ids),
                         output_top_logprobs=[[(-0.5, t)] for t in ids])
    state = ServerState(engine=types.SimpleNamespace(tokenizer=tokenizer), model_name="m")
    content = chat_logprobs(state, out, top=1)["content"]
    assert b"".join(bytes(entry["bytes"]) for entry in content) == text.encode()
    assert [bytes(entry["top_logprobs"][0]["bytes"]) for entry in content] == [bytes(e["bytes"]) for e in content]


# ----------------------------------------------------------------------------------------- OpenAI usage
def _choice(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0):
    from jsgl.engine.request import FinishReason, GenerateOutput

    return GenerateOutput("r", "", [0] * completion_tokens, FinishReason.LENGTH, prompt_tokens=prompt_tokens,
                          completion_tokens=completion_tokens, cached_tokens=cached_tokens)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_usage_counts_each_prompt_once_however_many_choices(n):
    """Choices come prompt by prompt (n of each, as run_choices orders them); a prompt is billed once, with the
    cache hits of its first choice; every choice's tokens count."""
    from jsgl.server.openai_api import usage

    outs = [_choice(5, 2 + k, cached_tokens=5 * (k > 0)) for k in range(n)] \
        + [_choice(7, 1 + k, cached_tokens=3 + 4 * (k > 0)) for k in range(n)]
    completion = sum(o.completion_tokens for o in outs)
    assert usage(outs, n) == {"prompt_tokens": 12, "completion_tokens": completion, "total_tokens": 12 + completion,
                              "prompt_tokens_details": {"cached_tokens": 3}}
