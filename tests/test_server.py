"""The HTTP server end to end: a real uvicorn server on 127.0.0.1 (a thread of this process, over one
engine), driven by httpx, the official `openai` client and the DSL backends.

HTTP results are compared with the same engine called in-process under greedy decoding, so the checks
hold whatever the 135M model happens to answer. Outputs are kept short: each new shape costs a compile.
"""

from __future__ import annotations

import json
import re
import threading

import httpx
import openai
import pytest
from conftest import assert_server_no_leak

import jsgl.lang as sgl
from jsgl.engine.engine import Engine
from jsgl.engine.request import InvalidRequestError
from jsgl.lang.endpoint_backend import RuntimeEndpoint
from jsgl.lang.openai_backend import OpenAI
from jsgl.lang.runtime_backend import Runtime
from jsgl.server.launch import ServerThread

MODEL = "smollm2-135m"
GREEDY = {"temperature": 0, "max_new_tokens": 8}
PROMPTS = ["The capital of France is", "One, two, three,", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def engine():
    eng = Engine(model=MODEL, kv_cache_gb=0.25, max_running_requests=32, chunked_prefill_size=256)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def regex_ok(engine):
    try:
        engine.submit("a", {"max_new_tokens": 1, "regex": "a"}).result(timeout=120)
    except InvalidRequestError as exc:
        pytest.fail(f"the engine rejected a plain regex: constrained decoding is broken ({exc})")


def greedy(engine, prompt, **params):
    return engine.generate(prompt, {**GREEDY, **params})


def chat_prompt(engine, messages):
    return engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def sse_events(resp):
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# ----------------------------------------------------------------------------------------------- /generate
def test_generate_single_and_batch_match_engine(engine, http):
    ref = [greedy(engine, p) for p in PROMPTS]
    one = http.post("/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY}).json()
    assert one["text"] == ref[0].text and one["output_ids"] == ref[0].token_ids
    meta = one["meta_info"]
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert meta["prompt_tokens"] == ref[0].prompt_tokens and meta["completion_tokens"] == len(ref[0].token_ids)
    assert set(meta) >= {"id", "cached_tokens"}
    batch = http.post("/generate", json={"text": PROMPTS, "sampling_params": GREEDY}).json()
    assert [b["text"] for b in batch] == [r.text for r in ref]
    ids = [engine.tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS]
    by_ids = http.post("/generate", json={"input_ids": ids, "sampling_params": [GREEDY] * 3}).json()
    assert [b["output_ids"] for b in by_ids] == [r.token_ids for r in ref]
    single_ids = http.post("/generate", json={"input_ids": ids[1], "sampling_params": GREEDY}).json()
    assert single_ids["text"] == ref[1].text


def test_generate_logprobs_and_prefill_only(engine, http):
    params = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    ref = greedy(engine, PROMPTS[0], **params)
    body = http.post("/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY, **params,
                                        "return_text_in_logprobs": True}).json()
    meta = body["meta_info"]
    inp, out = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert inp[0][0] is None and len(inp) == ref.prompt_tokens
    assert [t[1] for t in inp] == ref.input_token_ids and [t[1] for t in out] == ref.token_ids
    assert [t[0] for t in out] == pytest.approx(ref.output_logprobs, abs=1e-3)
    assert [t[0] for t in inp[1:]] == pytest.approx(ref.input_logprobs[1:], abs=1e-3)
    assert "".join(t[2] for t in out) == body["text"]
    assert len(meta["output_top_logprobs"]) == len(out) and meta["input_top_logprobs"][0] is None
    for row, tok in zip(meta["output_top_logprobs"], out, strict=True):  # greedy: the chosen token is top-1
        assert len(row) == 2 and row[0][1] == tok[1] and row[0][0] >= row[1][0]
    # Prefill only: no output, prompt logprobs from position 2 on, without texts.
    pre = http.post("/generate", json={"text": PROMPTS[2], "sampling_params": {"max_new_tokens": 0},
                                       "return_logprob": True, "logprob_start_len": 2}).json()
    assert pre["text"] == "" and pre["meta_info"]["completion_tokens"] == 0
    assert pre["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    n = pre["meta_info"]["prompt_tokens"]
    assert len(pre["meta_info"]["input_token_logprobs"]) == n - 2
    assert all(t[2] is None and t[0] <= 0 for t in pre["meta_info"]["input_token_logprobs"])


def test_generate_stream(engine, http):
    ref = [greedy(engine, p) for p in PROMPTS[:2]]
    with http.stream("POST", "/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]" and len(events) >= 3
    texts = [e["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
    assert texts[-1] == ref[0].text and events[-2]["meta_info"]["finish_reason"] is not None
    with http.stream("POST", "/generate", json={"text": PROMPTS[:2], "sampling_params": GREEDY, "stream": True}) as r:
        events = sse_events(r)[:-1]
    finals = {e["index"]: e["text"] for e in events if e["meta_info"]["finish_reason"] is not None}
    assert finals == {0: ref[0].text, 1: ref[1].text}


def test_regex_and_json_schema_on_generate(http, regex_ok):
    ip = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"
    body = http.post("/generate", json={"text": "Google's DNS server is at ",
                                        "sampling_params": {"regex": ip, "temperature": 0, "max_new_tokens": 20}})
    assert re.fullmatch(ip, body.json()["text"])


# -------------------------------------------------------------------------------------------------- OpenAI
def test_openai_client_completions_and_chat(engine, oai):
    ref = greedy(engine, PROMPTS[0])
    resp = oai.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert resp.choices[0].text == ref.text
    assert resp.usage.prompt_tokens == ref.prompt_tokens and resp.usage.completion_tokens == len(ref.token_ids)
    messages = [{"role": "user", "content": "Name a color."}]
    chat_ref = greedy(engine, chat_prompt(engine, messages))
    chat = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, n=2)
    assert [c.message.content for c in chat.choices] == [chat_ref.text] * 2
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens == 2 * len(chat_ref.token_ids)
    assert [m.id for m in oai.models.list().data] == [MODEL]


def test_openai_streaming(engine, oai):
    ref = greedy(engine, PROMPTS[1])
    pieces = [c.choices[0].text for c in oai.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8,
                                                                 temperature=0, stream=True)]
    assert "".join(pieces) == ref.text
    messages = [{"role": "user", "content": "Say hello."}]
    chat_ref = greedy(engine, chat_prompt(engine, messages))
    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_ref.text
    assert chunks[-1].usage.completion_tokens == len(chat_ref.token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_openai_logprobs(engine, oai):
    ref = greedy(engine, PROMPTS[0], return_logprob=True, top_logprobs_num=2)
    resp = oai.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2, echo=True)
    choice = resp.choices[0]
    assert choice.text == PROMPTS[0] + ref.text
    lp = choice.logprobs
    n = ref.prompt_tokens
    assert lp.token_logprobs[0] is None and lp.token_logprobs[n:] == pytest.approx(ref.output_logprobs, abs=1e-3)
    assert "".join(lp.tokens) == choice.text
    assert all(choice.text[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens, strict=True))
    assert all(len(d) <= 2 for d in lp.top_logprobs[1:])
    messages = [{"role": "user", "content": "Name a color."}]
    chat = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(c.top_logprobs[0].token == c.token and len(c.top_logprobs) == 2 for c in content)


def test_openai_response_format(oai, regex_ok):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Invent a person. Answer in JSON."}]
    chat = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    obj = json.loads(chat.choices[0].message.content)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int)
    chat = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"})
    assert chat.choices[0].finish_reason == "stop", chat.choices[0]  # greedy: ends well within 40 tokens
    assert isinstance(json.loads(chat.choices[0].message.content), dict)


# ------------------------------------------------------------------------------------------ bad inputs
def test_bad_inputs_get_400_and_server_keeps_serving(engine, http, oai):
    too_long = [1] * (engine.max_context + 5)
    cases = [
        ("/generate", b"{not json", "not valid JSON"),
        ("/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}}, "temperature"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temprature": 0}}, "temprature"),
        ("/generate", {"text": "hi", "input_ids": [1, 2]}, "exactly one"),
        ("/generate", {"text": ""}, "empty"),
        ("/generate", {"text": []}, "empty"),
        ("/generate", {"input_ids": too_long}, "context length"),
        ("/generate", {"input_ids": [10**9]}, "token ids"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": engine.max_context + 1}}, "context length"),
        ("/generate", {"text": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
        ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": 50}, "logprob_start_len"),
        ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": engine.max_context + 1}, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, "n"),
        ("/v1/completions", {"model": MODEL}, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                  "response_format": {"type": "json_schema"}}, "schema"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                  "tools": [{"type": "function"}]}, "tools"),
    ]
    cases += [
        ("/generate", {"text": "hi", "sampling_params": {"regex": "(unclosed"}}, "regex"),
        ("/generate", {"text": "hi", "sampling_params": {"json_schema": "{not json"}}, "json"),
    ]
    for path, body, needle in cases:
        kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
            else {"json": body}
        resp = http.post(path, **kwargs)
        assert resp.status_code == 400, (path, body, resp.text)
        message = resp.json()["error"]["message"]
        assert needle.lower() in message.lower(), (needle, message)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oai.completions.create(model=MODEL, prompt="hi", max_tokens=engine.max_context + 1)
    ok = http.post("/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY})
    assert ok.status_code == 200 and ok.json()["text"] == greedy(engine, PROMPTS[0]).text
    assert_server_no_leak(http)


def test_api_key(engine, server):
    with ServerThread(engine, api_key="s3cret") as secured:
        assert httpx.get(secured.url + "/health").status_code == 200  # open, for probes
        denied = httpx.post(secured.url + "/generate", json={"text": "hi"})
        assert denied.status_code == 401 and "API key" in denied.json()["error"]["message"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=secured.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=secured.url + "/v1", api_key="s3cret", max_retries=0)
        answer = good.completions.create(model=MODEL, prompt="hi", max_tokens=1, temperature=0).choices[0].text
        assert answer == greedy(engine, "hi", max_new_tokens=1).text


# ------------------------------------------------------------------------------ abort, disconnect, load
def test_abort_and_disconnect_free_kv(http, server):
    long = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}
    with http.stream("POST", "/generate", json={"text": "Count:", "sampling_params": long, "stream": True,
                                                "rid": "to-abort"}) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert http.post("/abort_request", json={"rid": "to-abort"}).json()["aborted"] == ["to-abort"]
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[-1]["meta_info"]["completion_tokens"] < 400
    before = http.get("/get_server_info").json()["client_aborts"]
    # A streaming client that hangs up mid-stream.
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/generate", json={"text": "Once", "sampling_params": long, "stream": True}) as r:
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data: ")
                if got == 3:
                    break
    # A non-streaming client that gives up (read timeout) while its request runs.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Twice", "max_tokens": 400,
                                                          "ignore_eos": True}, timeout=1.0)
    assert_server_no_leak(http)
    info = http.get("/get_server_info").json()
    assert info["client_aborts"] == before + 2 and info["active_requests"] == 0


