"""How a model's layers talk to the other ranks of their tensor-parallel group.

Layers and models reach their peers only through the `Collectives` object they are given once
(rank information included), so that nothing in `worker/model/` calls `torch.distributed`: a
group of one device passes `SingleRank`, whose operations return their input unchanged; a
tensor-parallel group passes `worker/exec/distributed.py`'s `TorchDistributed`. The interface
lives here, below the layers that use it; its implementations live with the executors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


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
