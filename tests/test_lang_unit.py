"""Fast tests of jsgl.lang's interpreter, tracer and compiler over a scripted backend (no model).

The model-backed tests are in test_lang.py; these pin down threading, hints, errors and graph shapes.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time

import pytest

import jsgl.lang as sgl
from jsgl.lang import global_config
from jsgl.lang.backend import BaseBackend
from jsgl.lang.choices import ChoicesDecision
from jsgl.lang.ir import ConstantText, Select


class ScriptedBackend(BaseBackend):
    """Generates `<n>` where n counts characters of the prompt, after an optional delay."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.delay = delay
        self.lock = threading.Lock()
        self.prompts: list[str] = []
        self.hints: list[str] = []

    def generate(self, s, sampling_params):
        with self.lock:
            self.prompts.append(s.text_)
        if "FAIL" in s.text_:
            raise RuntimeError("scripted failure")
        time.sleep(self.delay)
        return f"<{len(s.text_)}>", {"prompt_tokens": len(s.text_)}

    def generate_stream(self, s, sampling_params):
        text, meta = self.generate(s, sampling_params)
        for ch in text:
            time.sleep(0.005)
            yield ch, meta

    def select(self, s, choices, temperature, choices_method):
        # Score: the choice sharing most characters with the prompt's last line.
        last = s.text_.splitlines()[-1] if s.text_ else ""
        scores = [sum(c in last for c in choice) / len(choice) for choice in choices]
        best = max(range(len(choices)), key=scores.__getitem__)
        return ChoicesDecision(choices[best], {"scores": scores})

    def cache_prefix(self, prefix_str):
        self.hints.append(prefix_str)

    def commit_lazy_operations(self, s):
        self.hints.append(s.text_)


@pytest.fixture(autouse=True)
def _restore_config():
    saved = dict(vars(global_config))
    yield
    vars(global_config).update(saved)


def test_gen_does_not_block_and_reading_waits():
    be = ScriptedBackend(delay=0.5)

    @sgl.function
    def prog(s):
        s += "Hello" + sgl.gen("a")
        s += " then" + sgl.gen("b")

    t0 = time.perf_counter()
    st = prog.run(backend=be)
    assert time.perf_counter() - t0 < 0.4  # the body returned before the first gen finished
    assert st["a"] == "<5>"
    assert st["b"] == f"<{len('Hello<5> then')}>"
    assert st.text() == "Hello<5> then<13>"


def test_fork_branches_run_in_parallel_and_hint_once():
    be = ScriptedBackend(delay=0.5)

    @sgl.function
    def prog(s):
        s += "Common prefix. "
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += f"Branch {i}:" + sgl.gen("x")
        forks.join()
        s += "Done."

    t0 = time.perf_counter()
    st = prog.run(backend=be)
    assert len(st["x"]) == 4
    assert time.perf_counter() - t0 < 1.5  # 4 x 0.5 s sequentially
    assert be.hints == ["Common prefix. "]
    assert st.text() == "Common prefix. Done."


def test_switches_disable_hints_and_parallelism():
    global_config.enable_prefix_hint = False
    global_config.enable_parallelism = False
    be = ScriptedBackend(delay=0.1)

    @sgl.function
    def prog(s):
        s += "Prefix text. "
        forks = s.fork(3)
        forks += sgl.gen("x")
        forks.join()

    t0 = time.perf_counter()
    st = prog.run(backend=be)
    assert time.perf_counter() - t0 >= 0.3
    assert st["x"] == ["<13>"] * 3
    assert be.hints == []


def test_concatenate_and_append_and_copy():
    be = ScriptedBackend()

    @sgl.function
    def prog(s, items):
        s += "Facts:\n"
        forks = s.fork(len(items))
        forks += lambda i: f"- {items[i]}\n"
        forks.join(mode="concate_and_append")
        with s.copy() as scratch:
            scratch += "scratch" + sgl.gen("tmp")
        s += "End"

    st = prog.run(items=["a", "b", "c"], backend=be)
    assert st.text() == "Facts:\n- a\n- b\n- c\nEnd"
    n = len("Facts:\n- a\n- b\n- c\nscratch")
    assert st["tmp"] == [f"<{n}>"]


