"""The jsgl frontend language: SGLang's embedded DSL (`import jsgl as sgl`), interpreter and compiler.

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(sgl.Runtime(model="smollm2-135m"))
    print(qa.run(question="What is 1+1?")["answer"])

Multimodal inputs (`image`, `video`) raise NotImplementedError: jsgl serves text-only models. Of the
backend names SGLang exports, `Anthropic`, `LiteLLM`, `VertexAI` and `ServerArgs` exist but raise
`LeftOutError` saying why (docs/sglang-compat.md, "The frontend language").
"""

from jsgl.lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    image,
    select,
    separate_reasoning,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from jsgl.lang.backend import BaseBackend
from jsgl.lang.chat_template import ChatTemplate, TokenizerChatTemplate, get_chat_template_from_tokenizer
from jsgl.lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from jsgl.lang.compiler import CompiledFunction
from jsgl.lang.function import SglFunction, function, get_default_backend
from jsgl.lang.global_config import global_config
from jsgl.lang.interpreter import ProgramError, ProgramInterrupted, StreamExecutor
from jsgl.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR
from jsgl.lang.reasoning import ReasoningParser
from jsgl.lang.runtime_backend import EngineBackend, Runtime
from jsgl.lang.state import ForkedStates, ProgramState, ProgramStateGroup
from jsgl.lang.tracer import TracerProgramState

__all__ = [
    "REGEX_BOOL",
    "REGEX_FLOAT",
    "REGEX_INT",
    "REGEX_STR",
    "BaseBackend",
    "ChatTemplate",
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "CompiledFunction",
    "EngineBackend",
    "ForkedStates",
    "ProgramError",
    "ProgramInterrupted",
    "ProgramState",
    "ProgramStateGroup",
    "ReasoningParser",
    "Runtime",
    "SglFunction",
    "StreamExecutor",
    "TokenizerChatTemplate",
    "TracerProgramState",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_chat_template_from_tokenizer",
    "get_default_backend",
    "get_server_info",
    "global_config",
    "greedy_token_selection",
    "image",
    "select",
    "separate_reasoning",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
    "video",
]

# HTTP backends: a jsgl/SGLang server (/generate) and OpenAI-compatible APIs (with API speculative execution).
from jsgl.lang.endpoint_backend import RuntimeEndpoint  # noqa: E402
from jsgl.lang.openai_backend import OpenAI  # noqa: E402
from jsgl.lang.other_backends import Anthropic, Crusoe, LeftOutError, LiteLLM, ServerArgs, VertexAI  # noqa: E402

__all__ += ["Anthropic", "Crusoe", "LeftOutError", "LiteLLM", "OpenAI", "RuntimeEndpoint", "ServerArgs",
            "VertexAI"]
