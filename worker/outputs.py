"""What the engine hands back per request: tokens, text, reason, cache use and timings."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple


class Logprob(NamedTuple):
    """One token's logprob and rank, as vLLM reports it (`decoded_token` is left unset)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class TokenLogprobs(Mapping[int, Logprob]):
    """The chosen token's logprob, its rank, and the top-n alternatives (highest first).

    Also a read-only mapping {token id: Logprob} over the chosen token and the top-n, the
    shape of one entry of vLLM's `CompletionOutput.logprobs`."""

    token_id: int
    logprob: float
    rank: int  # 1 + the number of tokens with a strictly higher logprob
    top: list[tuple[int, float]]  # (token id, logprob), len == params.logprobs

    def __getitem__(self, token_id: int) -> Logprob:
        if token_id == self.token_id:
            return Logprob(self.logprob, self.rank)
        for i, (tid, lp) in enumerate(self.top):
            if tid == token_id:
                return Logprob(lp, i + 1)
        raise KeyError(token_id)

    def __iter__(self) -> Iterator[int]:
        yield self.token_id
        yield from (tid for tid, _ in self.top if tid != self.token_id)

    def __len__(self) -> int:
        return 1 + sum(1 for tid, _ in self.top if tid != self.token_id)


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
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

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


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a request, in vLLM's shape."""

    index: int  # which of the request's n completions
    text: str  # detokenized output so far (empty without a tokenizer)
    token_ids: list[int]  # every generated token so far (the engine's list: it grows on)
    cumulative_logprob: float | None  # sum of the chosen tokens' logprobs, when logprobs are asked
    logprobs: list[TokenLogprobs] | None  # per token: {token id: Logprob}, chosen and top-n
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


class CachedTiers(NamedTuple):
    """A prompt's cached tokens by where the group found them: on the device (a hit), restored
    from its host tier, fetched from its disk tier (through the host), or pulled from another
    group (into the host tier, then restored). The engine reports what it served
    (`RequestOutput.cached_tiers`); the router what its placement predicted."""

    device: int = 0
    host: int = 0
    disk: int = 0
    pull: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.disk + self.pull

    def clipped(self, tokens: int) -> CachedTiers:
        """The first `tokens` of these, in the chain's order of its tiers (device, host, disk,
        pull): a prefix cut short keeps its leading part."""
        out = []
        for n in self:
            out.append(min(n, max(0, tokens)))
            tokens -= n
        return CachedTiers(*out)

    def as_dict(self) -> dict[str, int]:
        return self._asdict()


class RequestOutput:
    """A request's state after a step, in vLLM's shape (`outputs`: its completions so far), plus
    what vLLM lacks: this step's delta and single-completion shortcuts (`text`, `token_ids`,
    `finish_reason`, `stop_reason`, `logprobs`, `ttft`).

    The engine makes one per running request per step, so it is one object: with `outputs`
    None, `_one` holds a single completion's `CompletionOutput` fields after `index` (text,
    token_ids, cumulative_logprob, logprobs, finish_reason, stop_reason), and `outputs` makes
    the `CompletionOutput` when first read. Built with `outputs` (the n completions of
    `merge_completions`, the ones a Ray group rebuilds), the shortcuts read `outputs[0]`.
    `replace` gives a copy with some fields changed, as `dataclasses.replace` would."""

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "finished",
        "num_cached_tokens",
        "metrics",
        "new_token_ids",
        "new_text",
        "new_logprobs",
        "token_time",
        "prompt",
        "cached_tiers",
        "_outputs",
        "_one",
    )
    _FIELDS = (
        "request_id",
        "prompt_token_ids",
        "outputs",
        "finished",
        "num_cached_tokens",
        "metrics",
        "new_token_ids",
        "new_text",
        "new_logprobs",
        "token_time",
        "prompt",
        "cached_tiers",
    )

    request_id: str
    prompt_token_ids: Sequence[int]  # a list (a Ray group hands back the ids it was given)
    finished: bool
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    metrics: RequestMetrics
    new_token_ids: list[int]  # generated in this step
    new_text: str  # text safe to show that appeared in this step
    # This step's logprobs (when asked) and sampling time: the whole-output lists and the
    # metrics grow as the engine runs on, so a consumer that reads later takes these.
    new_logprobs: list[TokenLogprobs] | None
    token_time: float | None
    prompt: str | None  # the prompt's text, when it was given as text
    cached_tiers: CachedTiers | None  # num_cached_tokens by tier (None: not told, e.g. a resume)

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        outputs: list[CompletionOutput] | None,
        finished: bool,
        num_cached_tokens: int,
        metrics: RequestMetrics,
        new_token_ids: list[int] | None = None,
        new_text: str = "",
        new_logprobs: list[TokenLogprobs] | None = None,
        token_time: float | None = None,
        prompt: str | None = None,
        _one: tuple | None = None,
        cached_tiers: CachedTiers | None = None,
    ) -> None:
        # (one store per line: the fastest form, this being made per request per step)
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.finished = finished
        self.num_cached_tokens = num_cached_tokens
        self.metrics = metrics
        self.new_token_ids = [] if new_token_ids is None else new_token_ids
        self.new_text = new_text
        self.new_logprobs = new_logprobs
        self.token_time = token_time
        self.prompt = prompt
        self.cached_tiers = cached_tiers
        self._outputs = outputs
        self._one = _one

    @property
    def outputs(self) -> list[CompletionOutput]:
        if self._outputs is None:
            self._outputs = [CompletionOutput(0, *self._one)]
        return self._outputs

    @outputs.setter
    def outputs(self, outputs: list[CompletionOutput]) -> None:
        self._outputs = outputs

    @property
    def text(self) -> str:
        return self._one[0] if self._outputs is None else self._outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self._one[1] if self._outputs is None else self._outputs[0].token_ids

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self._one[3] if self._outputs is None else self._outputs[0].logprobs

    @property
    def finish_reason(self) -> str | None:
        return self._one[4] if self._outputs is None else self._outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self._one[5] if self._outputs is None else self._outputs[0].stop_reason

    @property
    def ttft(self) -> float | None:
        return self.metrics.ttft

    def replace(self, **changes) -> RequestOutput:
        """A copy with `changes` (field names as the constructor's) applied."""
        fields = {name: getattr(self, name) for name in self._FIELDS}
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"RequestOutput has no field(s) {sorted(unknown)}")
        fields.update(changes)
        return RequestOutput(**fields)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RequestOutput):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in self._FIELDS)

    __hash__ = None  # mutable, as the dataclass it replaces

    def __repr__(self) -> str:
        inner = ", ".join(f"{f}={getattr(self, f)!r}" for f in self._FIELDS)
        return f"RequestOutput({inner})"

    def __getstate__(self) -> dict:
        return {f: getattr(self, f) for f in self._FIELDS}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)


def merge_completions(completions: Sequence[RequestOutput]) -> RequestOutput:
    """One request's output from its n completions, each run as a request of its own (the
    first completion's prompt, cache use and timings; every completion, in order)."""
    first = completions[0]
    outputs = [replace(c.outputs[0], index=i) for i, c in enumerate(completions)]
    finished = all(c.finished for c in completions)
    return first.replace(outputs=outputs, finished=finished)