def test_roles_var_scope_and_messages():
    be = ScriptedBackend()

    @sgl.function
    def chat(s):
        s += sgl.system("Be brief.")
        s += sgl.user("Hi")
        s += sgl.assistant(sgl.gen("a1"))
        with s.user():
            s += "More"
        s += sgl.assistant_begin()
        with s.var_scope("scoped"):
            s += "x=" + sgl.gen("a2")
        s += sgl.assistant_end()

    st = chat.run(backend=be)
    msgs = st.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[2]["content"] == st["a1"]
    assert st["scoped"] == "x=" + st["a2"]
    assert st.text().startswith("Be brief.\n\nUSER: Hi\nASSISTANT: ")


def test_errors_stay_on_their_state():
    be = ScriptedBackend()

    @sgl.function
    def prog(s, word):
        if word == "raise":
            raise ValueError("bad input")
        s += word + sgl.gen("out")

    states = prog.run_batch([{"word": "ok"}, {"word": "FAIL"}, {"word": "raise"}, {"word": "fine"}], backend=be)
    assert states[0]["out"] == "<2>" and states[3]["out"] == "<4>"
    assert states[0].error() is None
    assert isinstance(states[1].error(), RuntimeError)
    with pytest.raises(sgl.ProgramError):
        states[1]["out"]
    assert isinstance(states[2].error(), ValueError)
    with pytest.raises(ValueError):  # a single run raises the body's exception directly
        prog.run(word="raise", backend=be)


def test_run_batch_prefix_hint_and_positional_args():
    be = ScriptedBackend()

    @sgl.function
    def prog(s, q):
        s += "A long shared instruction for every input. Q: " + q + "\nA:" + sgl.gen("a")

    states = prog.run_batch([("one",), ("two",)], backend=be, progress_bar=True, num_threads=2)
    n = len("A long shared instruction for every input. Q: one\nA:")
    assert [st["a"] for st in states] == [f"<{n}>", f"<{n}>"]
    assert be.hints == ["A long shared instruction for every input. Q: "]


def test_streaming_sync_and_async():
    be = ScriptedBackend()

    @sgl.function
    def prog(s):
        s += "abc" + sgl.gen("a") + "!"

    st = prog.run(backend=be, stream=True)
    pieces = list(st.text_iter("a"))
    assert len(pieces) > 1 and "".join(pieces) == st["a"] == "<3>"
    st2 = prog.run(backend=be, stream=True)
    assert "".join(st2.text_iter()) == "abc<3>!"

    async def collect():
        st3 = prog.run(backend=be, stream=True)
        return [p async for p in st3.text_async_iter("a")]

    assert "".join(asyncio.run(collect())) == "<3>"


def test_select_and_gen_choices_use_backend():
    be = ScriptedBackend()

    @sgl.function
    def prog(s):
        s += "xyz\n" + sgl.select("c", ["abc", "xyz"]) + "\n" + sgl.gen("d", choices=["qq", "zz"])

    st = prog.run(backend=be)
    assert st["c"] == "xyz" and st["d"] == "zz"