def test_concurrent_clients_load(engine, http, server, regex_ok):
    errors: list[BaseException] = []
    results: list[str] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        try:
            with httpx.Client(base_url=server.url, timeout=300) as c:
                for j in range(8):  # 32 clients x 8 requests, as the issue asks
                    kind = (k + j) % 4
                    text = f"Request {k}-{j}: the"
                    if kind == 0:
                        with c.stream("POST", "/generate", json={"text": text, "stream": True,
                                                                 "sampling_params": {"max_new_tokens": 6}}) as r:
                            out = [e for e in sse_events(r) if e != "[DONE]"][-1]["text"]
                    elif kind == 1:
                        out = c.post("/v1/chat/completions", json={
                            "model": MODEL, "max_tokens": 6, "messages": [{"role": "user", "content": text}]}
                        ).json()["choices"][0]["message"]["content"]
                    elif kind == 2:
                        body = {"model": MODEL, "prompt": text, "max_tokens": 8, "temperature": 0.7, "seed": k}
                        out = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
                    else:
                        out = c.post("/generate", json={"text": text, "sampling_params": {
                            "max_new_tokens": 8, "regex": "[0-9]{1,3}"}}).json()["text"]
                        assert re.fullmatch("[0-9]{1,3}", out), out
                    with lock:
                        results.append(out)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[:3]
    assert len(results) == 256
    assert_server_no_leak(http)
    assert http.post("/flush_cache").json()["success"] is True
    info = http.get("/get_server_info").json()
    assert info["free_slots"] == info["total_slots"] and info["cache_tokens"] == 0


