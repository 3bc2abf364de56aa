"""`OpenAI`: the DSL backend for OpenAI-compatible APIs (OpenAI itself, jsgl's /v1, vLLM, ...), with
API speculative execution (paper §5).

    backend = OpenAI("gpt-3.5-turbo-instruct")                                  # completion model
    backend = OpenAI("smollm2-135m", base_url="http://127.0.0.1:30000/v1", is_chat_model=False)

API speculative execution. An API call is priced per call and per input token, and a template with
several `gen`s normally pays one call, re-sending the whole prompt, per `gen`. With
`@function(num_api_spec_tokens=N)` the first `gen` ignores its stop and asks for N tokens; the extra text
is kept, and each later `gen` of the same state is served from it without a call as long as the text the
program appended in between (the template's constant parts) matches what the model speculated, and the
`gen`'s own stop (or token limit) falls inside the speculated text. On any mismatch the backend simply
makes a fresh speculative call from the current text, so results are those of a non-speculative run
whenever the model follows the template. Chat models cannot continue a partial message, so there the
speculation is per assistant turn: the turn's first `gen` makes the call, later `gen`s of the turn are
served from it.

Token boundaries (for `max_tokens` of a served `gen`) come from the call's logprobs, so speculative calls
ask for `logprobs=0` (chat: `logprobs=true`). `usage` counts calls, tokens and speculation hits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

from jsgl.engine.sampling_params import SamplingParams
from jsgl.lang.backend import BaseBackend
from jsgl.lang.chat_template import ChatTemplate
from jsgl.lang.choices import ChoicesDecision, ChoicesSamplingMethod, TokenLogprob, mean_logprob
from jsgl.lang.ir import GenParams

if TYPE_CHECKING:
    from jsgl.lang.interpreter import StreamExecutor

_SIGNATURE_KEYS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                   "repetition_penalty", "logit_bias", "sampling_seed", "ignore_eos", "stop_token_ids",
                   "min_new_tokens", "stop_regex")
# Sampling parameters OpenAI's API itself has, under the same name.
_OPENAI_FIELDS = ("temperature", "top_p", "frequency_penalty", "presence_penalty")
# Handled apart: OpenAI fields under other names (max_tokens, n, seed, logit_bias, stop), the logprob fields
# (the backend asks for what it needs), and SamplingParams fields no /v1 server takes.
_NOT_EXTENSIONS = {"max_new_tokens", "stop", "n", "sampling_seed", "logit_bias", *_OPENAI_FIELDS,
                   "return_logprob", "logprob_start_len", "top_logprobs_num", "stream_interval"}
# Every other SamplingParams field is an SGLang extension of /v1 (extra_body), with its default.
_EXTENSION_DEFAULTS = {f.name: (f.default if f.default is not dataclasses.MISSING else None)
                       for f in dataclasses.fields(SamplingParams) if f.name not in _NOT_EXTENSIONS}
_EXTENSION_NAMES = {"min_new_tokens": "min_tokens"}  # SGLang's /v1 spelling


@dataclasses.dataclass
class APIUsage:
    """What a backend spent. `spec_hits`: gens served from speculated text without a call."""

    api_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec_hits: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Speculation:
    anchor: str  # completion: s.text_ when the call was made; chat: the turn's key
    text: str  # everything the model produced, stops ignored
    ends: list[int] | None  # end offset in `text` of each token (None: the API gave no token boundaries)
    finished: bool  # the model ended by itself (EOS), not by the token limit
    signature: tuple  # the sampling parameters it was made with (stops and lengths aside)
    meta: dict[str, Any]


def _token_ends(pieces: list[str], text: str) -> list[int] | None:
    ends, pos = [], 0
    for piece in pieces:
        pos += len(piece)
        ends.append(pos)
    return ends if pos == len(text) else None  # a piece that is part of a character would misplace them


def _take(spec: _Speculation, pos: int, stop: list[str], max_tokens: int) -> str | None:
    """The value a gen starting at `pos` of the speculation would get, or None if the speculation ends
    before that gen would. Mirrors the engine: generation ends at the first stop string to be completed
    (the value excludes it) or after `max_tokens` tokens, whichever comes first."""
    rest = spec.text[pos:]
    limit, by_length = len(rest), False
    if spec.ends is not None:
        after = [e - pos for e in spec.ends if e > pos]
        if len(after) >= max_tokens:
            limit, by_length = (after[max_tokens - 1] if max_tokens else 0), True
    best: tuple[int, int] | None = None  # (end, start) of the first stop to complete
    for s in stop:
        at = rest.find(s) if s else -1
        if at >= 0 and at + len(s) <= limit and (best is None or (at + len(s), at) < best):
            best = (at + len(s), at)
    if best is not None:
        return rest[:best[1]]
    if by_length:
        return rest[:limit]
    return rest if spec.finished else None


class OpenAI(BaseBackend):
    def __init__(self, model_name: str, base_url: str | None = None, api_key: str | None = None,
                 is_chat_model: bool | None = None, chat_template: ChatTemplate | None = None,
                 num_api_spec_tokens: int | None = None, continue_final_message: bool = False,
                 **client_kwargs: Any) -> None:
        """`is_chat_model=None` guesses from the name (`*-instruct`, davinci/babbage: completion).
        `num_api_spec_tokens` is used for programs that do not set their own. `continue_final_message`:
        the server can continue a partial assistant message (jsgl's /v1 can), which lets a chat-model
        `gen` follow text inside an assistant turn."""
        super().__init__()
        import openai

        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY",
                                    **client_kwargs)
        self.model_name = model_name
        if is_chat_model is None:
            name = model_name.lower()
            is_chat_model = not ("instruct" in name or name.startswith(("davinci", "babbage")))
        self.is_chat_model = is_chat_model
        if chat_template is not None:
            self.chat_template = chat_template
        self.num_api_spec_tokens = num_api_spec_tokens
        self.continue_final_message = continue_final_message
        self.usage = APIUsage()
        self._lock = threading.Lock()
        self._spec: weakref.WeakKeyDictionary[Any, _Speculation] = weakref.WeakKeyDictionary()

    def get_model_name(self) -> str:
        return self.model_name

    def reset_usage(self) -> None:
        with self._lock:
            self.usage = APIUsage()

    # Calls ---------------------------------------------------------------------------------------------
    def _count(self, resp: Any) -> None:
        with self._lock:
            self.usage.api_calls += 1
            if resp.usage is not None:
                self.usage.prompt_tokens += resp.usage.prompt_tokens or 0
                self.usage.completion_tokens += resp.usage.completion_tokens or 0

    @staticmethod
    def _api_kwargs(kw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """OpenAI keyword arguments and `extra_body`: every other sampling parameter, under the name
        SGLang's (and jsgl's) /v1 gives it (min_new_tokens -> min_tokens), sent only when set away from
        its default, so the real OpenAI API never sees them."""
        args: dict[str, Any] = {"max_tokens": kw["max_new_tokens"]}
        if kw.get("stop"):
            args["stop"] = kw["stop"]
        for name in _OPENAI_FIELDS:
            if name in kw:
                args[name] = kw[name]
        if kw.get("n", 1) != 1:
            args["n"] = kw["n"]
        if kw.get("sampling_seed") is not None:
            args["seed"] = kw["sampling_seed"]
        if kw.get("logit_bias"):
            args["logit_bias"] = kw["logit_bias"]
        extra: dict[str, Any] = {}
        for name, default in _EXTENSION_DEFAULTS.items():
            if name in kw and kw[name] != default and not (default is None and not kw[name]):
                extra[_EXTENSION_NAMES.get(name, name)] = kw[name]
        return args, extra

    def _call(self, prompt: str | list[dict[str, Any]], kw: dict[str, Any], with_tokens: bool = False,
              continue_final: bool = False) -> tuple[str, list[str] | None, str | None, dict[str, Any]]:
        """One API call: (text, token pieces or None, finish_reason, meta)."""
        args, extra = self._api_kwargs(kw)
        if continue_final:
            extra["continue_final_message"] = True
        if self.is_chat_model:
            if with_tokens:
                args["logprobs"] = True
            if "json_schema" in extra:  # chat APIs take a schema as a standard response_format
                schema = extra.pop("json_schema")
                schema = json.loads(schema) if isinstance(schema, str) else schema
                args["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
            resp = self.client.chat.completions.create(model=self.model_name, messages=prompt, extra_body=extra or None,
                                                       **args)
            choice = resp.choices[0]
            text = choice.message.content or ""
            content = choice.logprobs.content if choice.logprobs is not None else None
            pieces = [c.token for c in content] if content else None
        else:
            if with_tokens:
                args["logprobs"] = 0
            resp = self.client.completions.create(model=self.model_name, prompt=prompt, extra_body=extra or None,
                                                  **args)
            choice = resp.choices[0]
            text = choice.text
            pieces = list(choice.logprobs.tokens) if choice.logprobs is not None and choice.logprobs.tokens else None
        self._count(resp)
        meta = {"id": resp.id, "finish_reason": choice.finish_reason,
                "prompt_tokens": resp.usage.prompt_tokens if resp.usage else None,
                "completion_tokens": resp.usage.completion_tokens if resp.usage else None}
        return text, pieces, choice.finish_reason, meta

    def _call_n(self, prompt: str | list[dict[str, Any]], kw: dict[str, Any],
                continue_final: bool = False) -> tuple[list[str], list[dict[str, Any]]]:
        """One call for n > 1 samples: their texts and metas, in choice order."""
        args, extra = self._api_kwargs(kw)
        if continue_final:
            extra["continue_final_message"] = True
        if self.is_chat_model:
            if "json_schema" in extra:
                schema = extra.pop("json_schema")
                schema = json.loads(schema) if isinstance(schema, str) else schema
                args["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
            resp = self.client.chat.completions.create(model=self.model_name, messages=prompt, extra_body=extra or None,
                                                       **args)
            texts = {c.index: c.message.content or "" for c in resp.choices}
        else:
            resp = self.client.completions.create(model=self.model_name, prompt=prompt, extra_body=extra or None,
                                                  **args)
            texts = {c.index: c.text for c in resp.choices}
        self._count(resp)
        reasons = {c.index: c.finish_reason for c in resp.choices}
        order = sorted(texts)
        return [texts[i] for i in order], [{"id": resp.id, "index": i, "finish_reason": reasons[i]} for i in order]

    # Generation ----------------------------------------------------------------------------------------
    def _spec_tokens(self, s: StreamExecutor) -> int | None:
        n = getattr(s, "num_api_spec_tokens", None)
        return n if n is not None else self.num_api_spec_tokens

    def generate(self, s: StreamExecutor, sampling_params: GenParams) -> tuple[Any, Any]:
        kw = sampling_params.to_engine_kwargs()
        num_spec = self._spec_tokens(s)
        # Constrained gens are not speculated: their grammar, not the template, decides where they end.
        constrained = kw.get("regex") is not None or kw.get("json_schema") is not None
        if self.is_chat_model:
            messages, anchor, done = self._chat_turn(s)
            prompt: Any = messages
        else:
            prompt, anchor, done = s.text_, s.text_, ""
        n = kw.get("n", 1)
        if num_spec and not constrained and n == 1:  # n samples cannot share one speculation
            served = self._serve(s, anchor, done, kw)
            if served is not None:
                return served
            with self._lock:
                current = self._spec.get(s)
            # Speculate from the current text (completion) or the start of the turn (chat), unless this chat
            # turn has been speculated already: the same request would bring the same reply back.
            if not (self.is_chat_model and current is not None and current.anchor == anchor
                    and current.signature == _signature(kw)):
                spec = self._speculate(s, prompt, anchor, kw, num_spec)
                # A chat reply is usable if it begins with what the template put into the turn so far.
                if spec.text.startswith(done):
                    value = _take(spec, len(done), kw.get("stop") or [], kw["max_new_tokens"])
                    return (spec.text[len(done):] if value is None else value), {**spec.meta, "speculative": False}
        if done:  # chat, in the middle of an assistant turn
            if not self.continue_final_message:
                raise RuntimeError(
                    "a chat model cannot continue a partial assistant message: put gen() right after "
                    "assistant(), use @function(num_api_spec_tokens=...) so the turn comes from one call, or "
                    "continue_final_message=True with a server that supports it (jsgl's /v1)")
            prompt = messages + [{"role": "assistant", "content": done}]
        if n > 1:  # the variable becomes the list of samples (the interpreter continues with the first)
            return self._call_n(prompt, kw, continue_final=bool(done))
        text, _, _, meta = self._call(prompt, kw, continue_final=bool(done))
        return text, meta

    def _chat_turn(self, s: StreamExecutor) -> tuple[list[dict[str, Any]], str, str]:
        """(the finished messages, a key of the open assistant turn, the turn's text so far)."""
        if getattr(s, "cur_role", None) != "assistant":
            raise RuntimeError("with a chat model, gen() must be inside an assistant turn: "
                               "s += sgl.assistant(sgl.gen(...))")
        return list(s.messages_), f"{len(s.messages_)}:{s.cur_role_begin_pos}", s.text_[s.cur_role_begin_pos:]

    def _serve(self, s: StreamExecutor, anchor: str, done: str, kw: dict[str, Any]) -> tuple[str, dict] | None:
        """The gen's value from this state's speculation, if the template has followed it so far."""
        with self._lock:
            spec = self._spec.get(s)
        if spec is None or spec.signature != _signature(kw):
            return None
        if self.is_chat_model:
            if spec.anchor != anchor:
                return None
            appended = done
        else:
            if not s.text_.startswith(spec.anchor):
                return None
            appended = s.text_[len(spec.anchor):]
        if not spec.text.startswith(appended):
            return None  # the template's text diverged from what the model speculated
        value = _take(spec, len(appended), kw.get("stop") or [], kw["max_new_tokens"])
        if value is None:
            return None
        with self._lock:
            self.usage.spec_hits += 1
        return value, {**spec.meta, "speculative": True}

    def _speculate(self, s: StreamExecutor, prompt: Any, anchor: str, kw: dict[str, Any],
                   num_spec: int) -> _Speculation:
        """One call that ignores the gen's stop and runs for num_spec tokens (or the gen's own limit)."""
        call_kw = {**kw, "stop": None, "max_new_tokens": max(num_spec, kw["max_new_tokens"])}
        text, pieces, finish, meta = self._call(prompt, call_kw, with_tokens=True)
        spec = _Speculation(anchor=anchor, text=text, ends=None if pieces is None else _token_ends(pieces, text),
                            finished=finish == "stop", signature=_signature(kw), meta=meta)
        with self._lock:
            self._spec[s] = spec
        return spec

    # Select --------------------------------------------------------------------------------------------
    def select(self, s: StreamExecutor, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        """Completion models: score each choice by the logprobs of its tokens, from one echo call over all
        `prompt + choice` (the tokens overlapping the choice are the choice's, as in the local backends)."""
        if self.is_chat_model:
            raise NotImplementedError("select needs prompt logprobs, which chat APIs do not return; "
                                      "use a completion model, or gen() and parse the answer")
        cond = self._echo_logprobs([s.text_ + c for c in choices], len(s.text_))
        uncond = None
        if getattr(choices_method, "requires_unconditional_logprobs", False):
            uncond = self._echo_logprobs(list(choices), 0)
        kwargs = {"choices": list(choices), "normalized_prompt_logprobs": [mean_logprob(t) for t in cond],
                  "input_token_logprobs": cond, "output_token_logprobs": [[] for _ in choices],
                  "unconditional_token_logprobs": uncond}
        return choices_method(**kwargs)

    def _echo_logprobs(self, prompts: list[str], boundary: int) -> list[list[TokenLogprob]]:
        resp = self.client.completions.create(model=self.model_name, prompt=prompts, max_tokens=0, echo=True,
                                              logprobs=0, temperature=0)
        self._count(resp)
        out: list[list[TokenLogprob]] = [[] for _ in prompts]
        for choice in resp.choices:
            lp = choice.logprobs
            out[choice.index] = [(v, -1, t) for t, v, off in zip(lp.tokens, lp.token_logprobs, lp.text_offset)
                                 if off + len(t) > boundary]
        return out


def _signature(kw: dict[str, Any]) -> tuple:
    return tuple(str(kw.get(k)) for k in _SIGNATURE_KEYS)
