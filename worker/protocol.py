"""What crosses a worker group's boundary, free of torch: the request a group receives
(`GenerationRequest`, with `Resume` for a request continued after its group died) and the
errors it answers with. What it streams back is worker/outputs.py (`RequestOutput`); its
sampling options worker/sampling_params.py. A router imports these, never the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from worker.sampling_params import SamplingParams


@dataclass
class GenerationRequest:
    """A request as a group receives it (from the router or a local caller)."""

    prompt: str | Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    block_hashes: Sequence[bytes] | None = None  # the router's hashes of the prompt, if any
    resume: Resume | None = None  # continuing a request whose first group died


@dataclass(frozen=True)
class Resume:
    """A request continued on this group after its group died mid-stream: the tokens it had
    generated (and streamed), how many characters of their text were shown, and their logprobs
    (when asked). The group computes the prompt and those tokens again (or finds them in its
    prefix cache) and streams only what follows; a seeded request draws what it would have
    drawn (worker/sampler.py: seeded_uniform), so the output equals an undisturbed run's."""

    token_ids: tuple[int, ...]
    text_sent: int = 0
    logprobs: tuple = ()  # TokenLogprobs per token, when asked


class EngineDeadError(RuntimeError):
    """The engine loop stopped; in-flight requests fail with this."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later."""
