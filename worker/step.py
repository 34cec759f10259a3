"""A step handed from the engine to the devices: the one type `worker/exec/` takes from
`worker/engine/`.

The scheduler fills a `SchedulerOutput` each step; the executor, the step planner and the
model runner read it and nothing else of the engine. Of each request they read the few facts
`StepRequest` names (its ids, its token lists, how it samples), which the engine's `Request`
provides; they never change it. Torch-free, below both packages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from worker.sampling_params import SamplingParams


class StepRequest(Protocol):
    """What the devices' side reads of a scheduled request (worker/engine/request.py's
    `Request`). The lists are the request's own and grow as it does: a reader takes what it
    needs during the step it was handed."""

    @property
    def request_id(self) -> str: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...  # the prompt, then the output so far

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def max_tokens(self) -> int: ...  # output tokens it may generate in all

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def eos_token_ids(self) -> Sequence[int]: ...

    @property
    def grammar(self) -> Any: ...  # the matcher of a structured output (worker/engine/grammar.py), or None


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step. Filled by the scheduler; read by the model runner."""

    request: StepRequest  # read only below the engine
    start: int  # first position computed this step (num_computed_tokens before the step)
    num_tokens: int  # tokens computed this step: a prefill chunk or 1 decode token
    block_ids: list[int]  # the whole block table after this step's allocation (live list)
    new_block_ids: Sequence[int]  # the blocks added this step (none: a shared empty tuple)
    is_new: bool  # admitted (or resumed after preemption) in this step: its row starts empty
    samples: bool  # the step reaches the last known token, so a new token is sampled

    @property
    def end(self) -> int:
        """One past the last position computed this step."""
        return self.start + self.num_tokens

    def slot_mapping(self, block_size: int) -> list[int]:
        """The KV slot (block id * block_size + offset) of each position computed this step."""
        ids = self.block_ids
        return [ids[p // block_size] * block_size + p % block_size for p in range(self.start, self.end)]


@dataclass
class KVMoves:
    """Copies of whole KV blocks between a rank's device pool and the tiers under it, made by
    every rank before the step's forward, in this order: `demotes` (host -> disk: blocks the
    host evicts, read before a save reuses their slot) and `drops` (disk files evicted), then
    `saves` (device -> host: blocks evicted this step, read before a new owner writes them),
    then `loads` (host -> device: a restored prefix, into blocks the step's forward reads).
    Filled by the block manager on rank 0; the slots a step touches are not reused within it,
    so the order is the only one needed."""

    saves: list[tuple[int, int]] = field(default_factory=list)  # (device block id, host slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block id)
    demotes: list[tuple[int, bytes]] = field(default_factory=list)  # (host slot, block hash)
    drops: list[bytes] = field(default_factory=list)  # block hashes the disk tier let go

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.demotes or self.drops)


@dataclass
class SchedulerOutput:
    """One step: which tokens of which requests run, and what changed since the last step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)  # in the batch's order
    num_batched_tokens: int = 0  # the sum of the entries' num_tokens
    preempted_ids: list[str] = field(default_factory=list)  # lost their blocks in this step
    finished_ids: list[str] = field(default_factory=list)  # left since the previous step
    admitted: list[ScheduledRequest] = field(default_factory=list)  # the `is_new` entries
    # indices in `scheduled` of running requests whose block tables grew in this step
    grew: list[int] = field(default_factory=list)
    # block copies between tiers to make before the forward (every rank), or None
    moves: KVMoves | None = None

    @property
    def is_empty(self) -> bool:
        """Nothing to run."""
        return not self.scheduled
