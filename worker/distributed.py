"""The group's collectives behind one small interface.

Layers and models talk to their peers only through a `Collectives` object that they are given
once (rank information included); nothing below this file calls `torch.distributed`. A group of
one device uses `SingleRank`, whose operations return their input unchanged; a tensor-parallel
group uses `TorchDistributed`, joined with `init_group` from a `Rendezvous`, plus a
`ByteChannel` on a separate gloo group that carries the scheduler's steps from rank 0.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist


class Collectives(ABC):
    """Communication among the ranks of one tensor-parallel group.

    Every rank must call the same operations in the same order with tensors of the same
    shape; each call returns the result rather than relying on in-place updates.
    """

    @property
    @abstractmethod
    def rank(self) -> int:
        """This rank's index in the group, 0 <= rank < world_size."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Number of ranks in the group."""

    @abstractmethod
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise sum of `t` over all ranks, returned on every rank."""

    @abstractmethod
    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `t` concatenated along `dim` in rank order, returned on every rank."""

    @abstractmethod
    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Rank `src`'s `t`, returned on every rank (`t` must have the same shape everywhere)."""


class SingleRank(Collectives):
    """The group of one: rank 0 of 1, every collective is the identity."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        if src != 0:
            raise ValueError(f"broadcast src={src} is out of range for a group of one rank")
        return t


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one group meet: rank 0's TCP store at host:port (from config or from
    the placement layer, never a constant), and how long any collective may wait."""

    host: str
    port: int
    world_size: int
    timeout_s: float = 60.0  # a rank that is silent this long is dead or hung
    startup_timeout_s: float = 600.0  # process start and weight loading may be slow

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must be a non-empty address")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        for name in ("timeout_s", "startup_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"


class TorchDistributed(Collectives):
    """Collectives over one torch.distributed process group (NCCL on GPU, gloo on CPU)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._rank = dist.get_rank(group)
        self._world = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()  # reduced in place: callers use the returned tensor
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self._world)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        t = t.contiguous()
        dist.broadcast(t, src=src, group=self.group)
        return t


class ByteChannel:
    """Messages from rank 0 to every other rank over a CPU (gloo) group.

    A message travels in one broadcast of a fixed-size buffer, `[u64 length][payload]`, when it
    fits (every step of a decode batch does); a longer one spills its tail into a second
    broadcast sized from the length. Every rank must call `send` (rank 0) or `recv` (the others)
    in the same order.
    """

    def __init__(self, group: dist.ProcessGroup | None, capacity: int = 4096) -> None:
        if capacity < 16:
            raise ValueError(f"capacity must be >= 16 bytes, got {capacity}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._buf = torch.zeros(capacity, dtype=torch.uint8)  # (capacity,) reused every message
        self._np = self._buf.numpy()  # a view for cheap byte copies

    def send(self, payload: bytes) -> None:
        n, room = len(payload), len(self._np) - _HEADER
        struct.pack_into("<Q", self._np, 0, n)
        head = min(n, room)
        self._np[_HEADER : _HEADER + head] = np.frombuffer(payload, np.uint8, head)
        dist.broadcast(self._buf, src=0, group=self.group)
        if n > room:
            tail = torch.frombuffer(bytearray(payload[room:]), dtype=torch.uint8)
            dist.broadcast(tail, src=0, group=self.group)

    def recv(self) -> bytes:
        dist.broadcast(self._buf, src=0, group=self.group)
        (n,) = struct.unpack_from("<Q", self._np, 0)
        room = len(self._np) - _HEADER
        head = self._np[_HEADER : _HEADER + min(n, room)].tobytes()
        if n <= room:
            return head
        tail = torch.empty(n - room, dtype=torch.uint8)
        dist.broadcast(tail, src=0, group=self.group)
        return head + tail.numpy().tobytes()

    def all_reduce_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def barrier(self) -> None:
        """A full round trip: returns once every rank has reached it (or the timeout fires)."""
        self.all_reduce_min(0)

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        """A raw broadcast on this channel's group (for measuring its latency)."""
        dist.broadcast(t, src=src, group=self.group)

    @staticmethod
    def probe_tensor() -> torch.Tensor:
        return torch.zeros(8, dtype=torch.uint8)  # (8,): a "small broadcast"


_HEADER = 8  # bytes of the length prefix


def init_group(
    rendezvous: Rendezvous, rank: int, device: torch.device
) -> tuple[TorchDistributed, ByteChannel]:
    """Join the group. Three process groups: the default one (gloo) only for meeting and the
    start-up barrier, patient enough for slow process starts and weight loading; the model's
    collectives (NCCL on CUDA, gloo on CPU) and a gloo group for the step messages, both
    failing after `rendezvous.timeout_s` of silence."""
    if not 0 <= rank < rendezvous.world_size:
        raise ValueError(f"rank {rank} is out of range for world_size {rendezvous.world_size}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "gloo",
        init_method=rendezvous.init_method,
        rank=rank,
        world_size=rendezvous.world_size,
        timeout=timedelta(seconds=rendezvous.startup_timeout_s),
    )
    timeout = timedelta(seconds=rendezvous.timeout_s)
    model_group = dist.new_group(
        backend="nccl" if device.type == "cuda" else "gloo", timeout=timeout
    )
    step_group = dist.new_group(backend="gloo", timeout=timeout)
    return TorchDistributed(model_group), ByteChannel(step_group)


def startup_barrier() -> None:
    """Wait (up to the start-up timeout) until every rank has loaded its shard, so that the
    short collective timeout starts counting only once the whole group is up."""
    dist.barrier()


def destroy_group() -> None:
    """Leave the group (no-op when this process is in none)."""
    if dist.is_initialized():
        dist.destroy_process_group()