def test_choice_methods():
    choices = ["a", "bb", "ccc"]
    cond = [[(-1.0, 1, "a")], [(-0.5, 2, "b"), (-3.0, 2, "b")], [(-0.5, 3, "c"), (-0.1, 3, "c"), (-0.1, 3, "c")]]
    uncond = [[(None, 1, "a")], [(None, 2, "b"), (-0.1, 2, "b")], [(None, 3, "c"), (-0.1, 3, "c"), (-0.1, 3, "c")]]
    kw = dict(choices=choices, normalized_prompt_logprobs=[sgl.choices.mean_logprob(c) for c in cond],
              input_token_logprobs=cond, output_token_logprobs=[[], [], []], unconditional_token_logprobs=uncond)
    assert sgl.token_length_normalized(**kw).decision == "ccc"
    # Greedy: position 0 ties b/c at -0.5; position 1: c (-0.1) beats b (-3.0).
    assert sgl.greedy_token_selection(**kw).decision == "ccc"
    scores = sgl.unconditional_likelihood_normalized.scores(**kw)
    assert math.isclose(scores[1], (-0.5 + (-3.0 + 0.1)) / 2)
    assert sgl.unconditional_likelihood_normalized(**kw).decision == choices[max(range(3), key=scores.__getitem__)]


def branch_solve_merge(s, essay):
    s += "Judge the essay below.\nEssay: " + essay + "\n"
    forks = s.fork(3)
    for f, aspect in zip(forks, ["clarity", "grammar", "argument"], strict=True):
        f += "Comment on its " + aspect + ":" + sgl.gen("judgement", max_tokens=8)
    forks.join()
    s += "Summary of comments:\n"
    for f in forks:
        s += f["judgement"] + "\n"
    s += "Overall score:" + sgl.gen("score", max_tokens=4)


def test_trace_branch_solve_merge_shape():
    prog = sgl.function(branch_solve_merge)
    tracer = prog.trace(backend=ScriptedBackend())
    counts = tracer.count_nodes()
    assert counts["Fork"] == 1 and counts["GetForkItem"] == 3 and counts["Join"] == 1
    assert counts["Gen"] == 4 and counts["Variable"] == 3 and counts["Argument"] == 1
    # Parent: 2 constants around the essay, "Summary...", 3 x "\n" after each variable, "Overall score:".
    # Branches: one constant each (the Python strings are joined before they reach the state).
    assert counts["ConstantText"] == 7 + 3
    assert len(tracer.child_states) == 3
    assert all(isinstance(n, ConstantText) for n in tracer.nodes[:1])
    text = tracer.print_graph()
    assert "Fork(number=3)" in text


def test_compiled_matches_interpreted():
    be = ScriptedBackend()
    prog = sgl.function(branch_solve_merge)
    compiled = prog.compile(backend=be)
    graph = compiled.print_graph()
    assert "stream  3" in graph  # parent + 3 branches
    essay = "Cats are great because they purr."
    interp = prog.run(essay=essay, backend=be)
    comp = compiled.run(essay=essay, backend=be)
    assert comp.text() == interp.text()
    assert comp["judgement"] == interp["judgement"] and comp["score"] == interp["score"]
    batch = compiled.run_batch([{"essay": "A."}, {"essay": "B."}], backend=be)
    assert [b["score"] for b in batch] == [prog.run(essay=e, backend=be)["score"] for e in ("A.", "B.")]


def test_bind_and_missing_backend():
    @sgl.function
    def prog(s, a, b="dflt"):
        s += a + b + sgl.gen("g")

    bound = prog.bind(a="x")
    assert bound.run(backend=ScriptedBackend())["g"] == "<5>"
    global_config.default_backend = None
    with pytest.raises(ValueError, match="no backend"):
        prog.run(a="y")
    with pytest.raises(NotImplementedError):
        sgl.image("cat.png")


def test_chat_template_from_real_tokenizer():
    from jsgl.model.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    tmpl = sgl.get_chat_template_from_tokenizer(tok)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"}]
    text, history = "", []
    for m in msgs:
        pre, suf = tmpl.get_prefix_and_suffix(m["role"], history)
        text += pre + m["content"] + suf
        history.append(m)
    assert text == tok.apply_chat_template(msgs, tokenize=False)
    # The default system prompt the template inserts for a conversation that opens with the user.
    user_only = tok.apply_chat_template([{"role": "user", "content": "U"}], tokenize=False)
    assert tmpl.default_system_prompt and tmpl.default_system_prompt in user_only


