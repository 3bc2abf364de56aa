"""SGLang programs run by the real SGLang frontend (`import sglang`) against a jsgl server.

Run by tests/test_sglang_client.py in a subprocess with the sglang client on PYTHONPATH (never imported
into the pytest process: it patches transformers and pulls in torch):

    python tests/sglang_client_programs.py http://127.0.0.1:PORT

Prints one line `REPORT: {...}`: per program, what it produced (enough for the test to check it against
jsgl's own engine) or the error. Every HTTP answer other than 200 that the client got is listed under
"http_errors" with its request, which is how a server gap shows up.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import sglang as sgl
import sglang.lang.backend.runtime_endpoint as runtime_endpoint

HTTP_ERRORS: list[dict[str, Any]] = []
_lock = threading.Lock()
_http_request = runtime_endpoint.http_request


def _logged_http_request(url: str, json: Any = None, stream: bool = False, **kwargs: Any) -> Any:
    """SGLang's own http_request, recording any non-200 answer with the request that caused it."""
    res = _http_request(url, json=json, stream=stream, **kwargs)
    if res.status_code != 200:
        body = res.text if not stream else res.content.decode("utf-8", "replace")
        with _lock:
            HTTP_ERRORS.append({"url": url, "request": json, "status": res.status_code, "response": body[:2000]})
    return res


runtime_endpoint.http_request = _logged_http_request

FEW_SHOT = ("The following are questions with answers.\n\n"
            "Q: What is the capital of France?\nA: Paris\n"
            "Q: What is the capital of Germany?\nA: Berlin\n")
IP_REGEX = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"
PERSON_SCHEMA = {"type": "object",
                 "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
                 "required": ["name", "age"]}


def _prompt_of(state: Any, answer: str) -> str:
    """The text the gen continued: the state's text up to the answer's last occurrence (a role's end
    marker may follow it)."""
    text = state.text()
    at = text.rfind(answer)
    assert at >= 0, (text, answer)
    return text[:at]


@sgl.function
def qa(s, question):
    s += FEW_SHOT + "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=12, stop="\n", temperature=0)


def prog_stop() -> dict[str, Any]:
    st = qa.run(question="What is the capital of Spain?")
    return {"answer": st["answer"], "prompt": _prompt_of(st, st["answer"])}


def prog_regex() -> dict[str, Any]:
    @sgl.function
    def regex_gen(s):
        s += "Q: What is the IP address of the Google DNS servers?\n"
        s += "A: " + sgl.gen("answer", temperature=0, regex=IP_REGEX, max_tokens=24)

    st = regex_gen.run()
    return {"answer": st["answer"], "prompt": _prompt_of(st, st["answer"]), "regex": IP_REGEX}


def prog_json_schema() -> dict[str, Any]:
    @sgl.function
    def person(s):
        s += "A person, as JSON: " + sgl.gen("json", json_schema=json.dumps(PERSON_SCHEMA), max_tokens=48,
                                               temperature=0)

    st = person.run()
    return {"answer": st["json"], "prompt": _prompt_of(st, st["json"]), "schema": PERSON_SCHEMA}


def prog_select() -> dict[str, Any]:
    choices = ["True", "False", "Unknown"]

    @sgl.function
    def true_or_false(s, statement):
        s += "Determine whether the statement below is True, False, or Unknown.\n"
        s += "Statement: The capital of France is Paris.\nAnswer: True\n"
        s += "Statement: " + statement + "\nAnswer:" + sgl.select("answer", choices)

    st = true_or_false.run(statement="The capital of Canada is Tokyo.")
    meta = st.get_meta_info("answer")
    return {"answer": st["answer"], "choices": choices, "prompt": _prompt_of(st, st["answer"]),
            "normalized_prompt_logprobs": meta["normalized_prompt_logprobs"],
            "input_token_logprobs": meta["input_token_logprobs"]}


def prog_fork_gather() -> dict[str, Any]:
    @sgl.function
    def tips(s, topic):
        s += "Here are two tips for " + topic + ".\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"{i + 1}." + sgl.gen("tip", max_tokens=8, stop="\n", temperature=0)
        forks.join(mode="gather_variable")

    st = tips.run(topic="staying healthy")
    return {"tips": st["tip"], "head": "Here are two tips for staying healthy.\n", "text": st.text()}


def prog_fork_concate() -> dict[str, Any]:
    contexts = ["Ethan is the father of Liam.", "Noah is the father of Julian."]

    @sgl.function
    def parallel_encoding(s):
        s += "Read the statements.\n"
        forks = s.fork(len(contexts))
        forks += lambda i: f"Statement {i}: " + contexts[i] + "\n"
        forks.join(mode="concate_and_append")
        s += "Question: Who is the father of Julian?\nAnswer:" + sgl.gen("answer", max_tokens=6, stop="\n",
                                                                          temperature=0)

    st = parallel_encoding.run()
    return {"answer": st["answer"], "text": st.text(), "contexts": contexts,
            "prompt": _prompt_of(st, st["answer"])}


