"""The rest of the backend names SGLang exports: Crusoe (an OpenAI-compatible API, so jsgl's OpenAI
backend serves it) and the names jsgl leaves out, which raise an error saying why when used.

Left out (see docs/sglang-compat.md, "The frontend language"): Anthropic, LiteLLM and VertexAI (clients of
other vendors' APIs, wrapping SDKs jsgl does not depend on) and ServerArgs (SGLang's server
configuration; jsgl's is `EngineConfig` plus `jsgl serve` flags). `image`/`video` are in api.py.
"""

from __future__ import annotations

import os
from typing import Any, NoReturn

from jsgl.lang.openai_backend import OpenAI

CRUSOE_BASE_URL = "https://managed-inference-api-proxy.crusoecloud.com/v1/"


class Crusoe(OpenAI):
    """Crusoe managed inference: an OpenAI-compatible API (SGLang's Crusoe backend is the same thin
    wrapper). The key comes from `api_key=` or CRUSOE_API_KEY."""

    def __init__(self, model_name: str, api_key: str | None = None, base_url: str | None = None,
                 **kwargs: Any) -> None:
        key = api_key or os.environ.get("CRUSOE_API_KEY")
        if not key:
            raise ValueError("Crusoe API key required: pass api_key= or set CRUSOE_API_KEY")
        super().__init__(model_name, base_url=base_url or CRUSOE_BASE_URL, api_key=key, **kwargs)


class LeftOutError(NotImplementedError):
    """An SGLang name jsgl does not implement."""


def _left_out(name: str, why: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise LeftOutError(f"jsgl.{name} is not implemented: {why}")

    doc = f"Not implemented in jsgl (SGLang's `{name}`): {why}. Creating one raises LeftOutError."
    return type(name, (), {"__init__": __init__, "__doc__": doc, "__module__": __name__})


_VENDOR = ("jsgl has no client for that vendor's SDK; for an OpenAI-compatible endpoint (a LiteLLM proxy, "
           "vLLM, jsgl's /v1) use jsgl.OpenAI(model, base_url=...)")
Anthropic = _left_out("Anthropic", "it is a client of Anthropic's messages API; " + _VENDOR)
LiteLLM = _left_out("LiteLLM", "it wraps the litellm SDK; " + _VENDOR)
VertexAI = _left_out("VertexAI", "it is a client of Google's Vertex AI SDK; " + _VENDOR)
ServerArgs = _left_out("ServerArgs", "SGLang's server configuration has no jsgl counterpart by that name; "
                                     "configure the engine with jsgl.EngineConfig / jsgl.Engine(**kwargs) "
                                     "and the server with `jsgl serve --help` flags")