# --------------------------------------------------------------------------------------------- info
def test_info_endpoints(engine, http):
    model = http.get("/get_model_info").json()
    assert model["model_path"] == MODEL and model["max_context"] == engine.max_context
    info = http.get("/get_server_info").json()
    assert {"free_slots", "total_slots", "cache_tokens", "max_running_requests", "idle"} <= set(info)
    tok = http.post("/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert tok["tokens"] == engine.tokenizer(PROMPTS[0], add_special_tokens=False).input_ids
    assert http.get("/health").json() == {"status": "ok"}


# ---------------------------------------------------------------------------------------- DSL backends
FEW_SHOT = ("Q: What is the capital of France?\nA: Paris\n"
            "Q: What is the capital of Germany?\nA: Berlin\n")


@sgl.function
def qa_then_select(s, question):
    s += FEW_SHOT + "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n", temperature=0, max_tokens=8)
    s += "\nIs this answer a city? " + sgl.select("city", ["yes", "no", "maybe"])


@sgl.function
def chat_and_fork(s, topic):
    s += sgl.user("Give me a tip about " + topic + ".")
    s += sgl.assistant(sgl.gen("tip", max_tokens=8, temperature=0))
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"\nIdea {i + 1}:" + sgl.gen("idea", max_tokens=6, temperature=0, stop="\n")
    forks.join()


