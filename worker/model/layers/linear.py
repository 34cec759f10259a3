"""Linear layers that shard themselves across a tensor-parallel group and load their own shard.

Column-parallel layers split the output features (no communication); row-parallel layers split
the input features and sum the partial products with the group's only all-reduce per block.
`weight_loader(param, loaded, shard_id)` takes the full checkpoint tensor, or a lazy
`safetensors` slice of it, and copies only this rank's part, so a rank reads only its slices.
A layer may hold its weight in 8 or 4 bits (worker/model/layers/quant.py): each rank quantizes
the shard it loaded.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.layers.quant import QuantizableLayer
from worker.model.parallel import Collectives, SingleRank


def shape_of(loaded: Any) -> tuple[int, ...]:
    """Shape of a tensor or of a lazy safetensors slice."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def take(loaded: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """loaded[start:start+size] along `dim` (0 or 1); reads only that part of a lazy slice."""
    index = (slice(start, start + size),) if dim == 0 else (slice(None), slice(start, start + size))
    return loaded[index]


def copy_checked(param: torch.Tensor, loaded: Any, name: str) -> None:
    """param[...] = loaded, with a clear error when the shapes differ."""
    tensor = loaded if isinstance(loaded, torch.Tensor) else loaded[:]
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))


def default_weight_loader(param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
    """Replicated parameters (norms): every rank copies the whole tensor."""
    copy_checked(param, loaded, "replicated parameter")


def divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) must be divisible by the tensor-parallel size ({d})")
    return n // d


class _ParallelLinear(QuantizableLayer):
    """Holds weight (out_local, in_local) and optional bias; subclasses say how they shard."""

    def __init__(self, in_local: int, out_local: int, bias: bool, bias_size: int, comm: Collectives | None):
        super().__init__()
        self.comm = comm or SingleRank()
        self.rank, self.tp = self.comm.rank, self.comm.world_size
        self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(bias_size), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, in_local) -> x W^T (T, out_local), without the bias."""
        return self.quant.matmul(x) if self.quant is not None else F.linear(x, self.weight)


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's rows (output features) split across ranks.

    forward: x (T, in) -> (T, out / tp), or (T, out) when gather_output.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        comm: Collectives | None = None,
        gather_output: bool = False,
    ):
        tp = (comm or SingleRank()).world_size
        self.output_size_local = divide(output_size, tp, "output_size")
        super().__init__(input_size, self.output_size_local, bias, self.output_size_local, comm)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            y = F.linear(x, self.weight, self.bias)  # (T, out / tp)
        else:
            y = self.quant.matmul(x) if self.bias is None else self.quant.matmul(x) + self.bias  # (T, out / tp)
        return self.comm.all_gather(y, dim=-1) if self.gather_output else y

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        size = param.shape[0]
        copy_checked(param, take(loaded, 0, self.rank * size, size), "column-parallel weight")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up).

    Each rank holds its slice of every part, concatenated: [part0 / tp, part1 / tp, ...].
    shard_id is the part's index in `output_sizes`.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        comm: Collectives | None = None,
    ):
        tp = (comm or SingleRank()).world_size
        self.output_sizes_local = [divide(n, tp, "each merged output size") for n in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, comm)
        self.weight_shard_ids = tuple(range(len(output_sizes)))

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if shard_id is None:
            raise ValueError("MergedColumnParallelLinear needs shard_id (the part's index)")
        size = self.output_sizes_local[shard_id]
        offset = sum(self.output_sizes_local[:shard_id])
        part = take(loaded, 0, self.rank * size, size)
        copy_checked(param.data[offset : offset + size], part, f"merged part {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one matmul, split by heads.

    Query heads are split across ranks. KV heads are split too when tp <= num_kv_heads;
    when tp > num_kv_heads each rank holds one KV head, replicated on tp / num_kv_heads ranks
    (the KV head its query heads read), which requires tp to be a multiple of num_kv_heads.
    Output per rank: [q (heads_local * d), k (kv_heads_local * d), v (kv_heads_local * d)].
    shard_id is "q", "k" or "v".
    """

    weight_shard_ids = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        comm: Collectives | None = None,
    ):
        tp = (comm or SingleRank()).world_size
        rank = (comm or SingleRank()).rank
        self.head_dim = head_dim
        self.num_heads_local = divide(num_heads, tp, "num_heads")
        if tp <= num_kv_heads:
            self.num_kv_heads_local = divide(num_kv_heads, tp, "num_kv_heads")
            self.kv_head_start = rank * self.num_kv_heads_local
        elif tp % num_kv_heads == 0:
            self.num_kv_heads_local = 1
            self.kv_head_start = rank // (tp // num_kv_heads)
        else:
            raise ValueError(
                f"tensor-parallel size {tp} exceeds num_kv_heads {num_kv_heads}, so KV heads "
                f"are replicated, which requires tp to be a multiple of num_kv_heads"
            )
        self.q_size = self.num_heads_local * head_dim
        self.kv_size = self.num_kv_heads_local * head_dim
        out_total = (self.q_size + 2 * self.kv_size) * tp  # so that out / tp is the local size
        super().__init__(hidden_size, out_total, bias, comm)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, q_size + 2 kv_size) -> q (T, heads_local, d), k and v (T, kv_heads_local, d)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        d = self.head_dim
        return (
            q.view(-1, self.num_heads_local, d),
            k.view(-1, self.num_kv_heads_local, d),
            v.view(-1, self.num_kv_heads_local, d),
        )

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, start = self.kv_size, self.kv_head_start * self.head_dim
        else:
            raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        part = take(loaded, 0, start, size)
        copy_checked(param.data[offset : offset + size], part, f"qkv part {shard_id}")


class RowParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's columns (input features) split across ranks.

    forward: x (T, in / tp), this rank's slice of the features -> (T, out), summed over ranks
    (the block's one all-reduce). The bias is added once, after the sum.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, comm: Collectives | None = None):
        tp = (comm or SingleRank()).world_size
        self.input_size_local = divide(input_size, tp, "input_size")
        super().__init__(self.input_size_local, output_size, bias, output_size, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(self.matmul(x))  # (T, out)
        return y + self.bias if self.bias is not None else y

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if param is self.bias:
            copy_checked(param, loaded, "row-parallel bias")
            return
        size = param.shape[1]
        copy_checked(param, take(loaded, 1, self.rank * size, size), "row-parallel weight")
