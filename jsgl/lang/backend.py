"""The interface between the interpreter and whatever runs the model.

`Runtime` (in-process engine) implements it here; an HTTP `RuntimeEndpoint` or an `OpenAI` backend can
implement the same methods. Each method gets the calling StreamExecutor `s`, whose `text_` is the prompt so
far and `messages_` the chat so far (chat-only APIs need the latter).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from jsgl.lang.chat_template import ChatTemplate
from jsgl.lang.choices import ChoicesDecision, ChoicesSamplingMethod
from jsgl.lang.ir import GenParams

if TYPE_CHECKING:
    from jsgl.lang.interpreter import StreamExecutor


class BaseBackend:
    """Defaults do nothing (hints are optional) or raise (generation is not)."""

    # Whether the backend can append the KV of forked branches to the parent without recomputing it.
    support_concate_and_append: bool = False
    # Chat-only APIs (OpenAI chat) need whole messages instead of a text prompt.
    is_chat_model: bool = False

    def __init__(self) -> None:
        self.chat_template = ChatTemplate()

    def get_model_name(self) -> str:
        raise NotImplementedError

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    # Frontend hints -------------------------------------------------------------------------------------

    def cache_prefix(self, prefix_str: str) -> None:
        """Compute `prefix_str` once so later requests sharing it hit the prefix cache (blocking)."""

    def commit_lazy_operations(self, s: StreamExecutor) -> None:
        """Compute the state's text so far (the fork hint); blocking."""

    def begin_program(self, s: StreamExecutor) -> None:
        pass

    def end_program(self, s: StreamExecutor) -> None:
        pass

    # Generation -----------------------------------------------------------------------------------------

    def generate(self, s: StreamExecutor, sampling_params: GenParams) -> tuple[Any, Any]:
        """Continue `s.text_`; return the new text and its meta info. With `n` > 1: a list of n texts and a
        list of their n metas (the interpreter continues the text with the first)."""
        raise NotImplementedError

    def generate_stream(self, s: StreamExecutor, sampling_params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        """Like generate (n == 1), as (text_delta, meta_info) pieces. Each piece's meta describes that piece
        only where it has per-token lists (`output_token_logprobs`: its new tokens), plus running counts
        (`completion_tokens`, `output_token_logprobs_length`); the interpreter merges them."""
        text, meta = self.generate(s, sampling_params)
        yield text, meta

    def select(
        self,
        s: StreamExecutor,
        choices: list[str],
        temperature: float,
        choices_method: ChoicesSamplingMethod,
    ) -> ChoicesDecision:
        raise NotImplementedError

    def concatenate_and_append(self, src_rids: list[str], dst_rid: str) -> None:
        raise NotImplementedError

    # Lifecycle ------------------------------------------------------------------------------------------

    def flush_cache(self) -> None:
        pass

    def get_server_info(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        pass
