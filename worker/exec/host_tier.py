"""A rank's host-memory tier under its KV pool: whole blocks in host memory, by slot.

Each rank holds its own shard of every block (its KV heads, and an int8 cache's per-token
scales with them; a float8 cache's per-tensor scales are the pool's, the same for every
block). Slots are named by rank 0's block manager (worker/engine/tier_index.py), and each
step's copies (worker/step.py `KVMoves`) come with the step, so that every rank makes the same
ones, saves before loads, before the step's forward. On CUDA the host tensors are pinned, so
that a copy is a DMA at the link's bandwidth; on a CPU device they are plain memory.
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
        pin = device.type == "cuda"
        self.host_tensors = [
            torch.empty((num_slots, *t.shape[1:]), dtype=torch.uint8, pin_memory=pin) for t in self.device_tensors
        ]
        self.num_slots = num_slots
        self.bytes_saved = 0  # device -> host, since start-up
        self.bytes_loaded = 0  # host -> device

    @property
    def block_bytes(self) -> int:
        return sum(t[0].numel() for t in self.host_tensors)

    @property
    def total_bytes(self) -> int:
        return self.block_bytes * self.num_slots

    def apply(self, moves: KVMoves) -> None:
        """The step's copies: saves, then loads (a block saved may be the one a load fills)."""
        if moves.saves:
            blocks, slots = self._indices(moves.saves)
            for d, h in zip(self.device_tensors, self.host_tensors, strict=True):
                h.index_copy_(0, slots, d.index_select(0, blocks.to(self.device)).cpu())  # (n, ...)
            self.bytes_saved += len(moves.saves) * self.block_bytes
        if moves.loads:
            slots, blocks = self._indices(moves.loads)
            blocks = blocks.to(self.device)
            for d, h in zip(self.device_tensors, self.host_tensors, strict=True):
                d.index_copy_(0, blocks, h.index_select(0, slots).to(self.device))  # (n, ...)
            self.bytes_loaded += len(moves.loads) * self.block_bytes

    @staticmethod
    def _indices(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.tensor(pairs, dtype=torch.int64)  # (n, 2)
        return a[:, 0], a[:, 1]
