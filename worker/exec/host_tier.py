"""A rank's host-memory tier under its KV pool: whole blocks in host memory, by slot.

Each rank holds its own shard of every block (its KV heads, and an int8 cache's per-token
scales with them; a float8 cache's per-tensor scales are the pool's, the same for every
block). Slots are named by rank 0's block manager (worker/engine/tier_index.py), and each
step's copies (worker/step.py `KVMoves`) come with the step, so that every rank makes the same
ones, saves before loads, before the step's forward. On CUDA the host tensors are pinned, so
that a copy is a DMA at the link's bandwidth; on a CPU device they are plain memory.

Copies move rows: each tensor viewed as (blocks, row) of the widest integer type its row's
bytes allow (torch's indexed copies move one element at a time: on uint8, about 1/100 of a
memcpy's rate; on int64, about 1/8), and a run of consecutive slots into consecutive blocks
moves as one slice. On CUDA a restore gathers its host rows into a pinned staging buffer
(made once, grown as needed) and copies them up on a stream of its own, without the thread
waiting: that stream first waits for the work already queued on the device (a block loaded
may be one an earlier step wrote), and the device's stream waits for the copies before the
step's forward reads them; the next restore waits for the last one's copies before it
rewrites the staging buffer. Saves (device -> host) are made before the step returns.
"""

from __future__ import annotations

import torch

from worker.config import CacheConfig
from worker.exec.kv_pool import KVLayout, KVPool
from worker.step import KVMoves


def host_blocks(cache: CacheConfig, layout: KVLayout) -> int:
    """Blocks the host tier holds: `kv_host_bytes` over one block's bytes on this rank (its
    scales included). Every rank of a group has the same layout, hence the same count."""
    return (cache.kv_host_bytes or 0) // layout.block_bytes


class HostTier:
    """`num_slots` blocks of `pool`'s shape in host memory, and the copies to and from it."""

    def __init__(self, pool: KVPool, num_slots: int) -> None:
        self.device_tensors = pool.block_tensors  # each (num_blocks, ...) uint8
        device = self.device_tensors[0].device
        self.device = device
        self.cuda = device.type == "cuda"
        self.host_tensors = [
            torch.empty((num_slots, *t.shape[1:]), dtype=torch.uint8, pin_memory=self.cuda) for t in self.device_tensors
        ]
        self.num_slots = num_slots
        self.bytes_saved = 0  # device -> host, since start-up
        self.bytes_loaded = 0  # host -> device
        dtypes = [_row_dtype(d, h) for d, h in zip(self.device_tensors, self.host_tensors, strict=True)]
        self._device_rows = [_rows(t, dt) for t, dt in zip(self.device_tensors, dtypes, strict=True)]
        self._host_rows = [_rows(t, dt) for t, dt in zip(self.host_tensors, dtypes, strict=True)]
        self._staging: list[torch.Tensor] = []  # CUDA: pinned, (rows, row) per tensor
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._loaded = None  # CUDA: the event after the last restore's copies

    @property
    def block_bytes(self) -> int:
        return sum(t[0].numel() for t in self.host_tensors)

    @property
    def total_bytes(self) -> int:
        return self.block_bytes * self.num_slots

    def apply(self, moves: KVMoves) -> None:
        """The step's copies: saves, then loads (a block saved may be the one a load fills)."""
        if moves.saves:
            if self.cuda:
                blocks, slots = _indices(moves.saves)
                blocks = blocks.to(self.device)
                for d, h in zip(self._device_rows, self._host_rows, strict=True):
                    h.index_copy_(0, slots, d.index_select(0, blocks).cpu())  # (n, row)
            else:
                _copy_rows(self._host_rows, self._device_rows, [(s, b) for b, s in moves.saves])
            self.bytes_saved += len(moves.saves) * self.block_bytes
        if moves.loads:
            if self.cuda:
                self._load_cuda(*_indices(moves.loads))
            else:
                _copy_rows(self._device_rows, self._host_rows, [(b, s) for s, b in moves.loads])
            self.bytes_loaded += len(moves.loads) * self.block_bytes

    def _load_cuda(self, slots: torch.Tensor, blocks: torch.Tensor) -> None:
        """Host rows gathered into the pinned staging buffer, copied up and written into the
        pool on the tier's stream; the device's stream waits for them (see the module's doc)."""
        n = len(slots)
        if self._loaded is not None:
            self._loaded.synchronize()  # (the last restore's copies have read the staging buffer)
        if not self._staging or self._staging[0].shape[0] < n:
            rows = max(n, min(self.num_slots, 2 * self._staging[0].shape[0] if self._staging else n))
            self._staging = [torch.empty((rows, *h.shape[1:]), dtype=h.dtype, pin_memory=True) for h in self._host_rows]
        for h, buf in zip(self._host_rows, self._staging, strict=True):
            torch.index_select(h, 0, slots, out=buf[:n])
        compute = torch.cuda.current_stream(self.device)
        assert self._stream is not None
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            index = blocks.contiguous().pin_memory().to(self.device, non_blocking=True)
            for d, buf in zip(self._device_rows, self._staging, strict=True):
                d.index_copy_(0, index, buf[:n].to(self.device, non_blocking=True))
            loaded = torch.cuda.Event()
            loaded.record(self._stream)
        compute.wait_event(loaded)
        self._loaded = loaded


def _indices(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.tensor(pairs, dtype=torch.int64)  # (n, 2)
    return a[:, 0], a[:, 1]


def _row_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.dtype | None:
    """The widest integer type that a row of `a` and of `b` (same shape, uint8) both divide
    into, at their addresses; None when either is not contiguous (kept as it is)."""
    if not (a.is_contiguous() and b.is_contiguous()):
        return None
    row = a[0].numel()
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if row % size == 0 and a.data_ptr() % size == 0 and b.data_ptr() % size == 0:
            return dtype
    return torch.uint8


def _rows(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`t` (n, ...) uint8 as (n, row) of `dtype`, the same memory (None: `t` itself)."""
    return t if dtype is None else t.view(t.shape[0], -1).view(dtype)


def _copy_rows(dst: list[torch.Tensor], src: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """Row `s` of each `src` into row `d` of the `dst` beside it, for each (d, s) of `pairs`.
    Runs of consecutive rows on both sides move as slices when they average 4 rows or more
    (about one memcpy each); else an indexed gather and scatter of the rows moves them all."""
    runs = _runs(pairs)
    if len(runs) * 4 <= len(pairs):
        for d, s in zip(dst, src, strict=True):
            for a, b, n in runs:
                d[a : a + n].copy_(s[b : b + n])
        return
    di, si = _indices(pairs)
    for d, s in zip(dst, src, strict=True):
        d.index_copy_(0, di, s.index_select(0, si))


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first d, first s, length) of each run of `pairs` where both sides go up by one."""
    out: list[tuple[int, int, int]] = []
    d0, s0 = pairs[0]
    n = 1
    for d, s in pairs[1:]:
        if d == d0 + n and s == s0 + n:
            n += 1
        else:
            out.append((d0, s0, n))
            d0, s0, n = d, s, 1
    out.append((d0, s0, n))
    return out
