"""A scheduler step as flat arrays, and as bytes for the other ranks of a tensor-parallel group.

Rank 0 (or a single device) plans each step as flat arrays (`RowPlanner` -> `FlatStep`: each
sequence's block-table row, start and length, the input tokens, the block-table entries
written this step), from which every rank's model runner prepares its inputs, keeping its own
block tables (`BlockTable`). Rank 0 sends the arrays as they are; another rank reads them back
with one `np.frombuffer`. So running requests travel as diffs (a decode: row, start and token,
12 bytes, whatever the context length, and only its token, 4 bytes, when the step continues
the one before with the same sequences; a new block once per block_size decodes), new requests
as their whole table and their chunk's tokens, and no rank but 0 builds a request object. A
row freed by a finished or preempted request is reset when rank 0 assigns it again.

Message layout: the header below, then int32 arrays back to back: rows (S), starts (S) (S = 0
when the step continues the one before), q_lens (S, when present), tokens (T), resets (R), the
table entries' rows, columns and block ids (K each); then, when present, samples (S bytes).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress

import numpy as np

from worker.step import SchedulerOutput

STEP, HEARTBEAT, PROBE, SHUTDOWN = b"s", b"h", b"p", b"x"
# kind, flags, S, T, R, K, rank 0's send time (for the control-overhead measurement); 32 bytes
# so that the int32 arrays after it start aligned
_HEADER = struct.Struct("<cB2xIIIId4x")
_HAS_Q_LENS, _HAS_SAMPLES, _CONTINUES = 1, 2, 4
_NONE = np.zeros(0, dtype=np.int32)  # (0,): an empty array field, shared
_NONE.flags.writeable = False


def _none() -> np.ndarray:
    return _NONE


@dataclass
class FlatStep:
    """One step as flat int32 arrays: S sequences, T tokens, R rows reset, K table entries.

    Filled by RowPlanner.plan on rank 0 (or by step_codec.decode_step on the other ranks);
    read by ModelRunner.prepare on every rank. Decode-only steps leave `q_lens` and `samples`
    None; a step that `continues` the one before (the same sequences in the same order, each
    one token further, each sampling: the steady state) also leaves its rows and starts to what
    every runner kept, so it travels as one token per sequence.
    """

    rows: np.ndarray  # (S,) block-table row of each sequence
    starts: np.ndarray  # (S,) first position computed this step
    tokens: np.ndarray  # (T,) input token ids, sequence after sequence
    q_lens: np.ndarray | None = None  # (S,) tokens computed per sequence; None: one each
    samples: np.ndarray | None = None  # (S,) bool: the sequence samples; None: every one
    # (R,) rows (re)assigned this step: their tables start empty
    resets: np.ndarray = field(default_factory=_none)
    # (K,) each block-table entry written this step: its row, its column (the block's index in
    # its request's table) and its block id, each row's in column order
    table_rows: np.ndarray = field(default_factory=_none)
    table_cols: np.ndarray = field(default_factory=_none)
    table_ids: np.ndarray = field(default_factory=_none)
    sample_ids: Sequence[str] = ()  # rank 0 only: ids of the sampling sequences
    continues: bool = False  # the previous step's sequences, one token further, all sampling

    @property
    def num_seqs(self) -> int:
        return len(self.tokens) if self.continues else len(self.rows)


class BlockTable:
    """Every rank's copy of the running requests' block tables, one row each, kept from step
    to step and changed only by the entries a step carries (a decode batch writes one entry
    per request every block_size steps), so that nothing is padded or copied per step."""

    def __init__(self, rows: int = 64, cols: int = 16) -> None:
        self.table = np.zeros((rows, cols), dtype=np.int32)  # (rows, max blocks) block ids
        self.count = np.zeros(rows, dtype=np.int32)  # (rows,) blocks held by each row

    def reserve(self, rows: int, cols: int = 0) -> None:
        """Room for `rows` rows of `cols` blocks (doubling; padding reads as block 0)."""
        have_r, have_c = self.table.shape
        if rows <= have_r and cols <= have_c:
            return
        r = have_r if rows <= have_r else max(rows, 2 * have_r)
        c = have_c if cols <= have_c else max(cols, 2 * have_c)
        grown = np.zeros((r, c), dtype=np.int32)
        grown[:have_r, :have_c] = self.table
        self.table = grown
        self.count = np.concatenate([self.count, np.zeros(r - have_r, dtype=np.int32)])

    def apply(self, step: FlatStep) -> None:
        """Clear the step's reset rows, then write its entries (each row's in column order)."""
        if len(step.resets):
            self.reserve(int(step.resets.max()) + 1)
            self.table[step.resets] = 0
            self.count[step.resets] = 0
        if len(step.table_rows):
            self.reserve(int(step.table_rows.max()) + 1, int(step.table_cols.max()) + 1)
            self.table[step.table_rows, step.table_cols] = step.table_ids
            np.maximum.at(self.count, step.table_rows, step.table_cols + 1)


class RowPlanner:
    """Rank 0's side of the tables: which row each running request holds, and which entries
    of its block table the rows lack; it turns the scheduler's step into a FlatStep.

    A table only grows while its request runs (the block manager appends; a preempted request
    comes back `is_new` with a new table), so comparing each row's block count with its
    table's length finds the new entries. Rows of finished or preempted requests are reused.
    A step that decodes the same requests, in the same order, as the step before (the steady
    state) reuses that step's rows and ends, so it reads only each request's token; when the
    step before sampled every request, rank 0's runner has that step built already, right after
    sampling (`plan_ahead`), and `plan` only checks that the scheduler kept the same requests.
    """

    def __init__(self, tables: BlockTable, block_size: int) -> None:
        self.tables = tables  # read only here: ModelRunner.prepare applies the step to it
        self.block_size = block_size
        self._row_of: dict[str, int] = {}  # request id -> row
        self._free: list[int] = []
        self._next_row = 0
        # the last one-token step: (its requests, the step, their ids, steps until a start
        # reaches a new block, the starts of the step that would continue it)
        self._last: tuple[list, FlatStep, list[str], int, np.ndarray] | None = None
        # the step that would continue the last one with the tokens it sampled, built while
        # the forward's results go back to the scheduler (plan_ahead): (those tokens, the step)
        self._ahead: tuple[np.ndarray, FlatStep] | None = None
        # (rows, cols, ids): entries of tables the scheduler grew in a step that was built
        # ahead (a block allocated a step early, for the forward after it): they travel with
        # the step built next
        self._late: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self._row_of)  # rows held by running requests

    def release(self, request_ids) -> None:
        for rid in request_ids:
            row = self._row_of.pop(rid, None)
            if row is not None:
                self._free.append(row)

    def plan(self, out: SchedulerOutput, sampled: np.ndarray | None = None) -> FlatStep:
        """The step as flat arrays; one comprehension per field, the rest in numpy.
        `sampled`: the tokens sampled in the last step, if it sampled every sequence."""
        scheduled = out.scheduled
        requests = [s.request for s in scheduled]
        last, self._last = self._last, None
        ahead, self._ahead = self._ahead, None
        late, self._late = self._late, None
        grew = out.grew
        if (
            last is not None
            and len(scheduled) == out.num_batched_tokens
            and not out.finished_ids
            and not out.preempted_ids
            and late is None  # (else every row's entries are worked out afresh)
            and requests == last[0]  # the same objects (Request compares by identity)
        ):
            if ahead is not None and ahead[0] is sampled and _appended(requests, sampled):
                step = ahead[1]  # built by plan_ahead: the same requests, each one further
                assert scheduled[-1].start == step.starts[-1], "a step did not continue the last"
                if grew:  # its forward has run: the new entries go with the next step
                    self._late = self._grown_entries(scheduled, step.rows, grew)
            else:
                step = self._plan_decodes(scheduled, requests, last[1], last[2], last[4], sampled, grew)
        else:
            self.release(out.finished_ids)
            self.release(out.preempted_ids)
            if not scheduled:
                return FlatStep(_NONE, _NONE, _NONE)
            step = self._plan_any(out)
            grew = range(len(scheduled))  # (rows may be new or reset: each one's table)
        if step.q_lens is None:  # the next step may be the same requests' next decodes
            same = last is not None and step.rows is last[1].rows
            rids = last[2] if same else [r.request_id for r in requests]
            if same and last[3] > 2:  # (a row's table only grows: still true, one step on)
                until = last[3] - 1
            else:
                until = self._until(step, scheduled, grew)
            # (the next step's starts, made here rather than between the forwards)
            self._last = (requests, step, rids, until, step.starts + 1)
        return step

    def _until(self, step: FlatStep, scheduled: list, grew: Sequence[int]) -> int:
        """Steps from this one until a start reaches a block its row's table will lack: each
        row holds its table's blocks after this step (`len(block_ids)` where the scheduler
        grew it), whatever of them the runner's tables still wait for. Above 1, the next
        step can run ahead (plan_ahead)."""
        held = self.tables.count[step.rows]  # (S,) a copy
        if len(grew):
            held[list(grew)] = [len(scheduled[i].block_ids) for i in grew]
        return int((held * self.block_size - step.starts).min())

    def _grown_entries(self, scheduled: list, rows: np.ndarray, grew: list[int]) -> tuple:
        """(rows, cols, ids) of the entries the tables of `grew` (indices in `scheduled`)
        gained over what the runner's tables hold."""
        rows = rows[grew]
        lens = np.array([len(scheduled[i].block_ids) for i in grew], dtype=np.int32)
        return self._entries([scheduled[i] for i in grew], rows, self.tables.count[rows], lens, [])

    def plan_ahead(self, sampled: np.ndarray) -> None:
        """Rank 0, after sampling every sequence of the last planned step (one token each):
        build the step that continues it with `sampled` (S,) int32, so that when the scheduler
        hands over the same requests `plan(out, sampled)` only checks that they are the same.
        Not built when a start reaches a block its table lacks (the scheduler allocates it).
        It carries the entries of blocks allocated a step early in the step before."""
        last = self._last  # a one-token step (q_lens None)
        if last is None or last[3] <= 1 or last[1].samples is not None:
            return
        rows = last[1].rows
        if len(sampled) != len(rows):
            return
        tokens = np.asarray(sampled, dtype=np.int32)  # (S,) what each request computes next
        step = FlatStep(rows, last[4], tokens, sample_ids=last[2], continues=True)
        late, self._late = self._late, None
        if late is not None:  # blocks the scheduler allocated a step early
            step.table_rows, step.table_cols, step.table_ids = late
        self._ahead = (sampled, step)

    def ahead_of(self, sampled: np.ndarray) -> FlatStep | None:
        """The step `plan_ahead(sampled)` built, if it built one: what `plan` returns when the
        scheduler continues the last step with those tokens (the overlapped runner starts its
        forward before the scheduler has said so)."""
        ahead = self._ahead
        return ahead[1] if ahead is not None and ahead[0] is sampled else None

    def _plan_decodes(
        self,
        scheduled: list,
        requests: list,
        last: FlatStep,
        rids: list[str],
        next_starts: np.ndarray,
        sampled: np.ndarray | None,
        grew: list[int],
    ) -> FlatStep:
        """The same requests one token further: each starts where its last step ended (no
        request is new: a preempted one leaves the list for at least one step). Rows lack
        blocks only where the scheduler grew their tables in this step (`grew`)."""
        starts = next_starts  # (the last step's starts + 1: it was a one-token step)
        assert scheduled[-1].start == starts[-1], "a step did not start where its last ended"
        if last.samples is None and _appended(requests, sampled):
            # the last step sampled every request, and the scheduler appended the tokens:
            # each now computes the token sampled for it, and samples again
            samples, tokens = None, sampled
        else:
            samples = [s.samples for s in scheduled]
            if False not in samples:  # each computes its last known token
                tokens = [r.all_token_ids[-1] for r in requests]
            else:
                tokens = [s.request.all_token_ids[s.start] for s in scheduled]
        rows, entries = last.rows, (_NONE, _NONE, _NONE)
        if grew:
            entries = self._grown_entries(scheduled, rows, grew)
        step = self._step(rows, starts, tokens, None, samples, [], entries, rids)
        step.continues = step.samples is None and last.samples is None
        return step

    def _plan_any(self, out: SchedulerOutput) -> FlatStep:
        scheduled = out.scheduled
        n = len(scheduled)
        rids = [s.request.request_id for s in scheduled]
        rows = list(map(self._row_of.get, rids))
        resets = []
        if None in rows or True in [s.is_new for s in scheduled]:
            for i, s in enumerate(scheduled):
                if rows[i] is None or s.is_new:
                    rows[i] = self._assign(rids[i])
                    resets.append(rows[i])
        rows_a = np.array(rows, dtype=np.int32)
        self.tables.reserve(self._next_row)
        have = self.tables.count[rows_a]  # (S,) blocks each row holds before this step
        if resets:
            have[np.isin(rows_a, resets)] = 0
        lens = np.array([len(s.block_ids) for s in scheduled], dtype=np.int32)  # (S,)
        entries = self._entries(scheduled, rows, have, lens, resets)
        starts = np.array([s.start for s in scheduled], dtype=np.int32)
        if out.num_batched_tokens == n:  # one token per sequence (decodes, mostly)
            tokens = [s.request.all_token_ids[s.start] for s in scheduled]
            q_lens = None
        else:
            tokens = []
            for s in scheduled:
                tokens += s.request.all_token_ids[s.start : s.start + s.num_tokens]
            q_lens = np.array([s.num_tokens for s in scheduled], dtype=np.int32)
        samples = [s.samples for s in scheduled]
        return self._step(rows_a, starts, tokens, q_lens, samples, resets, entries, rids)

    @staticmethod
    def _step(rows, starts, tokens, q_lens, samples, resets, entries, rids) -> FlatStep:
        every = samples is None or False not in samples  # samples None: every one samples
        return FlatStep(
            rows=rows,
            starts=starts,
            tokens=np.asarray(tokens, dtype=np.int32),
            q_lens=q_lens,
            samples=None if every else np.array(samples, dtype=bool),
            resets=np.array(resets, dtype=np.int32) if resets else _NONE,
            table_rows=entries[0],
            table_cols=entries[1],
            table_ids=entries[2],
            sample_ids=rids if every else list(compress(rids, samples)),
        )

    @staticmethod
    def _entries(scheduled, rows, have, lens, resets) -> tuple[np.ndarray, ...]:
        """(rows, cols, ids) of the block-table entries the rows lack, up to `lens` blocks
        each: those of new rows, and one per block_size decodes."""
        t_rows: list[int] = []
        t_cols: list[int] = []
        t_ids: list[int] = []
        for i in np.flatnonzero(have != lens).tolist():
            ids, h = scheduled[i].block_ids, int(have[i])
            if h > len(ids):  # (never expected: tables only grow) start the row over
                resets.append(rows[i])
                h = 0
            t_rows += [int(rows[i])] * (len(ids) - h)
            t_cols += range(h, len(ids))
            t_ids += ids[h:]
        if not t_rows:
            return _NONE, _NONE, _NONE
        return tuple(np.array(x, dtype=np.int32) for x in (t_rows, t_cols, t_ids))

    def _assign(self, rid: str) -> int:
        row = self._row_of.get(rid)
        if row is None:
            if self._free:
                row = self._free.pop()
            else:
                row, self._next_row = self._next_row, self._next_row + 1
            self._row_of[rid] = row
        return row


