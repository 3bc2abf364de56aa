"""`RuntimeEndpoint`: the DSL backend for a jsgl (or SGLang-protocol) server reached over HTTP.

    backend = RuntimeEndpoint("http://127.0.0.1:30000", api_key=None)
    fn.run(..., backend=backend)

It speaks the native API: `gen` is POST /generate (streamed as SSE when the program streams), the prefix
hints are max_new_tokens=0 requests, and `select` scores every choice by its prompt logprobs in one
batched /generate after caching the common prefix, exactly as the in-process backend does (the server's
POST /tokenize gives the same token boundaries the in-process backend computes locally).

Role contents are plain text, as in process: against a jsgl server (its /get_model_info lists `plain_spans` in
`jsgl_extensions`) every prompt goes with its role contents' character ranges, which the server tokenizes with
special tokens' strings split, so a `<|im_end|>` in a user's string cannot close the turn. A server without the
extension (SGLang's) gets the raw text, as SGLang's own RuntimeEndpoint sends it.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx

from jsgl.engine.spanned_prompt import SpannedPrompt
from jsgl.errors import GenerationError
from jsgl.lang.backend import BaseBackend
from jsgl.lang.chat_template import ChatTemplate, get_chat_template_from_tokenizer
from jsgl.lang.choices import ChoicesDecision, ChoicesSamplingMethod, TokenLogprob, common_prefix_len, decide
from jsgl.lang.global_config import global_config
from jsgl.lang.ir import GenParams

if TYPE_CHECKING:
    from jsgl.lang.interpreter import StreamExecutor

_LOGPROB_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num")


class EndpointError(GenerationError):
    """The server refused a request or the generation failed on the server."""


class TemplateRenderer:
    """Just enough of a tokenizer for TokenizerChatTemplate: renders the server's Jinja chat template
    locally (as transformers does), so role markers need no round trip per role."""

    def __init__(self, chat_template: str, bos_token: str | None, eos_token: str | None, name: str) -> None:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def strftime_now(fmt: str) -> str:
            import datetime

            return datetime.datetime.now().strftime(fmt)

        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
        self.chat_template = chat_template
        self.name_or_path = name
        self._template = env.from_string(chat_template)
        self._special = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = False, **kwargs: Any) -> str:
        if tokenize:
            raise NotImplementedError("a remote template renders text only")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self._special, **kwargs)


class RuntimeEndpoint(BaseBackend):
    # join(mode="concate_and_append") concatenates text: jsgl's server keeps the joined state exact by
    # reusing the fork point's prefix from its radix cache (it splices no KV; see /concate_and_append_request).
    support_concate_and_append = False

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float | None = None,
                 chat_template: ChatTemplate | None = None) -> None:
        super().__init__()
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # One pooled client for every thread of a run_batch (httpx.Client is thread-safe).
        self.client = httpx.Client(base_url=self.base_url, headers=headers,
                                   timeout=httpx.Timeout(timeout, connect=10.0),
                                   limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        self.model_info = self._get("/get_model_info")
        self.model_name = self.model_info.get("model_path", "")
        # Only a server that takes `plain_spans` is sent it: SGLang's /generate rejects unknown fields.
        self.plain_spans = "plain_spans" in (self.model_info.get("jsgl_extensions") or ())
        if chat_template is not None:
            self.chat_template = chat_template
        elif self.model_info.get("chat_template"):
            renderer = TemplateRenderer(self.model_info["chat_template"], self.model_info.get("bos_token"),
                                        self.model_info.get("eos_token"), self.model_name)
            self.chat_template = get_chat_template_from_tokenizer(renderer)

    # HTTP ----------------------------------------------------------------------------------------------
    def _check(self, resp: httpx.Response) -> Any:
        if resp.status_code != 200:
            try:
                message = resp.json()["error"]["message"]
            except Exception:
                message = resp.text[:500]
            raise EndpointError(f"{resp.request.method} {resp.request.url.path} -> HTTP {resp.status_code}: {message}")
        return resp.json()

    def _get(self, path: str) -> Any:
        return self._check(self.client.get(path))

    def _post(self, path: str, data: dict[str, Any]) -> Any:
        return self._check(self.client.post(path, json=data))

    def _generate(self, data: dict[str, Any]) -> Any:
        out = self._post("/generate", data)
        for body in out if isinstance(out, list) else [out]:
            _raise_if_failed(body)
        return out

    # Requests ------------------------------------------------------------------------------------------
    def get_model_name(self) -> str:
        return self.model_name

    def _prompt(self, prompt: str | SpannedPrompt) -> dict[str, Any]:
        """`text`, with its role contents' `plain_spans` when it has some and the server takes them."""
        if isinstance(prompt, SpannedPrompt) and prompt.plain and self.plain_spans:
            return {"text": prompt.text, "plain_spans": [list(span) for span in prompt.plain]}
        return {"text": prompt.text if isinstance(prompt, SpannedPrompt) else prompt}

    def _tokenize(self, prompts: list[SpannedPrompt]) -> list[list[int]]:
        """Token ids of each prompt, exactly as /generate would tokenize it (role contents as plain text)."""
        body: dict[str, Any] = {"prompt": [p.text for p in prompts]}
        if self.plain_spans and any(p.plain for p in prompts):
            body["plain_spans"] = [[list(span) for span in p.plain] for p in prompts]
        return self._post("/tokenize", body)["tokens"]

    def _payload(self, s: StreamExecutor, params: GenParams, stream: bool = False) -> dict[str, Any]:
        kwargs = params.to_engine_kwargs()
        top = {k: kwargs.pop(k) for k in _LOGPROB_FIELDS if k in kwargs}
        sampling = {k: v for k, v in kwargs.items() if v is not None}
        return {**self._prompt(s.prompt_()), "sampling_params": sampling, **top, "stream": stream,
                "return_text_in_logprobs": bool(params.return_text_in_logprobs)}

    def generate(self, s: StreamExecutor, sampling_params: GenParams) -> tuple[Any, Any]:
        """(text, meta); with n > 1 the server answers a list: (list of n texts, list of n metas)."""
        body = self._generate(self._payload(s, sampling_params))
        if isinstance(body, list):
            return [b["text"] for b in body], [_meta(b) for b in body]
        return body["text"], _meta(body)

    def generate_stream(self, s: StreamExecutor, sampling_params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        """(text delta, meta) per SSE event; the server's per-event meta holds that chunk's logprobs and
        the running counts, which is what the interpreter's stream readers pair with each piece."""
        if (sampling_params.n or 1) > 1:
            raise ValueError("n > 1 cannot be streamed; the interpreter generates it without streaming")
        text = ""
        with self.client.stream("POST", "/generate", json=self._payload(s, sampling_params, stream=True)) as resp:
            if resp.status_code != 200:
                resp.read()
                self._check(resp)
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    return
                event = json.loads(payload)
                if "error" in event:
                    raise EndpointError(event["error"].get("message", str(event["error"])))
                _raise_if_failed(event)
                delta, text = event["text"][len(text):], event["text"]  # the server streams cumulative text
                # Every event: its meta carries that chunk's tokens (logprobs), even with no new text.
                yield delta, _meta(event)

    # Hints ---------------------------------------------------------------------------------------------
    def cache_prefix(self, prefix_str: str | SpannedPrompt) -> None:
        prompt = self._prompt(prefix_str)
        if prompt["text"]:  # cached as the requests after it tokenize it (role contents plain), or it misses
            self._generate({**prompt, "sampling_params": {"max_new_tokens": 0}})

    def commit_lazy_operations(self, s: StreamExecutor) -> None:
        self.cache_prefix(s.prompt_())

    # Select --------------------------------------------------------------------------------------------
    def select(self, s: StreamExecutor, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        """Mirrors the in-process backend: score each choice from the first token where `prompt + choice`
        tokenizes differently from the prompt alone; cache the prompt first; one batch for all choices."""
        tokens = self._tokenize([s.prompt_()] + [s.prompt_(c) for c in choices])
        prefix_ids, full_ids = tokens[0], tokens[1:]
        starts = [common_prefix_len(prefix_ids, f) for f in full_ids]
        if global_config.enable_prefix_hint and prefix_ids:
            self._generate({"input_ids": prefix_ids, "sampling_params": {"max_new_tokens": 0}})
        want_uncond = getattr(choices_method, "requires_unconditional_logprobs", False)
        jobs = []  # (kind, choice index, ids, logprob_start_len)
        for i, (ids, start) in enumerate(zip(full_ids, starts, strict=True)):
            if start >= len(ids):
                continue  # an empty choice has no tokens to score
            jobs.append(("cond", i, ids, start))
            if want_uncond:
                jobs.append(("uncond", i, ids[start:], 0))
        cond: list[list[TokenLogprob]] = [[] for _ in choices]
        uncond: list[list[TokenLogprob]] = [[] for _ in choices]
        if jobs:
            bodies = self._generate({
                "input_ids": [j[2] for j in jobs], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                "logprob_start_len": [j[3] for j in jobs], "return_text_in_logprobs": True})
            for (kind, i, _, _), body in zip(jobs, bodies, strict=True):
                toks = [tuple(t) for t in body["meta_info"]["input_token_logprobs"]]
                (cond if kind == "cond" else uncond)[i] = toks
        return decide(choices, cond, uncond if want_uncond else None, temperature, choices_method)

    # Lifecycle -----------------------------------------------------------------------------------------
    def flush_cache(self) -> None:
        try:
            self._post("/flush_cache", {})
        except EndpointError as exc:  # refused while requests run: like the engine's, a no-op then
            warnings.warn(str(exc), stacklevel=2)

    def get_server_info(self) -> dict[str, Any]:
        return self._get("/get_server_info")

    def close(self) -> None:
        self.client.close()

    def shutdown(self) -> None:
        self.close()


def _raise_if_failed(body: dict[str, Any]) -> None:
    reason = body.get("meta_info", {}).get("finish_reason") or {}
    if reason.get("type") == "abort" and reason.get("reason", "client") != "client":
        rid = body["meta_info"].get("id")
        raise EndpointError(f"request {rid} failed on the server: {reason.get('message')}", rid, reason.get("reason"))


def _meta(body: dict[str, Any]) -> dict[str, Any]:
    """The server's meta_info, with logprob triples as tuples (as the in-process backend gives them)."""
    meta = dict(body.get("meta_info", {}))
    for key in ("input_token_logprobs", "output_token_logprobs"):
        if key in meta:
            meta[key] = [tuple(t) for t in meta[key]]
    for key in ("input_top_logprobs", "output_top_logprobs"):
        if key in meta:
            meta[key] = [None if row is None else [tuple(t) for t in row] for row in meta[key]]
    return meta
