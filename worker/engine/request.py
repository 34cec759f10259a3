"""One request's state. Counters and token lists are stored; everything else is derived."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence

from worker.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # waiting again, to be recomputed
    FINISHED_STOPPED = 3  # EOS, stop token or stop string
    FINISHED_LENGTH = 4  # max_tokens or the model's context
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """A prompt, what has been generated for it, and how much of it has K/V in the pool.

    The scheduler's one rule is that `num_computed_tokens` catches up with `num_tokens`.
    `block_hashes` holds the hash chain of the request's full blocks (prompt and output),
    extended by the block manager as blocks fill.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        max_tokens: int,
        eos_token_ids: tuple[int, ...] = (),
        priority: int = 0,
        arrival_time: float | None = None,
        hash_root: bytes = b"",
        block_hashes: Sequence[bytes] = (),
        tenant: str = "",
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # resolved: never None
        self.eos_token_ids = eos_token_ids
        # the ids that end the output when sampled: EOS (unless ignored) and the stop tokens
        eos = () if sampling_params.ignore_eos else eos_token_ids
        self.ending_token_ids = frozenset((*eos, *sampling_params.stop_token_ids))
        self.priority = priority  # lower value runs first, within its tenant
        self.tenant = tenant  # whose share of the group it counts against ("": the only one)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.hash_root = hash_root  # parent of block 0: model, adapter and tenant salt
        self.block_hashes: list[bytes] = list(block_hashes)

        self.all_token_ids = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []  # the generated tail of all_token_ids, kept apart
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served from the prefix cache; -1 until admitted
        self.cached_tiers = None  # those tokens by tier (worker/outputs.py: CachedTiers), when admitted
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # the matcher of a structured output (worker/engine/grammar.py: RequestGrammar), set
        # before the request is scheduled; the model runner that samples a token advances it
        self.grammar = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    @property
    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival_time)

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def append_tokens(self, token_ids: Sequence[int]) -> None:
        self.all_token_ids.extend(token_ids)
        self.output_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