def encode_step(step: FlatStep, sent_at: float | None = None) -> bytes:
    """A STEP message carrying `step` (its arrays, not its request ids)."""
    t = time.perf_counter() if sent_at is None else sent_at
    if step.continues and not len(step.table_rows) and not len(step.resets):
        # the steady state: the tokens alone
        tokens = step.tokens
        return _HEADER.pack(STEP, _CONTINUES, 0, len(tokens), 0, 0, t) + tokens.tobytes()
    flags = _CONTINUES if step.continues else 0
    parts = [] if step.continues else [step.rows, step.starts]  # else kept by every runner
    if step.q_lens is not None:
        flags |= _HAS_Q_LENS
        parts.append(step.q_lens)
    parts += [step.tokens, step.resets, step.table_rows, step.table_cols, step.table_ids]
    body = np.concatenate(parts, dtype=np.int32)
    tail = b""
    if step.samples is not None:  # one byte a sequence, after the int32 arrays
        flags |= _HAS_SAMPLES
        tail = step.samples.astype(np.bool_).tobytes()
    s = 0 if step.continues else len(step.rows)
    counts = (s, len(step.tokens), len(step.resets), len(step.table_rows))
    return _HEADER.pack(STEP, flags, *counts, t) + body.tobytes() + tail


def decode_step(message: bytes) -> tuple[FlatStep, float]:
    """A STEP message -> (the step for ModelRunner.run, rank 0's send time)."""
    kind, flags, s, t, r, k, sent_at = _HEADER.unpack_from(message, 0)
    assert kind == STEP, kind
    if flags == _CONTINUES and not r and not k:  # the steady state: the tokens alone (read only)
        tokens = np.frombuffer(message, dtype=np.int32, count=t, offset=_HEADER.size)
        return FlatStep(_NONE, _NONE, tokens, continues=True), sent_at
    sizes = (s, s, s if flags & _HAS_Q_LENS else 0, t, r, k, k, k)
    end = _HEADER.size + 4 * sum(sizes)
    buf = bytearray(message)  # writable arrays
    body = np.frombuffer(buf, dtype=np.int32, count=sum(sizes), offset=_HEADER.size)
    parts, at = [], 0
    for size in sizes:  # views, in message order
        parts.append(body[at : at + size])
        at += size
    rows, starts, q_lens, tokens, resets, t_rows, t_cols, t_ids = parts
    step = FlatStep(
        rows=rows,
        starts=starts,
        tokens=tokens,
        q_lens=q_lens if flags & _HAS_Q_LENS else None,
        samples=np.frombuffer(buf, dtype=np.bool_, offset=end) if flags & _HAS_SAMPLES else None,
        resets=resets,
        table_rows=t_rows,
        table_cols=t_cols,
        table_ids=t_ids,
        continues=bool(flags & _CONTINUES),
    )
    return step, sent_at


def _appended(requests: list, sampled: np.ndarray | None) -> bool:
    """`sampled` holds a token for each request, and the scheduler appended them (seen on the
    last request; a request that missed its token, aborted meanwhile, leaves the running list)."""
    return sampled is not None and len(sampled) == len(requests) and requests[-1].all_token_ids[-1] == sampled[-1]


def kind_of(message: bytes) -> bytes:
    return message[:1]


def probe_message(rounds: int) -> bytes:
    return PROBE + struct.pack("<I", rounds)


def probe_rounds(message: bytes) -> int:
    return struct.unpack_from("<I", message, 1)[0]
