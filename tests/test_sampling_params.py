"""SGLang's sampling parameters: one definition, and each parameter's effect on the real model.

Unit tests check the single definition (the server's pydantic model and the DSL's GenParams are derived
from the engine's dataclass) and validation; model tests check what each parameter does to greedy or
seeded output of SmolLM2, against transformers where numbers are involved.
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
from conftest import assert_no_leak, assert_server_no_leak

from jsgl.engine.request import AbortReason, FinishReason, InvalidRequestError
from jsgl.engine.sampling_params import (
    MAX_N,
    REQUEST_LEVEL_FIELDS,
    SamplingParams,
    expand_parallel_samples,
)
from jsgl.lang.ir import GenParams
from jsgl.server.protocol import GenerateRequest, GenerateSamplingParams

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_new_tokens": 24}


# ------------------------------------------------------------------------------------ one definition
def test_server_and_dsl_params_are_derived_from_one_dataclass():
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(GenerateSamplingParams.model_fields) == (names - set(REQUEST_LEVEL_FIELDS)) | {"seed"}
    assert {f.name for f in dataclasses.fields(GenParams)} == names | {"dtype", "return_text_in_logprobs"}
    # Every field SGLang 0.5's SamplingParams exposes to callers (sglang/srt/sampling/sampling_params.py).
    sglang_fields = {"max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
                     "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
                     "beam_width", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos",
                     "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval",
                     "logit_bias", "sampling_seed", "custom_params", "watermark"}
    assert sglang_fields <= names


def test_sglang_client_body_is_accepted():
    """The body sglang 0.5's RuntimeEndpoint.generate sends for a plain gen (nulls and empty lists)."""
    body = {"text": "Hi", "sampling_params": {
        "skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 16,
        "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [], "temperature": 1.0,
        "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
        "ignore_eos": False, "regex": None, "json_schema": None}, "lora_path": None, "image_data": None}
    req = GenerateRequest.model_validate(body)
    params = SamplingParams.from_any(req.sampling_params.model_dump(exclude_unset=True))
    params.validate(49152)
    assert params.max_new_tokens == 16 and params.regex is None and params.stop_regexes == []


@pytest.mark.parametrize("field, value, why", [
    ("image_data", "x.png", "text-only"), ("lora_path", "adapter", "LoRA"),
    ("custom_logit_processor", "f", "custom logit processors"), ("session_params", {"id": 1}, "sessions"),
    ("return_entropy", True, "entropy"), ("return_bytes", True, "not images"), ("extra_key", "t1", "prefix cache")])
def test_unsupported_request_fields_name_themselves(field, value, why):
    with pytest.raises(ValueError, match=f"`{field}` is not supported: .*{why}"):
        GenerateRequest.model_validate({"text": "Hi", field: value})


def test_sglang_router_body_is_accepted():
    """The body sglang-router 0.3.2 forwards (captured from it): its own fields at their off values, `model` null."""
    body = {"text": "Hi", "model": None, "sampling_params": {"temperature": 0.0, "max_new_tokens": 8},
            "return_logprob": True, "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
            "return_hidden_states": False, "background": False, "priority": 2, "no_logs": False,
            "custom_labels": {"a": "b"}, "return_bytes": False, "return_entropy": False, "rid": "r1"}
    req = GenerateRequest.model_validate(body)
    assert req.rid == "r1" and req.priority == 2 and req.return_logprob and not req.no_logs
    assert GenerateRequest.model_validate({"text": "Hi", "model": "smollm2-135m", "no_logs": True}).no_logs
    with pytest.raises(ValueError, match="no_log\n  Extra inputs"):  # a truly unknown field is still refused
        GenerateRequest.model_validate({"text": "Hi", "no_log": True})


