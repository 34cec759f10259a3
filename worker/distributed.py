"""The group's collectives behind one small interface.

Layers and models talk to their peers only through a `Collectives` object that they are given
once (rank information included); nothing below this file calls `torch.distributed`. A group of
one device uses `SingleRank`, whose operations return their input unchanged.
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
