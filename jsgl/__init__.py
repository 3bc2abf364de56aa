"""jsgl: SGLang (structured LM programs, RadixAttention, compressed-FSM decoding) rebuilt in JAX."""

from jsgl.engine.config import EngineConfig
from jsgl.engine.engine import Engine, RequestHandle
from jsgl.engine.request import FinishReason, GenerateOutput, InvalidRequestError, SamplingParams

__version__ = "0.1.0"
__all__ = ["Engine", "EngineConfig", "FinishReason", "GenerateOutput", "InvalidRequestError", "RequestHandle",
           "SamplingParams"]
