"""transformers as a baseline: the paper's LMQL setup (a program interpreter over HF transformers).

`TransformersBackend` runs each `gen` and `select` as its own forward passes in this process: one call at a
time (a lock; on a CPU two concurrent calls only split the cores), the prompt recomputed every call (no KV
reuse across calls or programs: that is what the prefix cache adds), greedy or temperature sampling, stop
strings cut as jsgl does (the value ends before the first stop). Regex and JSON-schema `gen`s are masked token
by token with jsgl's own token index (an Outlines-style FSM without jump-forward, as LMQL's masking is),
so the constraint is the same one jsgl enforces.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from jsgl.experiments.baselines import System, Target, register

from jsgl.lang.backend import BaseBackend
from jsgl.lang.choices import ChoicesDecision, ChoicesSamplingMethod, TokenLogprob, common_prefix_len, decide
from jsgl.lang.ir import GenParams
from jsgl.model.tokenizer import stop_token_ids

if TYPE_CHECKING:
    from jsgl.lang.interpreter import StreamExecutor


# Sampling parameters this baseline does not implement, with the value that means "not used".
UNSUPPORTED = {"n": 1, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
               "repetition_penalty": 1.0, "logit_bias": None, "stop_token_ids": None, "stop_regex": None,
               "min_new_tokens": 0, "ebnf": None, "structural_tag": None}


def _first_stop(text: str, stops: list[str]) -> int | None:
    """Where the value ends: the start of the stop string completed first, or None."""
    best = None
    for stop in stops:
        at = text.find(stop) if stop else -1
        if at >= 0 and (best is None or (at + len(stop), at) < best):
            best = (at + len(stop), at)
    return None if best is None else best[1]


class TransformersBackend(BaseBackend):
    def __init__(self, model: str = "smollm2-135m", hf_model: Any = None) -> None:
        """`hf_model`: an already loaded transformers model of `model` (tests share one)."""
        super().__init__()
        import torch
        from transformers import AutoModelForCausalLM

        from jsgl.lang.chat_template import get_chat_template_from_tokenizer
        from jsgl.model.registry import resolve_model_path
        from jsgl.model.tokenizer import load_tokenizer

        path = resolve_model_path(model)
        self.torch = torch
        self.model_name = str(model)
        self.tokenizer = load_tokenizer(model)
        self.chat_template = get_chat_template_from_tokenizer(self.tokenizer)
        kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
        self.model = hf_model if hf_model is not None else AutoModelForCausalLM.from_pretrained(
            path.parent if kwargs else path, dtype=torch.float32, **kwargs).eval()
        # The KV cache argument and output: `cache` from transformers 5.2x, `past_key_values` before.
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        generation_eos = getattr(self.model.generation_config, "eos_token_id", None)
        self.eos_ids = stop_token_ids(self.tokenizer, [generation_eos] if isinstance(generation_eos, int)
                                      else generation_eos)  # the tokens jsgl's engine stops on
        self.vocab_size = self.model.config.vocab_size
        self._lock = threading.Lock()
        self.calls = 0

    def get_model_name(self) -> str:
        return self.model_name

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def _constraint(self, kw: dict[str, Any]) -> Any:
        from jsgl.fsm.cache import get_index
        from jsgl.fsm.constraint import RegexConstraint
        from jsgl.fsm.json_schema import json_schema_to_regex

        regex = kw.get("regex")
        if kw.get("json_schema") is not None:
            schema = kw["json_schema"]
            regex = json_schema_to_regex(json.loads(schema) if isinstance(schema, str) else schema)
        if regex is None:
            return None
        return RegexConstraint(get_index(regex, self.tokenizer, self.vocab_size))

    def generate(self, s: StreamExecutor, sampling_params: GenParams) -> tuple[str, dict[str, Any]]:
        kw = sampling_params.to_engine_kwargs()
        unsupported = sorted(k for k, unused in UNSUPPORTED.items()
                             if kw.get(k) is not None and kw[k] != unused and not (unused is None and not kw[k]))
        if unsupported:  # refused rather than silently dropped: the run would not be the program asked for
            raise NotImplementedError(f"the transformers baseline does not implement {unsupported}")
        torch = self.torch
        stops = [kw["stop"]] if isinstance(kw.get("stop"), str) else list(kw.get("stop") or [])
        temperature = kw.get("temperature", 1.0)
        constraint = self._constraint(kw)
        prompt = self._encode(s.text_)
        generator = torch.Generator().manual_seed(kw["sampling_seed"]) if kw.get("sampling_seed") is not None else None
        out: list[int] = []
        finish = "length"
        with self._lock, torch.no_grad():
            self.calls += 1
            past, step_input = None, prompt
            for _ in range(kw["max_new_tokens"]):
                res = self.model(input_ids=torch.tensor([step_input]), **{self._cache_arg: past}, use_cache=True,
                                 logits_to_keep=1)  # the LM head for the last position only
                past, logits = getattr(res, self._cache_arg), res.logits[0, -1].float()
                if constraint is not None:
                    bits = np.unpackbits(constraint.allowed_token_bitmask().view(np.uint8), bitorder="little")
                    allowed = torch.from_numpy(bits[: logits.shape[0]].astype(bool))
                    logits = logits.masked_fill(~allowed, -float("inf"))
                if kw.get("ignore_eos"):
                    logits[list(self.eos_ids)] = -float("inf")
                if temperature <= 1e-5:
                    token = int(logits.argmax())
                else:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    top_p = kw.get("top_p", 1.0)
                    if top_p < 1.0:  # nucleus: the smallest set of tokens whose mass reaches top_p
                        sorted_probs, order = probs.sort(descending=True)
                        outside = sorted_probs.cumsum(0) - sorted_probs >= top_p
                        probs = probs.scatter(0, order, sorted_probs.masked_fill(outside, 0.0))
                    token = int(torch.multinomial(probs, 1, generator=generator))
                if token in self.eos_ids:
                    finish = "stop"
                    break
                out.append(token)
                if constraint is not None:
                    constraint.advance(token)
                text = self.tokenizer.decode(out, skip_special_tokens=True)
                if _first_stop(text, stops) is not None:
                    finish = "stop"
                    break
                if constraint is not None and constraint.is_terminated():
                    finish = "stop"
                    break
                step_input = [token]
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        cut = _first_stop(text, stops)
        value = text if cut is None else text[:cut]
        return value, {"prompt_tokens": len(prompt), "completion_tokens": len(out), "finish_reason": finish}

    def select(self, s: StreamExecutor, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        """Each `prompt + choice` in its own forward pass, scored from where it tokenizes differently from
        the prompt alone (as jsgl's Runtime scores them)."""
        prefix = self._encode(s.text_)
        cond = [self._score(self._encode(s.text_ + c), common_prefix_len(prefix, self._encode(s.text_ + c)))
                for c in choices]
        uncond = None
        if getattr(choices_method, "requires_unconditional_logprobs", False):
            uncond = [self._score(self._encode(c), 0) for c in choices]
        return decide(choices, cond, uncond, temperature, choices_method)

    def _score(self, ids: list[int], start: int) -> list[TokenLogprob]:
        torch = self.torch
        if start >= len(ids):
            return []
        first = max(start, 1)  # the first token of a sequence has no logprob
        keep = len(ids) - first + 1  # logits of positions first-1 .. end: row j predicts token first + j
        with self._lock, torch.no_grad():
            self.calls += 1
            logits = self.model(input_ids=torch.tensor([ids]), logits_to_keep=keep).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        return [(float(logprobs[i - first, ids[i]]), ids[i], self.tokenizer.decode([ids[i]]))
                for i in range(first, len(ids))]


@register("transformers")
class Transformers(System):
    name, title = "transformers", "transformers (LMQL's setup)"

    def unavailable(self) -> str | None:
        import importlib.util

        missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
        return f"{' and '.join(missing)} not installed: pip install 'jsgl[bench]'" if missing else None

    def version(self) -> str:
        import torch
        import transformers

        return f"{transformers.__version__}, torch {torch.__version__}"  # after the system's name

    @contextlib.contextmanager
    def start(self, model: str) -> Iterator[Target]:
        yield Target(backend=TransformersBackend(model), flush=lambda: None)
