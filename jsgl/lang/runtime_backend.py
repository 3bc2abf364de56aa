"""The in-process backend: programs talk to a jsgl Engine in the same Python process.

Prompts are the state's `prompt_()`: the contents of its role blocks are plain text, so a special token's string
the program wrote there (`<|im_end|>` in a user's message) is ordinary text, not the template's marker.

`Runtime(model=...)` loads the engine; `Runtime.endpoint` is the backend (as in SGLang, either may be passed
as `backend=` or to `set_default_backend`).
"""

from __future__ import annotations

import atexit
from collections.abc import Iterator
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from jsgl.engine.sampling_params import SamplingParams, expand_parallel_samples
from jsgl.engine.spanned_prompt import SpannedPrompt, prompt_text, tokenize_prompt
from jsgl.errors import GenerationError
from jsgl.lang.backend import BaseBackend
from jsgl.lang.chat_template import get_chat_template_from_tokenizer
from jsgl.lang.choices import ChoicesDecision, ChoicesSamplingMethod, TokenLogprob, common_prefix_len, decide
from jsgl.lang.global_config import global_config
from jsgl.lang.ir import GenParams

if TYPE_CHECKING:
    from jsgl.lang.interpreter import StreamExecutor


class EngineBackend(BaseBackend):
    """A BaseBackend over an `jsgl.engine.engine.Engine` (anything with its submit/tokenizer API)."""

    def __init__(self, engine: Any, model_name: str = "") -> None:
        super().__init__()
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.chat_template = get_chat_template_from_tokenizer(self.tokenizer)

    def get_model_name(self) -> str:
        return self.model_name

    # Requests ------------------------------------------------------------------------------------------

    def encode(self, prompt: str | SpannedPrompt) -> list[int]:
        # Exactly how the engine tokenizes a text prompt, so id prompts and text prompts share cache entries.
        return tokenize_prompt(self.tokenizer, prompt)

    def _result(self, prompt: str | SpannedPrompt | list[int], params: dict[str, Any],
                s: StreamExecutor | None = None) -> Any:
        return self._wait(s, [self.engine.submit(prompt, params)])[0]

    def _wait(self, s: StreamExecutor | None, handles: list[Any]) -> list[Any]:
        """The requests' outputs, checked; if the program of ``s`` is interrupted meanwhile, they are aborted."""
        def abort() -> None:
            for handle in handles:
                handle.abort()

        with s.abortable(abort) if s is not None else nullcontext():
            return [self._check(handle.result()) for handle in handles]

    @staticmethod
    def _check(out: Any) -> Any:
        if out.error:
            reason = None if out.abort_reason is None else str(out.abort_reason)
            raise GenerationError(f"engine request {out.request_id} failed: {out.error}", out.request_id, reason)
        return out

    def _token_text(self, token_id: int, with_text: bool) -> str | None:
        return self.tokenizer.decode([token_id]) if with_text else None

    def _meta(self, out: Any, params: GenParams) -> dict[str, Any]:
        meta = dict(out.meta_info)
        if params.return_logprob:
            with_text = bool(params.return_text_in_logprobs)
            meta["output_token_logprobs"] = [
                (lp, t, self._token_text(t, with_text)) for lp, t in zip(out.output_logprobs or [], out.token_ids)
            ]
            if out.input_logprobs is not None:
                meta["input_token_logprobs"] = [
                    (lp, t, self._token_text(t, with_text))
                    for lp, t in zip(out.input_logprobs, out.input_token_ids or [])
                ]
            if out.output_top_logprobs is not None:
                meta["output_top_logprobs"] = out.output_top_logprobs
        return meta

    def generate(self, s: StreamExecutor, sampling_params: GenParams) -> tuple[Any, Any]:
        """(text, meta); with n > 1, (list of n texts, list of n metas)."""
        kwargs = sampling_params.to_engine_kwargs()
        if kwargs.get("n", 1) > 1:  # n requests, batched together (as Engine.generate expands them)
            prompts, params = expand_parallel_samples([s.prompt_()], [SamplingParams.from_any(kwargs)])
            outs = self._wait(s, self.engine.submit_batch(prompts, params, samples=[len(prompts)]))
            return [o.text for o in outs], [self._meta(o, sampling_params) for o in outs]
        out = self._result(s.prompt_(), kwargs, s)
        return out.text, self._meta(out, sampling_params)

    def generate_stream(self, s: StreamExecutor, sampling_params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        """(text delta, meta) per engine chunk. Each meta carries that chunk's tokens only, as a streamed
        /generate does: `output_token_logprobs` of the new tokens, the running `completion_tokens` and
        `output_token_logprobs_length`; the last adds the request's final meta (and prompt logprobs)."""
        kwargs = sampling_params.to_engine_kwargs()
        if kwargs.get("n", 1) > 1:
            raise ValueError("n > 1 cannot be streamed; the interpreter generates it without streaming")
        handle = self.engine.submit(s.prompt_(), kwargs)
        with_text = bool(sampling_params.return_text_in_logprobs)
        with s.abortable(handle.abort):
            yield from self._stream_chunks(handle, sampling_params, with_text)

    def _stream_chunks(self, handle: Any, sampling_params: GenParams,
                       with_text: bool) -> Iterator[tuple[str, dict[str, Any]]]:
        for chunk in handle.stream():
            if chunk.output is not None:
                meta = self._meta(self._check(chunk.output), sampling_params)
            else:
                meta = {"id": chunk.request_id, "finish_reason": None, "completion_tokens": len(chunk.token_ids)}
            if sampling_params.return_logprob:
                new_ids = chunk.token_ids[chunk.first_new_token:]
                meta["output_token_logprobs"] = [(lp, t, self._token_text(t, with_text))
                                                 for lp, t in zip(chunk.output_logprobs or [], new_ids)]
                meta["output_token_logprobs_length"] = len(chunk.token_ids)
                if chunk.output_top_logprobs is not None:
                    meta["output_top_logprobs"] = chunk.output_top_logprobs
            yield chunk.text_delta, meta

    # Hints ---------------------------------------------------------------------------------------------

    def cache_prefix(self, prefix_str: str | SpannedPrompt, s: StreamExecutor | None = None) -> None:
        if prompt_text(prefix_str):
            self._result(prefix_str, {"max_new_tokens": 0}, s)

    def commit_lazy_operations(self, s: StreamExecutor) -> None:
        self.cache_prefix(s.prompt_(), s)

    # Select --------------------------------------------------------------------------------------------

    def select(
        self,
        s: StreamExecutor,
        choices: list[str],
        temperature: float,
        choices_method: ChoicesSamplingMethod,
    ) -> ChoicesDecision:
        """Score every choice by the logprobs of its tokens after the prompt, all in one batch.

        Each choice is scored from the first token where `prompt + choice` tokenizes differently from the
        prompt alone, so a token that merges across the boundary is part of the choice's score. With the
        prefix hint on, the prompt is computed first, once; every choice request then reuses it from the
        prefix cache, and the choice requests are submitted together so the engine batches them.
        """
        prefix_ids = self.encode(s.prompt_())
        full_ids = [self.encode(s.prompt_(c)) for c in choices]
        starts = [common_prefix_len(prefix_ids, f) for f in full_ids]
        if global_config.enable_prefix_hint and prefix_ids:
            self._result(prefix_ids, {"max_new_tokens": 0}, s)
        want_uncond = getattr(choices_method, "requires_unconditional_logprobs", False)
        pending = []  # (kind, choice index, handle)
        for i, (ids, start) in enumerate(zip(full_ids, starts, strict=True)):
            if start >= len(ids):
                continue  # an empty choice has no tokens to score
            params = {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": start}
            pending.append(("cond", i, self.engine.submit(ids, params)))
            if want_uncond:
                pending.append(("uncond", i, self.engine.submit(ids[start:], {**params, "logprob_start_len": 0})))
        cond: list[list[TokenLogprob]] = [[] for _ in choices]
        uncond: list[list[TokenLogprob]] = [[] for _ in choices]
        cached = [0] * len(choices)  # prefix-cache hits of each choice request (shows the hint working)
        outs = self._wait(s, [handle for _, _, handle in pending])
        for (kind, i, _), out in zip(pending, outs, strict=True):
            toks = [(lp, t, self.tokenizer.decode([t])) for lp, t in zip(out.input_logprobs, out.input_token_ids)]
            (cond if kind == "cond" else uncond)[i] = toks
            if kind == "cond":
                cached[i] = out.cached_tokens
        decision = decide(choices, cond, uncond if want_uncond else None, temperature, choices_method)
        decision.meta_info = {**(decision.meta_info or {}), "prefix_tokens": len(prefix_ids),
                              "score_start": starts, "cached_tokens": cached}
        return decision

    # Lifecycle -----------------------------------------------------------------------------------------

    def flush_cache(self) -> None:
        flush = getattr(self.engine, "flush_cache", None)
        if flush is not None:
            flush()

    def get_server_info(self) -> dict[str, Any]:
        return {"model": self.model_name, **self.engine.stats()}

    def shutdown(self) -> None:
        self.engine.shutdown()


class Runtime:
    """Runs the jsgl engine in this process: `rt = jsgl.Runtime(model="smollm2-135m", **engine_kwargs)`,
    then `jsgl.set_default_backend(rt)` or `fn.run(..., backend=rt)`; `rt.shutdown()` when done.
    `engine=` wraps an Engine that is already running instead of loading a new one."""

    def __init__(self, model: str = "smollm2-135m", engine: Any = None, **engine_kwargs: Any) -> None:
        if engine is None:
            from jsgl.engine.engine import Engine

            engine = Engine(model=model, **engine_kwargs)
            self._owns_engine = True
        else:
            self._owns_engine = False
        self.engine = engine
        self.endpoint = EngineBackend(engine, model)
        self._closed = False
        atexit.register(self.shutdown)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompt: Any, sampling_params: Any = None) -> Any:
        """Plain generation without the language (the engine's blocking generate)."""
        return self.engine.generate(prompt, sampling_params)

    def cache_prefix(self, prefix: str) -> None:
        self.endpoint.cache_prefix(prefix)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            # The atexit entry holds this runtime, hence its engine's weights and KV pool: a process that makes
            # runtimes one after another (an ablation grid: 12 engines) kept every one of them (17 GB).
            atexit.unregister(self.shutdown)
            if self._owns_engine:
                self.engine.shutdown()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
