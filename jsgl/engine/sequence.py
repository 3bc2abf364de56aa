"""A request's running state inside the engine: tokens, KV slots, detokenizer, outputs."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jsgl.engine.detokenizer import IncrementalDetokenizer
from jsgl.engine.request import (
    AbortReason,
    FinishReason,
    GenerateOutput,
    SamplingParams,
    StreamChunk,
    TokenConstraint,
)

NO_LIMIT = 1 << 31


@dataclasses.dataclass(eq=False)
class Sequence:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    seed: int
    stop_ids: set[int]
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    # KV: slots[i] holds position i for i < num_computed; slots beyond are allocated but not yet written.
    slots: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    num_computed: int = 0
    num_cached: int = 0  # prefix tokens taken from the prefix cache at (latest) admission
    admitted: bool = False  # counted in the hit-rate statistics (first admission only)
    jump_forward_tokens: int = 0  # output tokens appended by jump-forward rather than sampled
    cached_tokens_reported: int = 0  # cache hits of the first admission, reported to the caller
    prefix_node: Any = None  # prefix-cache handle locked while this sequence runs
    constraint: TokenConstraint | None = None
    constraint_ready: Any = None  # a Future resolving to the constraint while its FSM compiles
    bias_row: np.ndarray | None = None  # the request's logit_bias as a vocabulary row, built on its first step
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    error: str | None = None
    abort_reason: AbortReason | None = None
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = dataclasses.field(default_factory=list)
    input_logprobs: list[float | None] = dataclasses.field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = dataclasses.field(default_factory=list)
    stream_queue: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue)
    # A subscriber (RequestHandle.subscribe) takes chunks instead of the queue: no thread per request.
    listener: Callable[[StreamChunk], None] | None = None
    listener_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    output: GenerateOutput | None = None
    published_tokens: int = 0  # output tokens covered by the chunks published so far
    # Latency metrics (engine/metrics.py, when enabled): when its first and latest output tokens came out.
    first_token_time: float | None = None
    last_token_time: float = 0.0
    metrics_tokens: int = 0  # output tokens counted so far

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.return_logprob and self.params.logprob_start_len >= 0

    @property
    def max_new_tokens(self) -> int:
        limit = self.params.max_new_tokens
        return NO_LIMIT if limit is None else limit  # None: the context / token limit ends it

    def build_output(self) -> GenerateOutput:
        p = self.params
        out = GenerateOutput(
            request_id=self.rid,
            text=self.detok.text,
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason,
            matched_stop=self.matched_stop,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            cached_tokens=self.cached_tokens_reported,
            jump_forward_tokens=self.jump_forward_tokens,
            error=self.error,
            abort_reason=self.abort_reason,
        )
        if p.return_logprob:
            out.output_logprobs = list(self.output_logprobs)
            if p.top_logprobs_num:
                out.output_top_logprobs = list(self.output_top_logprobs)
            if p.logprob_start_len >= 0:
                out.input_logprobs = list(self.input_logprobs)
                out.input_token_ids = self.prompt_ids[p.logprob_start_len:]
                if p.top_logprobs_num:
                    out.input_top_logprobs = list(self.input_top_logprobs)
        return out

    def publish(self) -> None:
        """Push new text to the stream; on finish, also the final output and wake waiters."""
        final = self.finished
        p = self.params
        start = self.published_tokens
        if p.stream_interval and not final and len(self.output_ids) - start < p.stream_interval:
            return  # stream_interval: the text waits for the next chunk
        delta = self.detok.stream_delta(final)
        if final:
            self.output = self.build_output()
        if delta or final:
            self.published_tokens = len(self.output_ids)
            chunk = StreamChunk(self.rid, delta, list(self.output_ids), final, self.output, first_new_token=start)
            if p.return_logprob:
                chunk.output_logprobs = self.output_logprobs[start:]
                if p.top_logprobs_num:
                    chunk.output_top_logprobs = self.output_top_logprobs[start:]
            with self.listener_lock:
                listener = self.listener
                if listener is None:
                    self.stream_queue.put(chunk)
            if listener is not None:
                listener(chunk)
        if final:
            self.done.set()