def test_runtime_endpoint_matches_in_process(engine, server):
    local = Runtime(engine=engine)  # the same engine, in-process
    remote = RuntimeEndpoint(server.url)
    try:
        assert remote.chat_template.get_prefix_and_suffix("user", []) == \
            local.endpoint.chat_template.get_prefix_and_suffix("user", [])
        args = [{"question": "What is the capital of Spain?"}, {"question": "What is the capital of Peru?"}]
        runs = {}
        for name, backend in (("local", local), ("remote", remote)):
            states = qa_then_select.run_batch(args, backend=backend)
            chat = chat_and_fork.run(topic="sleep", backend=backend)
            streamed = qa_then_select.run(question="What is the capital of Chile?", backend=backend, stream=True)
            runs[name] = ([(st["answer"], st["city"]) for st in states], chat["tip"], chat["idea"],
                          "".join(streamed.text_iter("answer")), chat.text())
        assert runs["remote"] == runs["local"]
        meta = qa_then_select.run(question="What is 2+2?", backend=remote).get_meta_info("city")
        assert len(meta["normalized_prompt_logprobs"]) == 3
    finally:
        remote.close()


def test_openai_backend_completion_model_matches_in_process(engine, server):
    """gen through /v1/completions, select through echo + prompt logprobs: same as in-process."""
    local = Runtime(engine=engine)
    api = OpenAI(MODEL, base_url=server.url + "/v1", api_key="unused", is_chat_model=False)
    args = {"question": "What is the capital of Spain?"}
    ours, theirs = qa_then_select.run(**args, backend=api), qa_then_select.run(**args, backend=local)
    assert (ours["answer"], ours["city"]) == (theirs["answer"], theirs["city"])
    assert ours.get_meta_info("city")["normalized_prompt_logprobs"] == pytest.approx(
        theirs.get_meta_info("city")["normalized_prompt_logprobs"], abs=1e-3)
    assert api.usage.api_calls == 2  # one gen, one select (all choices in one echo call)


