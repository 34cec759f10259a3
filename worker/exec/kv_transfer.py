"""A rank's side of KV blocks moved between groups (worker/kv_transfer.py): rows copied out of
its pool and host tier, rows written into its host tier, and the shards kept for a peer.

Rank 0's block manager names the rows: an export's sources, each (DEVICE_ROW, block id) or
(HOST_ROW, host slot), and an import's (row of the shard, host slot) pairs. Every rank makes
the copy between two steps, in the order of the group's messages (rank 0 sends EXPORT and
IMPORT on the step channel), so a block being copied is never one a step rewrites: it is
pinned for the copy only, by the order, and the copy is a snapshot the holder forgets at once.

Ranks other than 0 hand their shards across Ray, not the step channel: an export's shard waits
in the rank's `ShardStash` until the pulling group's rank r fetches it (rank r pulls rank r's
shard), and a shard pulled for an import waits there until rank 0's IMPORT message.
"""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict

import numpy as np
import torch

from worker.exec.step_codec import decode_moves, encode_moves
from worker.step import KVMoves

EXPORT, IMPORT = b"e", b"n"  # message kinds on the step channel (worker/exec/step_codec.py has the others)
DEVICE_ROW, HOST_ROW = 0, 1  # where an exported block is: the pool (block id) or the host tier (slot)
STASH_KEPT = 8  # shards a rank keeps for peers; an older one was abandoned (its pull timed out)


def export_rows(
    device_tensors: list[torch.Tensor], host_tensors: list[torch.Tensor] | None, sources: list[tuple[int, int]]
) -> list[torch.Tensor]:
    """The sources' rows, each block tensor's as one host tensor (n, ...) uint8, in order."""
    dev = [(i, x) for i, (m, x) in enumerate(sources) if m == DEVICE_ROW]
    host = [(i, x) for i, (m, x) in enumerate(sources) if m == HOST_ROW]
    assert not host or host_tensors is not None, "an export from a host tier this rank lacks"
    dev_pos, ids = _split(dev) if dev else (None, None)
    host_pos, slots = _split(host) if host else (None, None)
    out = []
    for k, d in enumerate(device_tensors):
        if not host:  # (one gather, the common case: a holder's prefix on its device)
            out.append(d.index_select(0, ids.to(d.device)).cpu())  # (n, ...)
            continue
        if not dev:
            out.append(host_tensors[k].index_select(0, slots))
            continue
        rows = torch.empty((len(sources), *d.shape[1:]), dtype=torch.uint8)  # (n, ...)
        rows[dev_pos] = d.index_select(0, ids.to(d.device)).cpu()
        rows[host_pos] = host_tensors[k].index_select(0, slots)
        out.append(rows)
    return out


def import_rows(host_tensors: list[torch.Tensor], shard: list[torch.Tensor], rows: list[tuple[int, int]]) -> bool:
    """Write the shard's rows into host slots, each (row, slot); False (nothing written) when
    the shard is not of this tier's shape."""
    if len(shard) != len(host_tensors) or any(
        s.dtype != torch.uint8 or s.shape[1:] != h.shape[1:] for s, h in zip(shard, host_tensors, strict=True)
    ):
        return False
    for row, slot, n in _runs(rows):  # (a slice's copy runs at memory speed, an indexed one far below)
        for s, h in zip(shard, host_tensors, strict=True):
            h[slot : slot + n].copy_(s[row : row + n])  # (n, ...)
    return True


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(row, slot) pairs as runs in which both go up by one: (first row, first slot, length)."""
    runs: list[list[int]] = []
    for row, slot in pairs:
        if runs and runs[-1][0] + runs[-1][2] == row and runs[-1][1] + runs[-1][2] == slot:
            runs[-1][2] += 1
        else:
            runs.append([row, slot, 1])
    return [tuple(r) for r in runs]


def _split(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.tensor(pairs, dtype=torch.int64)  # (n, 2)
    return a[:, 0], a[:, 1]


# ---- messages (rank 0 -> the other ranks) -----------------------------------------------------
def encode_export(export_id: bytes, sources: list[tuple[int, int]]) -> bytes:
    """EXPORT: kind, 16-byte id, then the int32 (medium, index) pairs of the sources."""
    return EXPORT + export_id + np.array(sources, dtype=np.int32).reshape(-1, 2).tobytes()


def decode_export(message: bytes) -> tuple[bytes, list[tuple[int, int]]]:
    pairs = np.frombuffer(message, dtype=np.int32, offset=17).reshape(-1, 2).tolist()
    return message[1:17], [tuple(p) for p in pairs]


def encode_import(import_id: bytes, early: KVMoves, rows: list[tuple[int, int]]) -> bytes:
    """IMPORT: kind, 16-byte id, the count of (row, slot) pairs, the int32 pairs, then the
    disk writes to make first (a MOVES message: the host slots' victims, before the rows
    overwrite them)."""
    pairs = np.array(rows, dtype=np.int32).reshape(-1, 2).tobytes()
    return IMPORT + import_id + struct.pack("<I", len(rows)) + pairs + encode_moves(early)


def decode_import(message: bytes) -> tuple[bytes, KVMoves, list[tuple[int, int]]]:
    (n,) = struct.unpack_from("<I", message, 17)
    pairs = np.frombuffer(message, dtype=np.int32, count=2 * n, offset=21).reshape(-1, 2).tolist()
    early = decode_moves(message[21 + 8 * n :])[0]
    return message[1:17], early, [tuple(p) for p in pairs]


class ShardStash:
    """Shards by id, kept for a peer (thread-safe: the step loop puts, a Ray call takes)."""

    def __init__(self, kept: int = STASH_KEPT) -> None:
        self.kept = kept
        self._shards: OrderedDict[bytes, list[torch.Tensor]] = OrderedDict()
        self._cond = threading.Condition()

    def put(self, shard_id: bytes, shard: list[torch.Tensor]) -> None:
        with self._cond:
            self._shards[shard_id] = shard
            while len(self._shards) > self.kept:
                self._shards.popitem(last=False)
            self._cond.notify_all()

    def take(self, shard_id: bytes, timeout_s: float = 0.0) -> list[torch.Tensor] | None:
        """The shard (removed), waiting up to `timeout_s` for it; None if it never came."""
        with self._cond:
            self._cond.wait_for(lambda: shard_id in self._shards, timeout_s)
            return self._shards.pop(shard_id, None)
