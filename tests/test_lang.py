"""SGLang-style programs on the real default model through the in-process Runtime (greedy, short outputs).

Checks compare against the engine called directly (`eng.generate`), so they hold whatever the 135M model
happens to answer.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

import jsgl.lang as sgl
from jsgl.engine.request import InvalidRequestError
from jsgl.lang import global_config


@pytest.fixture(scope="module")
def rt():
    runtime = sgl.Runtime(model="smollm2-135m", kv_cache_gb=0.25, max_running_requests=32,
                          chunked_prefill_size=256)
    sgl.set_default_backend(runtime)
    yield runtime
    sgl.set_default_backend(None)
    runtime.shutdown()


def _greedy(rt, prompt: str, **params) -> str:
    return rt.engine.generate(prompt, {"temperature": 0, **params}).text


FEW_SHOT = ("The following are questions with answers.\n\n"
            "Q: What is the capital of France?\nA: Paris\n"
            "Q: What is the capital of Germany?\nA: Berlin\n"
            "Q: What is the capital of Italy?\nA: Rome\n")


@sgl.function
def few_shot_qa(s, question):
    s += FEW_SHOT
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n", temperature=0, max_tokens=12)


def test_few_shot_qa_matches_engine(rt):
    st = few_shot_qa.run(question="What is the capital of Spain?")
    prompt = FEW_SHOT + "Q: What is the capital of Spain?\nA:"
    assert st["answer"] == _greedy(rt, prompt, max_new_tokens=12, stop="\n")
    assert "\n" not in st["answer"] and st.text() == prompt + st["answer"]
    meta = st.get_meta_info("answer")
    assert meta["prompt_tokens"] > 0 and meta["finish_reason"] in ("stop", "length")


def test_multi_turn_chat_roles(rt):
    @sgl.function
    def chat(s, q1, q2):
        s += sgl.user(q1)
        s += sgl.assistant(sgl.gen("a1", max_tokens=12))
        with s.user():
            s += q2
        with s.assistant():
            s += sgl.gen("a2", max_tokens=12)

    st = chat.run(q1="Name a fruit.", q2="Name another one.", temperature=0)
    msgs = st.messages()
    # The model's template inserts its default system prompt; the state does the same explicitly.
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[1]["content"] == "Name a fruit." and msgs[3]["content"] == "Name another one."
    assert msgs[2]["content"] == st["a1"].lstrip() and msgs[4]["content"] == st["a2"].lstrip()
    full = [dict(m, content=c) for m, c in zip(msgs, [msgs[0]["content"], "Name a fruit.", st["a1"],
                                                       "Name another one.", st["a2"]], strict=True)]
    assert st.text() == rt.tokenizer.apply_chat_template(full, tokenize=False)
    # Generation inside the assistant turn is exactly the engine's continuation of the rendered chat.
    prompt = rt.tokenizer.apply_chat_template(full[:2], tokenize=False, add_generation_prompt=True)
    assert st["a1"] == _greedy(rt, prompt, max_new_tokens=12)


def _independent_scores(rt, prefix: str, choices: list[str], method) -> list[float]:
    tok = rt.tokenizer
    pre = tok(prefix, add_special_tokens=False).input_ids
    cond, uncond = [], []
    for c in choices:
        full = tok(prefix + c, add_special_tokens=False).input_ids
        k = next((i for i, (a, b) in enumerate(zip(pre, full)) if a != b), min(len(pre), len(full)))
        out = rt.engine.generate(full, {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": k})
        cond.append(out.input_logprobs)
        if method is sgl.unconditional_likelihood_normalized:
            out = rt.engine.generate(full[k:], {"max_new_tokens": 0, "return_logprob": True,
                                                "logprob_start_len": 0})
            uncond.append([lp or 0.0 for lp in out.input_logprobs])
    if method is sgl.unconditional_likelihood_normalized:
        return [sum(a - b for a, b in zip(c, u, strict=True)) / len(c) for c, u in zip(cond, uncond, strict=True)]
    if method is sgl.token_length_normalized:
        return [sum(c) / len(c) for c in cond]
    # greedy_token_selection: lexicographic comparison of the (mean-padded) per-token logprobs.
    width = max(len(c) for c in cond)
    return [tuple(c + [sum(c) / len(c)] * (width - len(c))) for c in cond]


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.greedy_token_selection,
                                    sgl.unconditional_likelihood_normalized], ids=repr)
def test_select_is_argmax_of_method_score(rt, method):
    choices = ["True", "False", "Unknown"]

    @sgl.function
    def true_or_false(s, statement):
        s += "Determine whether the statement below is True, False, or Unknown.\n"
        s += "Statement: The capital of France is Paris.\nAnswer: True\n"
        s += "Statement: " + statement + "\n"
        s += "Answer:" + sgl.select("answer", choices, choices_method=method)

    st = true_or_false.run(statement="The capital of Canada is Tokyo.")
    assert st["answer"] in choices
    prefix = st.text()[: -len(st["answer"])]
    scores = _independent_scores(rt, prefix, choices, method)
    best = max(range(len(choices)), key=lambda i: scores[i])
    assert st["answer"] == choices[best], (scores, st.get_meta_info("answer"))
    meta = st.get_meta_info("answer")
    if method is sgl.token_length_normalized:
        assert meta["normalized_prompt_logprobs"] == pytest.approx(scores, abs=1e-3)
    # The prefix hint computed the shared prompt once: every choice request found it in the radix cache
    # (up to the position before its first scored token, which must be recomputed for its logits).
    assert all(c >= start - 1 for c, start in zip(meta["cached_tokens"], meta["score_start"], strict=True))
    assert min(meta["cached_tokens"]) > 0.8 * meta["prefix_tokens"]


def test_gen_int_and_dtypes(rt):
    @sgl.function
    def numbers(s):
        s += "The number of hours in a day is " + sgl.gen_int("hours", max_tokens=6) + "\n"
        s += "Pi is about " + sgl.gen("pi", dtype=float, max_tokens=8) + "\n"
        s += "Is the sky blue? " + sgl.gen("yes", dtype=bool, max_tokens=4) + "\n"

    st = numbers.run(temperature=0)
    int(st["hours"])
    float(st["pi"])
    assert st["yes"] in ("True", "False")


def test_regex_fullmatch(rt):
    ip = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"

    @sgl.function
    def regex_gen(s):
        s += "Q: What is the IP address of the Google DNS servers?\n"
        s += "A: " + sgl.gen("answer", temperature=0, regex=ip, max_tokens=24)

    assert re.fullmatch(ip, regex_gen.run()["answer"])


def test_json_regex_program(rt):
    @sgl.function
    def city(s):
        s += "Describe Paris as a JSON object.\n"
        with s.var_scope("json_output"):
            s += "{\n"
            s += '  "name": ' + sgl.gen(regex=sgl.REGEX_STR, max_tokens=12) + ",\n"
            s += '  "population": ' + sgl.gen(regex=sgl.REGEX_INT, stop=[" ", "\n"], max_tokens=12) + "\n"
            s += "}"

    obj = json.loads(city.run(temperature=0)["json_output"])
    assert isinstance(obj["name"], str) and isinstance(obj["population"], int)


def test_json_schema_gen(rt):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "rank": {"type": "integer", "maximum": 99}},
              "required": ["city", "rank"]}

    @sgl.function
    def fav(s):
        s += "Your favourite city and its rank, as JSON: " + sgl.gen("obj", json_schema=json.dumps(schema),
                                                                      max_tokens=48)

    st = fav.run(temperature=0)
    obj = json.loads(st["obj"])
    assert set(obj) == {"city", "rank"} and isinstance(obj["rank"], int)
    assert st.get_meta_info("obj")["finish_reason"] == "stop"


def test_fork_join_parallel_decoding(rt):
    @sgl.function
    def tips(s, topic):
        s += "Here are three tips for " + topic + ".\n"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Tip {i + 1}:" + sgl.gen("tip", max_tokens=10, stop="\n")
        forks.join()
        s += "In summary," + sgl.gen("summary", max_tokens=10)

    st = tips.run(topic="staying healthy", temperature=0)
    head = "Here are three tips for staying healthy.\n"
    assert st["tip"] == [_greedy(rt, head + f"Tip {i + 1}:", max_new_tokens=10, stop="\n") for i in range(3)]
    assert st.text() == head + "In summary," + st["summary"]


def test_concatenate_and_append(rt):
    @sgl.function
    def parallel_encoding(s, question, contexts):
        s += "I will ask a question based on some statements.\n"
        forks = s.fork(len(contexts))
        forks += lambda i: f"Statement {i}: " + contexts[i] + "\n"
        forks.join(mode="concate_and_append")
        s += "Question: " + question + "\nAnswer:" + sgl.gen("answer", max_tokens=8, stop="\n")

    ctx = ["Ethan is the father of Liam.", "Noah is the father of Julian.", "Oliver is the father of Carlos."]
    st = parallel_encoding.run(question="Who is the father of Julian?", contexts=ctx, temperature=0)
    expected = ("I will ask a question based on some statements.\n"
                + "".join(f"Statement {i}: {c}\n" for i, c in enumerate(ctx))
                + "Question: Who is the father of Julian?\nAnswer:")
    assert st.text() == expected + st["answer"]
    assert st["answer"] == _greedy(rt, expected, max_new_tokens=8, stop="\n")


def test_tool_use_loop(rt):
    def calculate(expression: str) -> str:
        if not re.fullmatch(r"[\d+\-*/ ().]+", expression or ""):
            return "error"
        try:
            return str(eval(expression, {"__builtins__": {}}))  # digits and operators only
        except Exception:
            return "error"

    @sgl.function
    def tool_use(s, questions):
        s += "Use calculate(expression) for arithmetic.\ncalculate(1+2) = 3\ncalculate(3*4) = 12\n"
        for i, q in enumerate(questions):
            s += f"Question: {q}\nAnswer: calculate(" + sgl.gen(f"expr{i}", stop=")", max_tokens=12) + ") = "
            with s.var_scope(f"result{i}"):
                s += calculate(s[f"expr{i}"])
            s += "\n"

    st = tool_use.run(questions=["What is 12 times 7?", "What is 5 plus 9?"], temperature=0)
    for i in range(2):
        assert ")" not in st[f"expr{i}"]
        assert st[f"result{i}"] == calculate(st[f"expr{i}"])
        assert f"calculate({st[f'expr{i}']}) = {st[f'result{i}']}\n" in st.text()


def test_streaming_yields_final_text(rt):
    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=16))

    st = qa.run(question="Say something about the sea.", temperature=0, stream=True)
    pieces = list(st.text_iter("answer"))
    assert "".join(pieces) == st["answer"] and len(pieces) > 1
    st2 = qa.run(question="Say something about the sea.", temperature=0, stream=True)
    assert "".join(st2.text_iter()) == st2.text() == st.text()


def test_run_batch_32_with_progress_bar(rt):
    questions = [f"What is the capital of country number {i}?" for i in range(32)]
    states = few_shot_qa.run_batch([{"question": q} for q in questions], progress_bar=True)
    assert len(states) == 32 and all(st.error() is None for st in states)
    for i in (0, 17, 31):
        prompt = FEW_SHOT + "Q: " + questions[i] + "\nA:"
        assert states[i]["answer"] == _greedy(rt, prompt, max_new_tokens=12, stop="\n")


def test_exception_surfaces_on_its_state_only(rt):
    @sgl.function
    def prog(s, mode):
        s += "Count: one, two,"
        if mode == "python":
            raise KeyError("boom")
        s += sgl.gen("next", max_tokens=4, temperature=-1.0 if mode == "engine" else 0.0)

    states = prog.run_batch([{"mode": "ok"}, {"mode": "engine"}, {"mode": "python"}, {"mode": "ok"}])
    assert states[0].error() is None and states[3].error() is None
    assert states[0]["next"] == states[3]["next"]
    assert isinstance(states[1].error(), InvalidRequestError)
    assert isinstance(states[2].error(), KeyError)
    with pytest.raises(sgl.ProgramError):
        states[1]["next"]


def judge_program(s, essay):
    s += sgl.system("You are a fair essay judge.")
    s += sgl.user("Essay: " + essay)
    forks = s.fork(2)
    for f, aspect in zip(forks, ["clarity", "originality"], strict=True):
        f += sgl.assistant("Judging " + aspect + ":" + sgl.gen("judgement", max_tokens=8, stop="\n"))
    forks.join()
    s += sgl.user("Combine the judgements.")
    s += sgl.assistant(sgl.gen("verdict", max_tokens=8))


def test_trace_node_counts(rt):
    tracer = sgl.function(judge_program).trace()
    counts = tracer.count_nodes()
    # Roles: system, user, 2 x assistant in branches, user, assistant.
    assert counts["RoleBegin"] == counts["RoleEnd"] == 6
    assert counts["Fork"] == 1 and counts["GetForkItem"] == 2 and counts["Join"] == 1
    assert counts["Gen"] == 3 and counts["Argument"] == 1
    assert counts.get("Variable", 0) == 0


def test_compiled_agrees_with_interpreted(rt):
    prog = sgl.function(judge_program)
    compiled = prog.compile()
    essay = "Cities should plant more trees because shade cools streets."
    a = prog.run(essay=essay, temperature=0)
    b = compiled.run(essay=essay, temperature=0)
    assert b.text() == a.text()
    assert b["judgement"] == a["judgement"] and b["verdict"] == a["verdict"]
    assert [m["role"] for m in b.messages()] == [m["role"] for m in a.messages()]


def test_prefix_hint_switch_controls_extra_requests(rt):
    @sgl.function
    def two_branches(s):
        s += "A shared prefix that both branches continue from.\n"
        forks = s.fork(2)
        forks += sgl.gen("x", max_tokens=2)
        forks.join()

    before = rt.stats()["prompt_tokens"]
    two_branches.run(temperature=0).sync()
    with_hint = rt.stats()["prompt_tokens"] - before
    global_config.enable_prefix_hint = False
    try:
        before = rt.stats()["prompt_tokens"]
        two_branches.run(temperature=0).sync()
        without_hint = rt.stats()["prompt_tokens"] - before
    finally:
        global_config.enable_prefix_hint = True
    n = len(rt.tokenizer("A shared prefix that both branches continue from.\n").input_ids)
    assert with_hint - without_hint == n  # exactly one extra request: the prefix, sent once


def test_fork_hint_makes_branches_hit_the_cache(rt):
    @sgl.function
    def branches(s, topic):
        s += "Write one short sentence about " + topic + " for each of the following readers.\n"
        forks = s.fork(3)
        for f, reader in zip(forks, ["a child", "a scientist", "a poet"], strict=True):
            f += "Reader: " + reader + "\nSentence:" + sgl.gen("line", max_tokens=4)
        forks.join()

    st = branches.run(topic="volcanoes", temperature=0)
    prefix = rt.tokenizer("Write one short sentence about volcanoes for each of the following readers.\n",
                          add_special_tokens=False).input_ids
    # The hint was sent before the branches started, so each branch reused (almost) the whole prefix.
    assert all(m["cached_tokens"] >= len(prefix) - 1 for m in st.get_meta_info("line"))


# SGLang parity: gen(min_tokens / stop_regex / n), concate_and_append and streaming meta, in process and over
# HTTP (a server in this process on the same engine, reached through jsgl's RuntimeEndpoint).

@pytest.fixture(scope="module")
def remote(rt):
    from jsgl.server.launch import ServerThread

    with ServerThread(rt.engine) as srv:
        endpoint = sgl.RuntimeEndpoint(srv.url)
        yield endpoint
        endpoint.close()


@pytest.fixture(params=["local", "http"])
def backend(request, rt):
    return rt if request.param == "local" else request.getfixturevalue("remote")


def _finish_type(meta) -> str:
    reason = meta["finish_reason"]
    return reason["type"] if isinstance(reason, dict) else reason  # HTTP: SGLang's {"type": ...}


COUNT = "Count: 1, 2, 3,"
CAPITAL = FEW_SHOT + "Q: What is the capital of Spain?\nA:"


@sgl.function
def sampling_knobs(s):
    s += COUNT + sgl.gen("upto", stop_regex=r"\d", max_tokens=12)
    s += "\n" + CAPITAL + sgl.gen("long", min_tokens=6, stop="\n", max_tokens=10)
    s += "\n" + CAPITAL + sgl.gen("two", n=2, stop="\n", max_tokens=6)


def test_gen_min_tokens_stop_regex_n(rt, backend):
    st = sampling_knobs.run(backend=backend, temperature=0)
    # stop_regex: the output ends before the first digit, exactly where the engine's own request ends.
    assert re.search(r"\d", _greedy(rt, COUNT, max_new_tokens=12))  # without it the model writes digits
    assert st["upto"] == _greedy(rt, COUNT, max_new_tokens=12, stop_regex=r"\d") and not re.search(r"\d", st["upto"])
    assert _finish_type(st.get_meta_info("upto")) == "stop"
    # min_tokens: the stop is ignored until 6 tokens exist (the plain answer is shorter).
    prompt = COUNT + st["upto"] + "\n" + CAPITAL
    short = rt.engine.generate(prompt, {"temperature": 0, "max_new_tokens": 10, "stop": "\n"})
    assert short.completion_tokens < 6
    assert st["long"] == _greedy(rt, prompt, max_new_tokens=10, stop="\n", min_new_tokens=6)
    assert st.get_meta_info("long")["completion_tokens"] >= 6
    # n=2: a list of samples (greedy, so both are the greedy answer); the text continues with the first.
    answer = _greedy(rt, prompt + st["long"] + "\n" + CAPITAL, max_new_tokens=6, stop="\n")
    assert st["two"] == [answer, answer] and len(st.get_meta_info("two")) == 2
    assert st.text().endswith(CAPITAL + answer)


def test_concatenate_and_append_over_http(rt, remote):
    @sgl.function
    def parallel_encoding(s, contexts):
        s += "Read the statements.\n"
        forks = s.fork(len(contexts))
        forks += lambda i: f"Statement {i}: " + contexts[i] + "\n"
        forks.join(mode="concate_and_append")
        s += "Question: Who is the father of Julian?\nAnswer:" + sgl.gen("answer", max_tokens=6, stop="\n")

    ctx = ["Ethan is the father of Liam.", "Noah is the father of Julian."]
    remote_st = parallel_encoding.run(contexts=ctx, backend=remote, temperature=0)
    local_st = parallel_encoding.run(contexts=ctx, backend=rt, temperature=0)
    assert remote_st.text() == local_st.text()
    assert remote_st.text().startswith("Read the statements.\nStatement 0: Ethan is the father of Liam.\n"
                                       "Statement 1: Noah")


def test_streaming_meta_per_chunk(rt, backend):
    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=12, return_logprob=True))

    async def collect(state):
        return [item async for item in state.text_async_iter("answer", return_meta_data=True)]

    st = qa.run(question="Say something about the sea.", backend=backend, temperature=0, stream=True)
    chunks = asyncio.run(collect(st))
    prev, ids = 0, []
    for text, meta in chunks:  # SGLang's own checks (its test_programs.py, test_stream_logprobs)
        assert text and "output_token_logprobs" in meta
        assert meta["completion_tokens"] == meta["output_token_logprobs_length"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - prev
        prev = meta["completion_tokens"]
        ids += [t[1] for t in meta["output_token_logprobs"]]
    plain = qa.run(question="Say something about the sea.", backend=rt, temperature=0)
    assert "".join(c for c, _ in chunks) == st["answer"] == plain["answer"]
    expected = [t[1] for t in plain.get_meta_info("answer")["output_token_logprobs"]]
    assert ids == expected[:len(ids)] and len(chunks) > 1
    # After the stream, meta_info holds every token's logprob (the chunks merged).
    assert [t[1] for t in st.get_meta_info("answer")["output_token_logprobs"]] == expected


def test_openai_backend_passes_n_and_extensions(rt, remote):
    """Through jsgl's /v1: n, min_tokens, stop_regex and repetition_penalty (extra_body) mean what they mean
    in process."""
    oai = sgl.OpenAI("smollm2-135m", base_url=remote.base_url + "/v1", api_key="unused", is_chat_model=False,
                     max_retries=0)

    @sgl.function
    def prog(s):
        s += COUNT + sgl.gen("upto", stop_regex=r"\d", max_tokens=8, repetition_penalty=1.3)
        s += "\n" + CAPITAL + sgl.gen("long", min_tokens=6, stop="\n", max_tokens=8)
        s += "\n" + CAPITAL + sgl.gen("two", n=2, stop="\n", max_tokens=6)

    via_api = prog.run(backend=oai, temperature=0)
    local = prog.run(backend=rt, temperature=0)
    assert via_api.text() == local.text()
    assert via_api["two"] == local["two"] and len(via_api["two"]) == 2
    assert oai.usage.api_calls == 3