@pytest.mark.parametrize("params, message", [
    ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"n": 0}, "n must"), ({"n": MAX_N + 1}, "n must"),
    ({"stop_regex": "("}, "not a valid regex"), ({"stop_regex": "a" * 300}, "byte limit"),
    ({"logit_bias": {"x": 1.0}}, "not a token id"), ({"logit_bias": {"99999999": 1.0}}, "outside"),
    ({"logit_bias": {"5": float("inf")}}, "logit_bias: .* finite"), ({"logit_bias": {"5": -float("inf")}}, "finite"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias: .* finite"), ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"sampling_seed": 2**64}, "64-bit"), ({"beam_width": 4}, "beam search"), ({"watermark": {"k": 1}}, "watermark"),
    ({"regex": "a", "ebnf": "root ::= \"a\""}, "at most one"), ({"stream_interval": 0}, "stream_interval"),
])
def test_invalid_values_name_the_field(params, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams.from_any(params).validate(49152)


def test_nulls_mean_defaults_and_seed_alias():
    p = SamplingParams.from_any({"temperature": None, "top_k": None, "seed": 7, "max_new_tokens": None})
    assert p.temperature == 1.0 and p.top_k == -1 and p.sampling_seed == 7
    assert p.max_new_tokens is None  # SGLang: no limit but the context


def test_parallel_samples_are_consecutive_with_distinct_seeds():
    prompts, params = expand_parallel_samples(["a", "b"], [SamplingParams(n=3, sampling_seed=5), SamplingParams(n=2)])
    assert prompts == ["a", "a", "a", "b", "b"]
    assert [p.sampling_seed for p in params] == [5, 6, 7, None, None] and all(p.n == 1 for p in params)
    _, wrapped = expand_parallel_samples(["a"], [SamplingParams(n=2, sampling_seed=2**63 - 1)])
    assert wrapped[1].sampling_seed == -(2**63)  # still a valid 64-bit seed


# ------------------------------------------------------------------------------- effects on the model
def _gen(engine, prompt=PROMPT, **params):
    return engine.generate(prompt, {**GREEDY, **params})


def test_min_new_tokens_forces_length_past_eos(engine):
    chat = "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n"
    free = _gen(engine, chat, max_new_tokens=64)
    assert free.finish_reason == FinishReason.STOP and isinstance(free.matched_stop, int)  # ended by EOS
    want = free.completion_tokens + 6
    forced = _gen(engine, chat, max_new_tokens=64, min_new_tokens=want)
    assert forced.completion_tokens >= want
    # Identical until the step where EOS was masked.
    assert forced.token_ids[: free.completion_tokens - 1] == free.token_ids[:-1]
    assert forced.token_ids[free.completion_tokens - 1] != free.token_ids[-1]
    # Stop strings wait too: the free output's first word would stop at once.
    stop = free.text.split()[0]
    assert _gen(engine, chat, stop=stop, min_new_tokens=want).completion_tokens >= want


def test_stop_regex_cuts_at_the_match(engine):
    free = _gen(engine)
    words = free.text.split()
    assert len(words) > 3, free.text
    pattern = r"\b" + words[2][:3] + r"\w*"
    out = _gen(engine, stop_regex=[r"\d{9}", pattern])
    assert out.finish_reason == FinishReason.STOP and out.matched_stop == pattern
    cut = free.text.index(words[2][:3], len(" ".join(words[:2])))
    assert out.text == free.text[:cut]
    kept = _gen(engine, stop_regex=pattern, no_stop_trim=True)
    assert kept.text.startswith(out.text) and kept.text[len(out.text):].startswith(words[2][:3])


def test_no_stop_trim_keeps_the_stop_string(engine):
    free = _gen(engine)
    stop = free.text.split()[1]
    trimmed, kept = _gen(engine, stop=stop), _gen(engine, stop=stop, no_stop_trim=True)
    assert not trimmed.text.endswith(stop) and kept.text == trimmed.text + stop


def test_pathological_stop_regex_fails_only_its_request(engine):
    """`(.*a){20}c` backtracks polynomially (degree 20) on a run of a's: the search times out once the
    output is a few dozen characters long, and only that request ends (an invalid request) while a
    neighbour finishes normally."""
    run = str(engine.tokenizer.convert_tokens_to_ids("aaaa"))
    bad = engine.submit(PROMPT, {**GREEDY, "max_new_tokens": 48, "stop_regex": r"(.*a){20}c",
                                 "logit_bias": {run: 100.0}})
    good = engine.submit(PROMPT, GREEDY)
    out = bad.result(60)
    assert out.finish_reason == FinishReason.ABORT and out.abort_reason == AbortReason.INVALID_REQUEST
    assert "stop_regex" in out.error and out.completion_tokens < 48
    assert good.result(60).text == _gen(engine).text
    assert_no_leak(engine)


def test_n_returns_n_samples(engine):
    outs = engine.generate(PROMPT, {"max_new_tokens": 12, "temperature": 1.0, "n": 4, "sampling_seed": 3})
    assert len(outs) == 4 and len({o.text for o in outs}) > 1
    again = engine.generate(PROMPT, {"max_new_tokens": 12, "temperature": 1.0, "n": 4, "sampling_seed": 3})
    assert [o.text for o in again] == [o.text for o in outs]  # seeds offset per sample, reproducibly
    greedy = engine.generate([PROMPT, "Hello"], {**GREEDY, "n": 2})
    assert len(greedy) == 4 and greedy[0].text == greedy[1].text and greedy[2].text == greedy[3].text
    with pytest.raises(InvalidRequestError, match="n > 1"):
        engine.submit(PROMPT, {"n": 2})


def test_sampling_seed_reproduces(engine):
    params = {"max_new_tokens": 16, "temperature": 1.0}
    a, b = _gen(engine, **params, sampling_seed=11), _gen(engine, **params, sampling_seed=11)
    c = _gen(engine, **params, sampling_seed=2**40 + 11)  # the high half counts too
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_logit_bias_forces_and_forbids(engine):
    free = _gen(engine, max_new_tokens=8)
    forced_id = engine.tokenizer.convert_tokens_to_ids("Ġbanana") if "Ġbanana" in engine.tokenizer.get_vocab() \
        else free.token_ids[0] + 1
    forced = _gen(engine, max_new_tokens=4, logit_bias={str(forced_id): 100.0})
    assert forced.token_ids == [forced_id] * 4
    banned = _gen(engine, max_new_tokens=8, logit_bias={str(free.token_ids[0]): -100.0})
    assert banned.token_ids[0] != free.token_ids[0]


def test_repetition_penalty_matches_transformers(engine, hf_model, tokenizer):
    """SGLang penalises tokens of the output (not the prompt); transformers' RepetitionPenaltyLogitsProcessor
    applied to the generated ids only is the same rule, so greedy outputs must agree."""
    from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    class OnOutput(LogitsProcessor):
        def __init__(self, penalty: float, prompt_len: int):
            self.inner, self.prompt_len = RepetitionPenaltyLogitsProcessor(penalty), prompt_len

        def __call__(self, input_ids, scores):
            return self.inner(input_ids[:, self.prompt_len:], scores)

    prompt = "List the days of the week: Monday, Tuesday, Monday, Tuesday,"
    ids = tokenizer(prompt).input_ids
    plain = _gen(engine, prompt, max_new_tokens=24, ignore_eos=True)
    for penalty in (1.3, 0.7):
        ours = _gen(engine, prompt, max_new_tokens=24, ignore_eos=True, repetition_penalty=penalty)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    logits_processor=LogitsProcessorList([OnOutput(penalty, len(ids))]))
        ref_new = ref[0, len(ids):].tolist()
        assert ours.token_ids[: len(ref_new)] == ref_new, penalty
        assert ours.token_ids != plain.token_ids, penalty


