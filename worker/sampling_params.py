"""What a request asks of the sampler and of the stop checks; validated once, at the door."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from worker.structured_outputs import StructuredOutputs

_GREEDY_EPS = 1e-5
# Bounds on what a request may ask the stop checks to watch: every step scans its stop strings
# on the group's engine thread, where any cost delays every other running request. Generous
# against real use (OpenAI allows 4 stop strings).
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
_SHOWN_CHARS = 60  # how much of a bad value an error message repeats


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping.

    temperature 0 means greedy. `max_tokens=None` means "up to the model's context".
    Every bad value raises a ValueError that names the field.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    include_stop_str_in_output: bool = False
    n: int = 1  # completions of the prompt (pagefleet.LLM runs one request each)
    min_tokens: int = 0  # no EOS, stop token or stop string before this many tokens
    skip_special_tokens: bool = True  # in the output text
    # what the output must match (a JSON Schema, a regex, ...): worker/structured_outputs.py
    structured_outputs: StructuredOutputs | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen to tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature",
            "must be >= 0",
            self.temperature,
        )
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(
            _is_int(self.top_k) and self.top_k >= -1,
            "top_k",
            "must be -1, 0 (disabled) or a positive integer",
            self.top_k,
        )
        _check(
            _is_number(self.min_p) and 0 <= self.min_p <= 1,
            "min_p",
            "must be in [0, 1]",
            self.min_p,
        )
        _check(self.seed is None or _is_int(self.seed), "seed", "must be an integer", self.seed)
        _check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            "must be >= 1",
            self.max_tokens,
        )
        _check_items(
            "stop",
            self.stop,
            MAX_STOP_STRINGS,
            lambda s: isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS,
            f"must be a non-empty string of at most {MAX_STOP_CHARS} characters",
        )
        _check_items(
            "stop_token_ids",
            self.stop_token_ids,
            MAX_STOP_TOKEN_IDS,
            lambda t: _is_int(t) and t >= 0,
            "must be a non-negative integer",
        )
        _check(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
            "logprobs",
            "must be in [0, 20]",
            self.logprobs,
        )
        _check(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "must be > 0",
            self.repetition_penalty,
        )
        _check(
            _is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            "must be in [-2, 2]",
            self.presence_penalty,
        )
        _check(
            _is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            "must be in [-2, 2]",
            self.frequency_penalty,
        )
        _check(_is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1", self.n)
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens),
            "min_tokens",
            "must be an integer in [0, max_tokens]",
            self.min_tokens,
        )
        _check(
            isinstance(self.skip_special_tokens, bool),
            "skip_special_tokens",
            "must be a boolean",
            self.skip_special_tokens,
        )
        if isinstance(self.structured_outputs, dict):  # (vLLM's fields as keywords)
            object.__setattr__(self, "structured_outputs", _structured(self.structured_outputs))
        _check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs),
            "structured_outputs",
            "must be a StructuredOutputs",
            self.structured_outputs,
        )

    def for_completion(self, index: int) -> SamplingParams:
        """The parameters of the `index`-th of `n` completions: one request each, n=1; a seeded
        request's completions draw from seeds seed, seed + 1, ... (as vLLM's do), so that they
        differ and each is reproducible."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _structured(fields: dict) -> StructuredOutputs:
    unknown = sorted(set(fields) - set(StructuredOutputs.__dataclass_fields__))
    if unknown:
        raise ValueError(f"SamplingParams.structured_outputs has unknown field(s) {unknown}")
    return StructuredOutputs(**fields)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x  # x == x: not NaN


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {rule}, got {shown(value)}")


def _check_items(name: str, items: tuple, most: int, ok, rule: str) -> None:
    """A bounded list whose first bad element is named by its index."""
    if len(items) > most:
        raise ValueError(f"SamplingParams.{name} has {len(items)} entries; at most {most} allowed")
    for i, item in enumerate(items):
        if not ok(item):
            raise ValueError(f"SamplingParams.{name}[{i}] {rule}, got {shown(item)}")


def shown(value: object) -> str:
    """`repr(value)` for an error message, cut short: a client's 20k-character value must not
    come back whole (gRPC drops a status message that large)."""
    text = repr(value)
    if len(text) <= _SHOWN_CHARS:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters"
    return f"{text[:_SHOWN_CHARS]}... ({size})"
