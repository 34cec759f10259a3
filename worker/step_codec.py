"""The scheduler's steps as bytes, for the ranks of a tensor-parallel group other than rank 0.

Rank 0 owns the scheduler and the requests; every other rank keeps a mirror of each running
request: its token ids and its block table, which is all its model runner reads. A step sends
new requests whole (id, every known token id, the whole block table) and running ones as diffs
(the tokens sampled since their last step, the blocks added this step, start and length), so a
decode batch costs a few bytes per request whatever the context length. Requests that finished
or were preempted are dropped from the mirrors (a preempted request comes back whole).

Message layout: one kind byte, then for a step a float64 send time (for the control-overhead
measurement) and a pickle of plain lists and tuples of ints (C-speed, a few bytes each).
"""

from __future__ import annotations

import pickle
import struct
import time
from collections import deque
from itertools import compress, repeat
from operator import getitem, setitem, sub

from worker.scheduler import SchedulerOutput

STEP, HEARTBEAT, PROBE, SHUTDOWN = b"s", b"h", b"p", b"x"
_TIME = struct.Struct("<d")
_PROTOCOL = pickle.HIGHEST_PROTOCOL


class MirrorRequest:
    """A rank's copy of one running request; it also serves as its own scheduled entry
    (`request`, `start`, `num_tokens`, `block_ids`, `samples`, `is_new`), as
    ModelRunner.prepare reads."""

    __slots__ = (
        "request_id", "all_token_ids", "block_ids", "start", "num_tokens", "samples", "is_new"
    )  # fmt: skip

    def __init__(self, request_id: str, token_ids: list[int], block_ids: list[int]) -> None:
        self.request_id = request_id
        self.all_token_ids = token_ids
        self.block_ids = block_ids
        self.start = 0
        self.num_tokens = 0
        self.samples = False
        self.is_new = True

    @property
    def request(self) -> MirrorRequest:
        return self

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class StepEncoder:
    """Rank 0's side: remembers what the mirrors hold, so that it can send only diffs."""

    def __init__(self) -> None:
        # request id -> [slot, tokens the mirrors hold]
        self._sent: dict[str, list[int]] = {}
        self._next_slot = 0

    def encode(self, out: SchedulerOutput, sent_at: float | None = None) -> bytes:
        sent = self._sent
        drops = [sent.pop(rid)[0] for rid in (*out.preempted_ids, *out.finished_ids) if rid in sent]
        body = self._decodes(out) or self._general(out)
        t = time.perf_counter() if sent_at is None else sent_at
        return STEP + _TIME.pack(t) + pickle.dumps((drops, *body), protocol=_PROTOCOL)

    def _decodes(self, out: SchedulerOutput) -> tuple | None:
        """The body of a step where every entry decodes one token of a mirrored request (the
        steady state), built with one comprehension per field; None for any other step."""
        scheduled = out.scheduled
        n = len(scheduled)
        if not n or out.num_batched_tokens != n or True in [s.is_new for s in scheduled]:
            return None
        get = self._sent.get
        states = [get(s.request.request_id) for s in scheduled]  # [slot, known] of each
        if None in states:
            return None
        known = [st[1] for st in states]
        ids = [s.request.all_token_ids for s in scheduled]
        lens = [len(i) for i in ids]
        if [s.start for s in scheduled] != known or list(map(sub, lens, known)).count(1) != n:
            return None
        tokens = list(map(getitem, ids, known))  # the one token each mirror lacks
        deque(map(setitem, states, repeat(1), lens), maxlen=0)  # the mirrors now hold them
        slots = [st[0] for st in states]
        blk_slots, blk_ids = [], []
        for i in compress(range(n), [s.new_block_ids for s in scheduled]):  # 1 in block_size
            for block in scheduled[i].new_block_ids:
                blk_slots.append(slots[i])
                blk_ids.append(block)
        return [], [], slots, tokens, blk_slots, blk_ids

    def _general(self, out: SchedulerOutput) -> tuple:
        sent = self._sent
        new: list[tuple] = []  # (position, slot, id, token ids, block table, start, num_tokens)
        other: list[tuple] = []  # (position, slot, start, num_tokens, new token ids)
        dec_slots, dec_tokens = [], []  # decodes: one new token, computed at the old length
        blk_slots, blk_ids = [], []  # blocks added to running requests, in order
        for pos, s in enumerate(out.scheduled):
            req = s.request
            state = sent.get(req.request_id)
            if state is None or s.is_new:
                new.append(self._admit(pos, s))
                continue
            slot, known = state
            ids = req.all_token_ids
            if s.num_tokens == 1 and s.start == known and len(ids) == known + 1:
                dec_slots.append(slot)
                dec_tokens.append(ids[known])
            else:  # a prefill chunk after the first, or anything unusual: say it all
                other.append((pos, slot, s.start, s.num_tokens, ids[known:]))
            state[1] = len(ids)
            if s.new_block_ids:  # one block per block_size decodes
                for block in s.new_block_ids:
                    blk_slots.append(slot)
                    blk_ids.append(block)
        return new, other, dec_slots, dec_tokens, blk_slots, blk_ids

    def _admit(self, pos: int, s) -> tuple:
        rid = s.request.request_id
        old = self._sent.get(rid)
        slot = old[0] if old is not None else self._next_slot
        if old is None:
            self._next_slot += 1
        tokens = list(s.request.all_token_ids)
        table = list(s.block_ids)
        self._sent[rid] = [slot, len(tokens)]
        return (pos, slot, rid, tokens, table, s.start, s.num_tokens)

    @property
    def num_mirrored(self) -> int:
        return len(self._sent)