def test_gen_params_merge_and_dtype_regex():
    from jsgl.lang.function import default_params

    g = sgl.gen("n", max_tokens=5, dtype=int, stop="!")
    kw = g.sampling_params.merged_over(default_params(temperature=0.5, max_new_tokens=99)).to_engine_kwargs()
    assert kw["max_new_tokens"] == 5 and kw["temperature"] == 0.5
    assert kw["regex"] == sgl.REGEX_INT and kw["stop"] == ["!", " ", "\n"]
    with pytest.raises(ValueError):
        sgl.gen(dtype=list)
    assert isinstance(sgl.gen("c", choices=["a", "b"]), Select)


def test_prefix_extraction_includes_roles():
    from jsgl.lang.tracer import extract_prefix_by_tracing

    @sgl.function
    def prog(s, q):
        s += sgl.system("Be brief.")
        s += sgl.user("Question: " + q)
        s += sgl.assistant(sgl.gen("a"))

    assert extract_prefix_by_tracing(prog, ScriptedBackend()) == "Be brief.\n\nUSER: Question: "


def test_text_iter_without_streaming_yields_once():
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a")

    st = prog.run(backend=ScriptedBackend())
    assert list(st.text_iter()) == ["x<1>"] and list(st.text_iter("a")) == ["<1>"]


def test_state_can_be_extended_after_run():
    be = ScriptedBackend(delay=0.2)

    @sgl.function
    def prog(s):
        s += "ab" + sgl.gen("a")

    st = prog.run(backend=be)
    st += "!" + sgl.gen("b")  # runs after the program's own nodes, on the caller's thread
    assert st["a"] == "<2>" and st["b"] == "<6>" and st.text() == "ab<2>!<6>"


def test_select_temperature_samples_by_scores():
    """decide(): greedy at temperature 0; at temperature > 0 a softmax draw over the method's scores that
    never picks an unscorable (empty) choice and follows the score gap."""
    from jsgl.lang.choices import TokenLengthNormalized, decide

    choices = ["yes", "no", ""]
    cond = [[(-0.1, 1, "yes")], [(-0.9, 2, "no")], []]  # the empty choice has no tokens: NaN score
    method = TokenLengthNormalized()
    assert decide(choices, cond, None, 0.0, method).decision == "yes"
    random.seed(0)
    picks = [decide(choices, cond, None, 1.0, method) for _ in range(400)]
    counts = {c: sum(p.decision == c for p in picks) for c in choices}
    assert counts[""] == 0
    expected_yes = 1 / (1 + math.exp(-0.8))  # softmax of (-0.1, -0.9)
    assert abs(counts["yes"] / 400 - expected_yes) < 0.08
    assert picks[0].meta_info["sampled_from_scores"][:2] == [-0.1, -0.9]


# SGLang parity: gen(min_tokens/stop_regex/n), streaming meta, separate_reasoning, exported names ----------

class SamplingBackend(ScriptedBackend):
    """Records each gen's resolved parameters; n > 1 answers a list of samples (as the real backends),
    and streams in chunks whose meta carries their own tokens (one chunk has no text, as a held-back stop)."""

    def __init__(self, reply: str = "ab cd", chunks: list | None = None) -> None:
        super().__init__()
        self.reply = reply
        self.chunks = chunks or [(reply, [1])]  # (text, token ids) per stream chunk
        self.params: list = []

    def generate(self, s, sampling_params):
        self.params.append(sampling_params)
        n = sampling_params.n or 1
        if n > 1:
            return [f"{self.reply}#{i}" for i in range(n)], [{"index": i} for i in range(n)]
        return self.reply, {"completion_tokens": 2}

    def generate_stream(self, s, sampling_params):
        self.params.append(sampling_params)
        chunks, total = self.chunks, 0
        for i, (text, toks) in enumerate(chunks):
            total += len(toks)
            time.sleep(0.01)
            yield text, {"completion_tokens": total, "output_token_logprobs_length": total,
                         "output_token_logprobs": [(-0.5, t, None) for t in toks],
                         "finish_reason": "stop" if i == len(chunks) - 1 else None}