def test_stream_interval_and_chunk_logprobs(engine):
    handle = engine.submit(PROMPT, {**GREEDY, "ignore_eos": True, "stream_interval": 5, "return_logprob": True})
    chunks = list(handle.stream())
    final = chunks[-1].output
    assert len(chunks) <= 24 // 5 + 2
    # Each chunk carries the logprobs of its new tokens; together they are the final output's.
    logprobs = [lp for c in chunks for lp in (c.output_logprobs or [])]
    assert logprobs == final.output_logprobs and len(logprobs) == final.completion_tokens


def test_skip_special_tokens_and_spaces_between(engine, tokenizer):
    out = _gen(engine, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", max_new_tokens=32,
               skip_special_tokens=False, spaces_between_special_tokens=False)
    assert out.text == tokenizer.decode(out.token_ids[:-1] if isinstance(out.matched_stop, int) else out.token_ids,
                                        skip_special_tokens=False, spaces_between_special_tokens=False)


# ---------------------------------------------------------------------------------------- over HTTP
def test_generate_http_n_stream_and_health(http, engine):
    body = {"text": PROMPT, "sampling_params": {**GREEDY, "n": 2, "min_new_tokens": 3, "stop_regex": [],
                                                "repetition_penalty": 1.0, "sampling_seed": 1}}
    out = http.post("/generate", json=body).json()
    assert isinstance(out, list) and len(out) == 2 and out[0]["text"] == _gen(engine).text
    r = http.post("/generate", json={"text": PROMPT, "image_data": "cat.png"})
    assert r.status_code == 400 and "image_data" in r.text
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": {"beam_width": 3}})
    assert r.status_code == 400 and "beam" in r.text

    # Streaming with logprobs: SGLang's per-chunk invariants (sglang/test/test_programs.py).
    events = []
    with http.stream("POST", "/generate", json={"text": PROMPT, "sampling_params": GREEDY, "stream": True,
                                                 "return_logprob": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                events.append(json.loads(line[5:]))
    prev = 0
    for event in events:
        meta = event["meta_info"]
        assert meta["completion_tokens"] == meta["output_token_logprobs_length"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - prev
        prev = meta["completion_tokens"]
    assert events[-1]["text"] == _gen(engine).text

    t0 = time.monotonic()
    assert http.get("/health_generate").status_code == 200 and time.monotonic() - t0 < 20
    assert http.get("/server_info").json()["max_context"] > 0
    assert http.post("/concate_and_append_request", json={"src_rids": ["a"], "dst_rid": "b"}).json()["success"]
    assert_server_no_leak(http)


def test_bad_type_is_a_400_naming_the_field(http):
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": {"temperature": "hot"}})
    assert r.status_code == 400 and "temperature" in r.text
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 3}})
    assert r.status_code == 400 and "min_new_tokens" in r.text