def prog_run_batch() -> dict[str, Any]:
    questions = ["What is the capital of Italy?", "What is the capital of Japan?", "What is the capital of Peru?"]
    states = qa.run_batch([{"question": q} for q in questions])
    return {"answers": [st["answer"] for st in states],
            "prompts": [_prompt_of(st, st["answer"]) for st in states]}


def prog_stream_meta() -> dict[str, Any]:
    """SGLang's own test_stream_logprobs (sglang/test/test_programs.py), shortened to 16 tokens.

    SGLang's text_async_iter has a race its own test shares: it wakes on an event and reads the variable's
    text and the *latest* meta_info, so two server events landing between two wakes come out as one chunk
    carrying only the second event's logprobs (seen once in CI on a loaded 2-core machine). The server's
    events themselves are checked one by one in test_sampling_params; here a run in which the client
    coalesced chunks is retried (up to 5 runs), and every other invariant must hold in every run."""

    @sgl.function
    def chat(s, question):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", return_logprob=True))

    async def collect() -> tuple[Any, list]:
        state = chat(question="Write one sentence about the sea.", stream=True, temperature=0, max_new_tokens=16)
        return state, [c async for c in state.text_async_iter("answer", return_meta_data=True)]

    runs, coalesced = 0, True
    while coalesced and runs < 5:
        runs += 1
        state, chunks = asyncio.run(collect())
        assert len(chunks) > 0
        prev_completion, prev_len, out, coalesced = 0, 0, [], False
        for chunk_text, meta in chunks:  # SGLang's assertions, verbatim in substance
            assert chunk_text
            assert "output_token_logprobs" in meta and "output_token_logprobs_length" in meta
            completion, length = meta["completion_tokens"], meta["output_token_logprobs_length"]
            assert completion == length
            assert completion - prev_completion == length - prev_len
            if len(meta["output_token_logprobs"]) != completion - prev_completion:
                # Only the client's race makes fewer logprobs than new tokens; the server never sends more.
                assert len(meta["output_token_logprobs"]) < completion - prev_completion
                coalesced = True
            prev_completion, prev_len = completion, length
            out.append({"text": chunk_text, "completion_tokens": completion, "output_token_logprobs_length": length,
                        "token_ids": [t[1] for t in meta["output_token_logprobs"]]})
    assert not coalesced, "the client coalesced chunks in all 5 runs"
    answer = "".join(c["text"] for c in out)
    return {"chunks": out, "answer": answer, "prompt": _prompt_of(state, answer), "runs": runs}


def prog_min_tokens() -> dict[str, Any]:
    @sgl.function
    def short(s):
        s += sgl.user("What is 2+2? Answer with one number.")
        s += sgl.assistant(sgl.gen("answer", min_tokens=12, max_tokens=16, temperature=0))

    st = short.run()
    meta = st.get_meta_info("answer")
    return {"answer": st["answer"], "prompt": _prompt_of(st, st["answer"]), "min_tokens": 12, "max_tokens": 16,
            "completion_tokens": meta["completion_tokens"], "finish_reason": meta["finish_reason"]}


def prog_stop_regex() -> dict[str, Any]:
    @sgl.function
    def count(s):
        s += "Count: 1, 2, 3," + sgl.gen("rest", stop_regex=r"\d", max_tokens=12, temperature=0)

    st = count.run()
    return {"answer": st["rest"], "prompt": _prompt_of(st, st["rest"]), "stop_regex": r"\d",
            "finish_reason": st.get_meta_info("rest")["finish_reason"]}


PROGRAMS: dict[str, Callable[[], dict[str, Any]]] = {
    "stop": prog_stop, "regex": prog_regex, "json_schema": prog_json_schema, "select": prog_select,
    "fork_gather_variable": prog_fork_gather, "fork_concate_and_append": prog_fork_concate,
    "run_batch": prog_run_batch, "stream_meta": prog_stream_meta, "min_tokens": prog_min_tokens,
    "stop_regex": prog_stop_regex,
}


def main(url: str) -> None:
    # SGLang picks a chat template from the model path; "smollm2-135m" matches none of its rules (it would
    # fall back to "default", USER:/ASSISTANT:), so name SmolLM2's markup, ChatML, explicitly.
    backend = sgl.RuntimeEndpoint(url, chat_template_name="chatml")
    sgl.set_default_backend(backend)
    report: dict[str, Any] = {"sglang_version": sgl.__version__, "sglang_file": sgl.__file__, "programs": {}}
    for name, program in PROGRAMS.items():
        try:
            report["programs"][name] = {"ok": True, **program()}
        except Exception as exc:  # one failing program must not hide the others' results
            report["programs"][name] = {"ok": False, "error": repr(exc), "traceback": traceback.format_exc()[-3000:]}
    report["server_info_keys"] = sorted(sgl.get_server_info())[:5]
    report["http_errors"] = HTTP_ERRORS
    print("REPORT: " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