def test_gen_takes_every_sglang_parameter():
    import inspect

    from jsgl.lang.function import default_params

    g = sgl.gen("x", max_tokens=9, min_tokens=3, n=2, stop_regex=r"\d+", repetition_penalty=1.2,
                logit_bias={"5": -1.0}, sampling_seed=7)
    kw = g.sampling_params.merged_over(default_params(temperature=0.3)).to_engine_kwargs()
    assert kw["max_new_tokens"] == 9 and kw["min_new_tokens"] == 3 and kw["n"] == 2
    assert kw["stop_regex"] == r"\d+" and kw["repetition_penalty"] == 1.2 and kw["sampling_seed"] == 7
    assert kw["temperature"] == 0.3 and kw["logit_bias"] == {"5": -1.0}
    with pytest.raises(TypeError, match="unknown sampling"):
        sgl.gen("x", max_new_toknes=3)
    with pytest.raises(ValueError):
        sgl.gen("x", n=0)
    # SGLang's gen() parameters, in SGLang's order (positional calls mean the same).
    sglang_params = ["name", "max_tokens", "min_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature",
                     "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "ignore_eos",
                     "return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "dtype",
                     "choices", "choices_method", "regex", "json_schema"]
    assert list(inspect.signature(sgl.gen).parameters)[:len(sglang_params)] == sglang_params


def test_n_samples_make_a_list_and_the_text_takes_the_first():
    be = SamplingBackend()

    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("a", n=3, max_tokens=4) + "|" + sgl.gen("b", max_tokens=4)

    for stream in (False, True):  # n > 1 is generated unstreamed even in a streamed run
        st = prog.run(backend=be, stream=stream)
        assert st["a"] == ["ab cd#0", "ab cd#1", "ab cd#2"]
        assert st.get_meta_info("a") == [{"index": 0}, {"index": 1}, {"index": 2}]
        assert st.text() == "Q:ab cd#0|ab cd"


