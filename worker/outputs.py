"""What the engine hands back per request: tokens, text, reason, cache use and timings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from worker.sampler import TokenLogprobs


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() when the engine got the request
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token was sampled

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return (
            None
            if self.first_scheduled_time is None
            else self.first_scheduled_time - self.arrival_time
        )

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def time_per_output_token(self) -> float | None:
        itl = self.inter_token_latencies
        return sum(itl) / len(itl) if itl else None

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request's state after a step: the whole output so far plus this step's delta."""

    request_id: str
    prompt_token_ids: Sequence[int]  # a list (a Ray group hands back the ids it was given)
    token_ids: list[int]  # every generated token so far
    text: str  # detokenized output so far (empty without a tokenizer)
    new_token_ids: list[int]  # generated in this step
    new_text: str  # text safe to show that appeared in this step
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    metrics: RequestMetrics
    logprobs: list[TokenLogprobs] | None = None  # per generated token, when asked

    @property
    def ttft(self) -> float | None:
        return self.metrics.ttft
