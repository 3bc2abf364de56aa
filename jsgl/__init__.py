"""jsgl: SGLang (structured LM programs, RadixAttention, compressed-FSM decoding) rebuilt in JAX."""

from jsgl.engine.config import EngineConfig
from jsgl.engine.engine import Engine, RequestHandle
from jsgl.engine.request import FinishReason, GenerateOutput, InvalidRequestError, SamplingParams

__version__ = "0.1.0"
__all__ = ["Engine", "EngineConfig", "FinishReason", "GenerateOutput", "InvalidRequestError", "RequestHandle",
           "SamplingParams"]

# The frontend language (SGLang-compatible names): `import jsgl as sgl` then `@sgl.function`, `sgl.gen`, ...
from jsgl.lang import *  # noqa: E402,F403
from jsgl.lang import __all__ as _lang_all  # noqa: E402

__all__ += list(_lang_all)
