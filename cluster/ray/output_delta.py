"""Request outputs across a process boundary as deltas.

An engine's `RequestOutput` carries everything so far (prompt, tokens, timings, logprobs), so
sending it whole every step costs more each step. Across Ray only what changed travels; the
receiving side rebuilds the full outputs, one small state per open request. The prompt's ids
travel only when the receiving side does not have them (a text prompt): a long list costs
milliseconds to pickle and unpickle, before the first token (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from worker.outputs import CachedTiers, CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs


@dataclass(slots=True)
class OutputDelta:
    """What one engine step added to one request's output. Made per running request and step
    on a group's rank 0, pickled there and unpickled by the group's handle: made positionally
    and pickled as a plain tuple of its fields (`__reduce__`), faster than a dataclass's
    default (benchmarks/RESULTS.md)."""

    request_id: str
    prompt_token_ids: list[int] | None  # the first delta of a request whose ids were not given
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    new_logprobs: list[TokenLogprobs] | None
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    token_time: float | None  # when this step's token was sampled
    cached_tiers: tuple[int, int, int, int] | None  # num_cached_tokens by tier (CachedTiers' fields)

    @classmethod
    def of(cls, out: RequestOutput, with_prompt: bool) -> OutputDelta:
        """The delta of `out`; `with_prompt` for a request's first delta when the receiving
        side was not given its ids (see `OutputAssembler.expect`)."""
        m = out.metrics
        return cls(
            out.request_id,
            list(out.prompt_token_ids) if with_prompt else None,
            out.new_token_ids,
            out.new_text,
            out.finished,
            out.finish_reason,
            out.stop_reason,
            out.num_cached_tokens,
            out.new_logprobs,
            m.arrival_time,
            m.first_scheduled_time,
            m.first_token_time,
            m.finished_time,
            out.token_time,
            None if out.cached_tiers is None else tuple(out.cached_tiers),
        )

    def __reduce__(self) -> tuple:
        return (
            OutputDelta,
            (
                self.request_id,
                self.prompt_token_ids,
                self.new_token_ids,
                self.new_text,
                self.finished,
                self.finish_reason,
                self.stop_reason,
                self.num_cached_tokens,
                self.new_logprobs,
                self.arrival_time,
                self.first_scheduled_time,
                self.first_token_time,
                self.finished_time,
                self.token_time,
                self.cached_tiers,
            ),
        )


@dataclass
class _Open:
    prompt: Sequence[int]
    tokens: list[int]
    text: str
    metrics: RequestMetrics
    logprobs: list[TokenLogprobs] | None
    cumulative_logprob: float = 0.0


class OutputAssembler:
    """Rebuilds each request's full `RequestOutput` from its deltas (receiving side)."""

    def __init__(self) -> None:
        self._open: dict[str, _Open] = {}
        self._lock = threading.Lock()

    def expect(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Open a request whose prompt ids the sender will not send (they are these)."""
        with self._lock:
            self._open[request_id] = _Open(prompt_token_ids, [], "", RequestMetrics(0.0), None)

    def apply(self, d: OutputDelta) -> RequestOutput | None:
        """The request's output after this delta; None for a request already dropped."""
        with self._lock:
            state = self._open.get(d.request_id)
            if state is None:
                if d.prompt_token_ids is None:
                    return None  # dropped (aborted) while its deltas were in flight
                state = _Open(d.prompt_token_ids, [], "", RequestMetrics(d.arrival_time), None)
                self._open[d.request_id] = state
            state.metrics.arrival_time = d.arrival_time
            if d.finished:
                del self._open[d.request_id]
        m = state.metrics
        m.first_scheduled_time, m.first_token_time = d.first_scheduled_time, d.first_token_time
        m.finished_time = d.finished_time
        if d.token_time is not None:
            m.token_times.append(d.token_time)
        state.tokens += d.new_token_ids
        state.text += d.new_text
        if d.new_logprobs is not None:
            if state.logprobs is None:
                state.logprobs = []
            state.logprobs += d.new_logprobs
            state.cumulative_logprob += sum(lp.logprob for lp in d.new_logprobs)
        completion = CompletionOutput(
            index=0,
            text=state.text,
            token_ids=state.tokens,
            cumulative_logprob=state.cumulative_logprob if state.logprobs is not None else None,
            logprobs=state.logprobs,
            finish_reason=d.finish_reason,
            stop_reason=d.stop_reason,
        )
        return RequestOutput(
            request_id=d.request_id,
            prompt_token_ids=state.prompt,
            outputs=[completion],
            finished=d.finished,
            num_cached_tokens=d.num_cached_tokens,
            metrics=m,
            new_token_ids=d.new_token_ids,
            new_text=d.new_text,
            new_logprobs=d.new_logprobs,
            token_time=d.token_time,
            cached_tiers=None if d.cached_tiers is None else CachedTiers(*d.cached_tiers),
        )

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._open.pop(request_id, None)
