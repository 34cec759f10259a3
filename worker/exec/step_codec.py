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

from worker.exec.persistent_batch import DecodeBatch, TableEntries
from worker.step import KVMoves, SchedulerOutput

STEP, HEARTBEAT, PROBE, SHUTDOWN, MOVES, FETCH = b"s", b"h", b"p", b"x", b"m", b"f"
# a fetch started off the step's path (its moves as FETCH's), and the oldest fetches awaited
FETCH_START, FETCH_WAIT = b"a", b"w"
INVENTORY = b"i"  # rank 0's reopened disk blocks, for every rank to say which it holds too
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
    ahead: bool = False  # rank 0 only: built ahead (RowPlanner.commit) from the last tokens

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
    step before sampled every request, that step is built already, right after sampling
    (`commit`), and `plan` only checks that the scheduler kept the same requests. What carries
    over between steps is the `batch` (worker/exec/persistent_batch.py).
    """

    def __init__(self, tables: BlockTable, block_size: int) -> None:
        self.tables = tables  # read only here: ModelRunner.prepare applies the step to it
        self.block_size = block_size
        self._row_of: dict[str, int] = {}  # request id -> row
        self._free: list[int] = []
        self._next_row = 0
        self.batch: DecodeBatch | None = None  # the last step, when it was one token each
        # entries of tables the scheduler grew in a step that was built ahead (a block
        # allocated a step early, for the forward after it): they travel with the next step
        self._late: TableEntries | None = None

    def __len__(self) -> int:
        return len(self._row_of)  # rows held by running requests

    def release(self, request_ids) -> None:
        for rid in request_ids:
            row = self._row_of.pop(rid, None)
            if row is not None:
                self._free.append(row)

    def plan(self, out: SchedulerOutput) -> FlatStep:
        """The step as flat arrays; one comprehension per field, the rest in numpy."""
        scheduled = out.scheduled
        batch, self.batch = self.batch, None
        late, self._late = self._late, None
        if batch is not None and late is None and batch.continues(out):
            # (with late entries, every row's entries are worked out afresh below)
            grew = out.grew
            if batch.ahead is not None and batch.took_sampled(out):
                step = batch.ahead  # built by commit: the same requests, each one further
                assert scheduled[-1].start == step.starts[-1], "a step did not continue the last"
                if grew:  # its forward has run: the new entries go with the next step
                    self._late = self._grown_entries(scheduled, step.rows, grew)
            else:
                step = self._plan_decodes(out, batch)
            if step.q_lens is None:  # the next step may be the same requests' next decodes
                # (a row's table only grows: `until` holds one step on while it is above 2)
                batch.advance(step, batch.until - 1 if batch.until > 2 else self._until(step, scheduled, grew))
                self.batch = batch
            return step
        self.release(out.finished_ids)
        self.release(out.preempted_ids)
        if not scheduled:
            return FlatStep(_NONE, _NONE, _NONE)
        step = self._plan_any(out)
        if step.q_lens is None:  # (rows may be new or reset: each one's table)
            rids = [s.request.request_id for s in scheduled]
            until = self._until(step, scheduled, range(len(scheduled)))
            self.batch = DecodeBatch(rids, step, until, step.starts + 1)
        return step

    def _until(self, step: FlatStep, scheduled: list, grew: Sequence[int]) -> int:
        """Steps from this one until a start reaches a block its row's table will lack: each
        row holds its table's blocks after this step (`len(block_ids)` where the scheduler
        grew it), whatever of them the runner's tables still wait for. Above 1, the next
        step can be built ahead (commit)."""
        held = self.tables.count[step.rows]  # (S,) a copy
        if len(grew):
            held[list(grew)] = [len(scheduled[i].block_ids) for i in grew]
        return int((held * self.block_size - step.starts).min())

    def _grown_entries(self, scheduled: list, rows: np.ndarray, grew: list[int]) -> TableEntries:
        """(rows, cols, ids) of the entries the tables of `grew` (indices in `scheduled`)
        gained over what the runner's tables hold."""
        rows = rows[grew]
        lens = np.array([len(scheduled[i].block_ids) for i in grew], dtype=np.int32)
        return self._entries([scheduled[i] for i in grew], rows, self.tables.count[rows], lens, [])

    def commit(self, sampled: np.ndarray | None, ahead: bool = True) -> None:
        """Rank 0, after sampling the last planned step: keep its tokens (`sampled`, (S,)
        int32, when every sequence of a one-token step sampled) and build the step that
        continues it with them, so that when the scheduler hands over the same requests
        `plan` only checks that they are the same. Not built when a start reaches a block its
        table lacks (the scheduler allocates it). It carries the entries of blocks allocated
        a step early in the step before. `ahead=False` keeps the tokens only (the next step is
        then planned from them)."""
        batch = self.batch
        if batch is None:
            return
        batch.sampled = sampled
        if sampled is None or not ahead or batch.until <= 1 or batch.step.samples is not None:
            return
        rows = batch.step.rows
        if len(sampled) != len(rows):
            return
        tokens = np.asarray(sampled, dtype=np.int32)  # (S,) what each request computes next
        step = FlatStep(rows, batch.next_starts, tokens, sample_ids=batch.request_ids, continues=True, ahead=True)
        late, self._late = self._late, None
        if late is not None:  # blocks the scheduler allocated a step early
            step.table_rows, step.table_cols, step.table_ids = late
        batch.ahead = step

    def ahead(self) -> FlatStep | None:
        """The step `commit` built, if it built one: what `plan` returns when the scheduler
        continues the last step with its tokens (the overlapped runner starts its forward
        before the scheduler has said so)."""
        batch = self.batch
        return None if batch is None else batch.ahead

    def _plan_decodes(self, out: SchedulerOutput, batch: DecodeBatch) -> FlatStep:
        """The same requests one token further: each starts where its last step ended (no
        request is new: a preempted one leaves the list for at least one step). Rows lack
        blocks only where the scheduler grew their tables in this step (`out.grew`)."""
        scheduled, last = out.scheduled, batch.step
        starts = batch.next_starts  # (the last step's starts + 1: it was a one-token step)
        assert scheduled[-1].start == starts[-1], "a step did not start where its last ended"
        if last.samples is None and batch.took_sampled(out):
            # the last step sampled every request, and the scheduler appended the tokens:
            # each now computes the token sampled for it, and samples again
            samples, tokens = None, batch.sampled
        else:
            samples = [s.samples for s in scheduled]
            if False not in samples:  # each computes its last known token
                tokens = [s.request.all_token_ids[-1] for s in scheduled]
            else:
                tokens = [s.request.all_token_ids[s.start] for s in scheduled]
        rows, entries = last.rows, TableEntries(_NONE, _NONE, _NONE)
        if out.grew:
            entries = self._grown_entries(scheduled, rows, out.grew)
        step = self._step(rows, starts, tokens, None, samples, [], entries, batch.request_ids)
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
            table_rows=entries.rows,
            table_cols=entries.cols,
            table_ids=entries.ids,
            sample_ids=rids if every else list(compress(rids, samples)),
        )

    @staticmethod
    def _entries(scheduled, rows, have, lens, resets) -> TableEntries:
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
            return TableEntries(_NONE, _NONE, _NONE)
        return TableEntries(*(np.array(x, dtype=np.int32) for x in (t_rows, t_cols, t_ids)))

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