def test_stream_meta_pairs_each_piece_with_its_tokens():
    be = SamplingBackend(chunks=[("ab", [1, 2]), ("", [3]), (" cd", [4]), ("", [5])])

    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("a", max_tokens=8, return_logprob=True)

    async def collect(st):
        return [item async for item in st.text_async_iter("a", return_meta_data=True)]

    st = prog.run(backend=be, stream=True)
    chunks = asyncio.run(collect(st))
    assert "".join(c for c, _ in chunks) == "ab cd"
    prev = 0
    for text, meta in chunks:  # SGLang's own invariants (test_programs.py, test_stream_logprobs)
        assert text
        assert meta["completion_tokens"] == meta["output_token_logprobs_length"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - prev
        prev = meta["completion_tokens"]
    # The text-less chunk's tokens went with the next piece; the last one (no text) is dropped, as SGLang.
    assert [len(m["output_token_logprobs"]) for _, m in chunks] == [2, 2]
    # meta_info holds the whole generation: every chunk's tokens, the last chunk's finish_reason.
    meta = st.get_meta_info("a")
    assert [t for _, t, _ in meta["output_token_logprobs"]] == [1, 2, 3, 4, 5] and meta["finish_reason"] == "stop"
    pairs = list(prog.run(backend=be, stream=True).text_iter("a", return_meta_data=True))
    assert [p for p, _ in pairs] == [c for c, _ in chunks]
    # Not streamed: one piece with the whole meta.
    (piece, meta), = prog.run(backend=be).text_iter("a", return_meta_data=True)
    assert piece == "ab cd" and meta == {"completion_tokens": 2}


def test_separate_reasoning_splits_variable_and_text():
    from jsgl.lang.reasoning import ReasoningParser

    be = SamplingBackend(reply="<think>\nstep one\n</think>\n\nThe answer.")

    @sgl.function
    def prog(s):
        s += sgl.user("Q?")
        s += sgl.assistant(sgl.separate_reasoning(sgl.gen("a", max_tokens=8), model_type="qwen3"))
        s += "after=" + s["a"]

    st = prog.run(backend=be)
    assert st["a"] == "\n\nThe answer." and st["a_reasoning_content"] == "\nstep one\n"
    assert "<think>" not in st.text() and st.messages()[-1]["content"] == "The answer."
    compiled = prog.compile(backend=be).run(backend=be)
    assert compiled.text() == st.text() and compiled["a_reasoning_content"] == st["a_reasoning_content"]
    streamed = prog.run(backend=be, stream=True)
    assert streamed["a"] == "\n\nThe answer." and streamed["a_reasoning_content"] == "\nstep one\n"
    # DeepSeek-R1 reasons without the opening tag; an unfinished block is all reasoning.
    assert ReasoningParser("deepseek-r1").parse_non_stream("hmm</think>42") == ("hmm", "42")
    assert ReasoningParser("qwen3").parse_non_stream("no tags") == ("", "no tags")
    assert ReasoningParser("qwen3").parse_non_stream("<think>cut off") == ("cut off", "")
    with pytest.raises(ValueError, match="unsupported reasoning parser"):
        sgl.separate_reasoning(sgl.gen("a"), model_type="gpt-oss")
    with pytest.raises(ValueError, match="needs model_type"):
        sgl.separate_reasoning(sgl.gen("a"))


def test_openai_backend_maps_extensions_to_extra_body():
    from jsgl.lang.openai_backend import OpenAI

    args, extra = OpenAI._api_kwargs({"max_new_tokens": 5, "min_new_tokens": 2, "stop_regex": "x", "n": 2,
                                      "repetition_penalty": 1.1, "logit_bias": {"5": 1.0}, "sampling_seed": 3,
                                      "top_k": -1, "temperature": 0.0, "ebnf": None})
    assert args == {"max_tokens": 5, "n": 2, "seed": 3, "logit_bias": {"5": 1.0}, "temperature": 0.0}
    assert extra == {"min_tokens": 2, "stop_regex": "x", "repetition_penalty": 1.1}  # defaults are not sent


def test_every_sglang_frontend_name_is_exported():
    import jsgl

    sglang_all = ["Anthropic", "Crusoe", "Engine", "LiteLLM", "OpenAI", "Runtime", "RuntimeEndpoint", "ServerArgs",
                  "VertexAI", "__version__", "assistant", "assistant_begin", "assistant_end", "flush_cache",
                  "function", "gen", "gen_int", "gen_string", "get_server_info", "global_config",
                  "greedy_token_selection", "image", "select", "separate_reasoning", "set_default_backend",
                  "system", "system_begin", "system_end", "token_length_normalized",
                  "unconditional_likelihood_normalized", "user", "user_begin", "user_end", "video"]
    for name in sglang_all:
        assert getattr(jsgl, name) is not None, name
    for name in ("Anthropic", "LiteLLM", "VertexAI", "ServerArgs"):
        with pytest.raises(sgl.LeftOutError, match="not implemented"):
            getattr(jsgl, name)("model")
    with pytest.raises(ValueError, match="CRUSOE_API_KEY"):
        jsgl.Crusoe("m", api_key="")


def test_separate_reasoning_around_a_whole_turn():
    """SGLang's other spelling, separate_reasoning(assistant(gen)): the split happens after the turn closed,
    so the text and the turn's message are both rewritten."""
    be = SamplingBackend(reply="<think>hm</think>Yes.")

    @sgl.function
    def prog(s):
        s += sgl.user("Q?")
        s += sgl.separate_reasoning(sgl.assistant(sgl.gen("a", max_tokens=8)), model_type="qwen3")

    st = prog.run(backend=be)
    assert st["a"] == "Yes." and st["a_reasoning_content"] == "hm"
    assert st.text() == "USER: Q?\nASSISTANT: Yes.\n" and st.messages()[-1] == {"role": "assistant", "content": "Yes."}
