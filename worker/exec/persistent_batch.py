"""What a decode batch carries from one step to the next, in one place.

In the steady state of decoding, the next step is predictable: the same requests, in the same
order, each one token further, each computing the token just sampled for it. Two parties keep
state across steps to make that step cheap, and both kinds of state live here:

- rank 0's step planner (worker/exec/step_codec.py) keeps a `DecodeBatch`: the last one-token
  step, its requests, how many steps remain before a start reaches a block its row's table
  lacks, the starts of the step that would continue it, the tokens its forward sampled and the
  step built from them ahead. `DecodeBatch.continues` is the one test of whether the
  scheduler's next step is that step's successor; `DecodeBatch.advance` moves it one step on.
- every rank's model runner (worker/exec/model_runner.py) keeps `DecodeInputs`: the last
  decode step's input arrays in their tensors' dtypes, which `DecodeInputs.advance` moves one
  token further in place (positions, lengths, slots), leaving `pending` the positions that
  start a block the table does not hold yet.

With overlap (worker/exec/overlap.py), rank 0's forward thread runs the step built ahead before
the scheduler has made its step; the planner marks the step it hands back `FlatStep.ahead` when
it is that one, so that the forward already run is adopted. Nothing here is keyed by an
object's identity: each fact a later step relies on is a named field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from worker.step import SchedulerOutput

if TYPE_CHECKING:
    from worker.exec.step_codec import FlatStep

NO_SEQS = np.zeros(0, dtype=np.intp)  # (0,) no sequence indices, shared
NO_SEQS.flags.writeable = False


class TableEntries(NamedTuple):
    """Block-table entries: entry i puts block `ids[i]` at column `cols[i]` of row `rows[i]`."""

    rows: np.ndarray  # (K,) int32
    cols: np.ndarray  # (K,) int32: the block's index in its request's table
    ids: np.ndarray  # (K,) int32 block ids


@dataclass
class DecodeBatch:
    """Rank 0's record of the last one-token step, for planning the step that continues it."""

    request_ids: list[str]  # its requests in order: the sample ids of a step where all sample
    step: FlatStep  # the last step planned for them
    until: int  # steps from `step` until a start reaches a block its row's table lacks
    next_starts: np.ndarray  # (S,) int32: the starts of the step that continues it
    sampled: np.ndarray | None = None  # (S,) int32 tokens of `step`, when every sequence sampled
    ahead: FlatStep | None = None  # the step continuing it with `sampled`, built after sampling

    def continues(self, out: SchedulerOutput) -> bool:
        """Whether the scheduler's step `out` is these requests one token further: one token
        each, the same requests in the same order, none finished or preempted meanwhile (a
        request id is not reused while its old request is listed as finished)."""
        scheduled = out.scheduled
        return (
            len(scheduled) == out.num_batched_tokens == len(self.request_ids)
            and not out.finished_ids
            and not out.preempted_ids
            and [s.request.request_id for s in scheduled] == self.request_ids
        )

    def took_sampled(self, out: SchedulerOutput) -> bool:
        """Whether the scheduler appended the tokens `step` sampled (seen on the last request:
        a request that missed its token, aborted meanwhile, leaves the batch)."""
        sampled = self.sampled
        return sampled is not None and out.scheduled[-1].request.all_token_ids[-1] == sampled[-1]

    def advance(self, step: FlatStep, until: int) -> None:
        """One step on: `step`, planned for the same requests, is now the last."""
        self.step = step
        self.until = until
        self.next_starts = step.starts + 1
        self.sampled = None
        self.ahead = None


@dataclass
class DecodeInputs:
    """One step's input arrays (S sequences, T tokens) in their tensors' dtypes; kept after a
    decode step so that the next step of the same sequences only advances them in place (on a
    CPU the tensors share this memory)."""

    rows: np.ndarray  # (S,) int32 block-table rows
    tokens: np.ndarray  # (T,) int64
    positions: np.ndarray  # (T,) int64
    slots: np.ndarray  # (T,) int64
    query_start_loc: np.ndarray  # (S+1,) int32
    seq_lens: np.ndarray  # (S,) int32
    sample_rows: np.ndarray  # (n,) int64
    block_tables: np.ndarray  # (S, max blocks) int32
    max_query_len: int
    max_seq_len: int
    until: int  # steps of one token each until some position starts a new block
    ahead: bool = False  # already advanced to the step that would continue this one
    # (m,) sequences whose advanced position starts a block the table did not hold yet: their
    # slots wait for that step's entries
    pending: np.ndarray = field(default_factory=lambda: NO_SEQS)

    def advance(self, table: np.ndarray, count: np.ndarray, block_size: int) -> None:
        """Positions, lengths and slots + 1; where a position starts a block (every block_size
        steps), its slot from the block table `table` (rows' block counts `count`), or pending
        when the table lacks that block yet."""
        self.ahead = True
        self.positions += 1  # in place: on CPU the tensors share these arrays
        self.seq_lens += 1
        self.slots += 1
        self.max_seq_len += 1
        self.until -= 1
        if self.until:
            return
        bs = block_size
        first = np.flatnonzero(self.positions % bs == 0)  # (m,) sequences starting a block
        cols = self.positions[first] // bs  # (m,) the block's index in each table
        rows = self.rows[first]
        held = count[rows] > cols  # (m,) bool: the table holds the block
        inside = cols < table.shape[1]  # (m,) a column past the width grows with its block
        self.slots[first[inside]] = table[rows[inside], cols[inside]] * bs  # right where held
        self.pending = first if not held.all() else NO_SEQS
        self.until = int((bs - self.positions % bs).min())

    def fill_pending(self, table: np.ndarray, block_size: int) -> None:
        """The slots of pending positions, once the step that brings their blocks is applied."""
        p = self.pending
        self.slots[p] = table[self.rows[p], self.positions[p] // block_size] * block_size
        self.pending = NO_SEQS