def encode_fetch_wait(n: int) -> bytes:
    """Every rank: wait for its oldest `n` fetches started, and agree on each one's count."""
    return FETCH_WAIT + struct.pack("<I", n)


def decode_fetch_wait(message: bytes) -> int:
    return struct.unpack_from("<I", message, 1)[0]


def encode_moves(moves: KVMoves, fetches: Sequence[tuple[bytes, int]] = (), kind: bytes = MOVES) -> bytes:
    """A MOVES message: a step's copies between tiers, sent just before the step (every rank
    makes them before its forward); or a FETCH message: disk writes to make first, then disk
    blocks (hash, host slot) to read. Kind, 3 pad bytes, five counts (saves, loads, demotes,
    drops, fetches), the int32 pairs of saves and loads, the int32 host slots of demotes and
    fetches, then the 16-byte hashes of demotes, drops and fetches."""
    pairs = np.array([*moves.saves, *moves.loads], dtype=np.int32).reshape(-1, 2)  # (n, 2)
    slots = np.array([s for s, _ in moves.demotes] + [s for _, s in fetches], dtype=np.int32)
    hashes = b"".join([*(h for _, h in moves.demotes), *moves.drops, *(h for h, _ in fetches)])
    counts = struct.pack("<5I", len(moves.saves), len(moves.loads), len(moves.demotes), len(moves.drops), len(fetches))
    return kind + bytes(3) + counts + pairs.tobytes() + slots.tobytes() + hashes


def decode_moves(message: bytes) -> tuple[KVMoves, list[tuple[bytes, int]]]:
    """A MOVES or FETCH message -> (its moves, its fetches)."""
    saves, loads, demotes, drops, fetches = struct.unpack_from("<5I", message, 4)
    at = 24
    pairs = np.frombuffer(message, dtype=np.int32, count=2 * (saves + loads), offset=at).reshape(-1, 2).tolist()
    at += 8 * (saves + loads)
    slots = np.frombuffer(message, dtype=np.int32, count=demotes + fetches, offset=at).tolist()
    at += 4 * (demotes + fetches)
    hashes = [message[at + 16 * i : at + 16 * (i + 1)] for i in range(demotes + drops + fetches)]
    moves = KVMoves(
        saves=[tuple(p) for p in pairs[:saves]],
        loads=[tuple(p) for p in pairs[saves:]],
        demotes=list(zip(slots[:demotes], hashes[:demotes], strict=True)),
        drops=hashes[demotes : demotes + drops],
    )
    return moves, list(zip(hashes[demotes + drops :], slots[demotes:], strict=True))


def encode_inventory(hashes: Sequence[bytes]) -> bytes:
    """An INVENTORY message: the kind, then rank 0's 16-byte block hashes in its order."""
    return INVENTORY + b"".join(hashes)


def decode_inventory(message: bytes) -> list[bytes]:
    return [message[i : i + 16] for i in range(1, len(message), 16)]


def kind_of(message: bytes) -> bytes:
    return message[:1]


def probe_message(rounds: int) -> bytes:
    return PROBE + struct.pack("<I", rounds)


def probe_rounds(message: bytes) -> int:
    return struct.unpack_from("<I", message, 1)[0]