class StepDecoder:
    """Another rank's side: applies each step to the mirrors and rebuilds the step."""

    def __init__(self) -> None:
        self.mirrors: dict[int, MirrorRequest] = {}  # slot -> mirror

    def decode(self, message: bytes) -> tuple[SchedulerOutput, float]:
        """A STEP message -> (the step for ModelRunner.execute, rank 0's send time)."""
        assert message[:1] == STEP, message[:1]
        (sent_at,) = _TIME.unpack_from(message, 1)
        drops, new, other, dec_slots, dec_tokens, blk_slots, blk_ids = pickle.loads(
            memoryview(message)[1 + _TIME.size :]
        )
        mirrors = self.mirrors
        dropped = [mirrors.pop(slot).request_id for slot in drops if slot in mirrors]
        scheduled: list[MirrorRequest] = []
        append = scheduled.append
        for slot, token in zip(dec_slots, dec_tokens, strict=True):
            m = mirrors[slot]
            ids = m.all_token_ids
            m.start = len(ids)  # a decode computes the token it appends
            ids.append(token)
            m.num_tokens, m.samples, m.is_new = 1, True, False
            append(m)
        for slot, block in zip(blk_slots, blk_ids, strict=True):
            mirrors[slot].block_ids.append(block)
        num_tokens = len(dec_slots)
        placed = []  # (position, mirror) of the entries that are not decodes
        for pos, slot, start, n, tokens in other:
            m = mirrors[slot]
            m.all_token_ids += tokens
            m.is_new = False
            placed.append((pos, self._set(m, start, n)))
            num_tokens += n
        for pos, slot, rid, tokens, table, start, n in new:
            m = mirrors[slot] = MirrorRequest(rid, tokens, table)
            placed.append((pos, self._set(m, start, n)))
            num_tokens += n
        for pos, m in sorted(placed, key=lambda e: e[0]):
            scheduled.insert(pos, m)  # ascending positions: earlier inserts stay in place
        out = SchedulerOutput(
            scheduled=scheduled, num_batched_tokens=num_tokens, finished_ids=dropped
        )  # type: ignore[arg-type]
        return out, sent_at

    @staticmethod
    def _set(m: MirrorRequest, start: int, n: int) -> MirrorRequest:
        m.start, m.num_tokens = start, n
        m.samples = start + n == len(m.all_token_ids)
        return m


def kind_of(message: bytes) -> bytes:
    return message[:1]


def probe_message(rounds: int) -> bytes:
    return PROBE + struct.pack("<I", rounds)


def probe_rounds(message: bytes) -> int:
    return struct.unpack_from("<I", message, 1)[0]