EXAMPLES = ("Extract the person's name, age and city.\n\n"
            "Text: Alice is 30 years old and lives in Paris.\nName: Alice\nAge: 30\nCity: Paris\n\n"
            "Text: Bob is 45 years old and lives in Berlin.\nName: Bob\nAge: 45\nCity: Berlin\n\n")
PEOPLE = ["Carol is 27 years old and lives in Rome.", "Dan is 52 years old and lives in Oslo.",
          "Eve is 33 years old and lives in Lima."]


def _extract_body(s, text):
    s += EXAMPLES + "Text: " + text + "\n"
    # No blank before a gen: the model's own text starts with it, so the prompt of a non-speculative
    # call tokenizes exactly like the speculated text and both runs see the same tokens.
    s += "Name:" + sgl.gen("name", stop="\n", max_tokens=8, temperature=0) + "\n"
    s += "Age:" + sgl.gen("age", stop="\n", max_tokens=8, temperature=0) + "\n"
    s += "City:" + sgl.gen("city", stop="\n", max_tokens=8, temperature=0) + "\n"


extract = sgl.function(_extract_body)
extract_spec = sgl.function(num_api_spec_tokens=48)(_extract_body)


def _fields(states):
    return [tuple(st[k] for k in ("name", "age", "city")) for st in states]


def test_api_speculative_execution_saves_calls(server):
    url = server.url + "/v1"
    plain = OpenAI(MODEL, base_url=url, api_key="unused", is_chat_model=False)
    baseline = _fields([extract.run(text=t, backend=plain) for t in PEOPLE])
    assert plain.usage.api_calls == 3 * len(PEOPLE) and plain.usage.spec_hits == 0
    # `@function(num_api_spec_tokens=48)` on the program, as SGLang users write it.
    spec = OpenAI(MODEL, base_url=url, api_key="unused", is_chat_model=False)
    states = [extract_spec.run(text=t, backend=spec) for t in PEOPLE]
    assert _fields(states) == baseline
    assert spec.usage.api_calls < plain.usage.api_calls / 2, (spec.usage, plain.usage)
    assert spec.usage.spec_hits == plain.usage.api_calls - spec.usage.api_calls
    assert spec.usage.prompt_tokens < plain.usage.prompt_tokens / 2


def test_api_speculative_execution_chat_turn(server, oai):
    @sgl.function(num_api_spec_tokens=32)
    def card(s, text):
        s += sgl.user("Text: Alice is 30 years old.\nGive name and age.")
        s += sgl.assistant("Name: Alice\nAge: 30")
        s += sgl.user("Text: " + text + "\nGive name and age.")
        s += sgl.assistant("Name: " + sgl.gen("name", stop="\n", max_tokens=8, temperature=0)
                           + "\nAge: " + sgl.gen("age", stop="\n", max_tokens=8, temperature=0))

    url = server.url + "/v1"
    spec = OpenAI(MODEL, base_url=url, api_key="unused", is_chat_model=True, continue_final_message=True)
    plain = OpenAI(MODEL, base_url=url, api_key="unused", is_chat_model=True, continue_final_message=True)
    st_spec = card.run(text="Bob is 45 years old.", backend=spec)
    st_plain = sgl.function(card.func).run(text="Bob is 45 years old.", backend=plain)
    st_spec.text(), st_plain.text()  # wait for the programs to finish
    assert st_spec.error() is None and st_plain.error() is None
    assert plain.usage.api_calls == 2  # one per gen (the second continues the partial reply)
    assert spec.usage.api_calls + spec.usage.spec_hits == 2
    messages = st_spec.messages()
    # Greedy, the reply follows the template: one call served the whole turn.
    assert (spec.usage.spec_hits, spec.usage.api_calls) == (1, 1), spec.usage
    reply = oai.chat.completions.create(model=MODEL, messages=messages[:-1], max_tokens=32, temperature=0)
    assert reply.choices[0].message.content.startswith(messages[-1]["content"])
    assert messages[-1]["content"] == f"Name: {st_spec['name']}\nAge: {st_spec['age']}"
