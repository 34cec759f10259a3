"""KV blocks handed from one group to another: what they must share, and what travels.

A group that holds a prefix exports the leading blocks of a hash chain it has (on its device
pool or its host tier) as one shard per rank: rank r's KV heads of every block, an int8
cache's per-token scales with them. A group that lacks the prefix imports the shards into its
host tier, where its next request's prefix lookup finds them as host hits. The hashes are the
same in both groups because they share the cluster's secret and the model fingerprint; what
else the bytes' meaning depends on (the tensor-parallel split, each block tensor's shape, a
float8 cache's per-tensor scales) is in `KVFormat`, checked before any byte is copied.

Torch-free: a router's handle carries a `BlockExport` whose shards are references (Ray
ObjectRefs) between two groups' rank actors; only a group's own process sees the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.hashing import ModelFingerprint


class KVTransferError(RuntimeError):
    """Blocks that cannot move between these two groups (another format, no host tier)."""


@dataclass(frozen=True)
class KVFormat:
    """Everything two groups must share for one's KV blocks to be the other's."""

    fingerprint: ModelFingerprint  # model, revision, dtypes, block size
    tensor_parallel_size: int  # rank r's shard holds the same KV heads in both groups
    row_shapes: tuple[tuple[int, ...], ...]  # per block tensor of a rank, one block's shape (bytes)
    tensor_scales: tuple[float, ...] = ()  # a float8 pool's per-layer K and V scales

    def check_compatible(self, other: KVFormat) -> None:
        """KVTransferError naming the first difference between the holder's format (`other`)
        and this group's."""
        mine, theirs = self.fingerprint, other.fingerprint
        for name in ("model_id", "revision", "dtype", "kv_cache_dtype", "block_size", "weight_dtype"):
            if getattr(mine, name) != getattr(theirs, name):
                raise KVTransferError(
                    f"the holder's {name} is {getattr(theirs, name)!r}, this group's {getattr(mine, name)!r}: "
                    f"its KV blocks are not this group's"
                )
        if self.tensor_parallel_size != other.tensor_parallel_size:
            raise KVTransferError(
                f"the holder has {other.tensor_parallel_size} tensor-parallel ranks, this group "
                f"{self.tensor_parallel_size}: rank r's shard would hold other KV heads"
            )
        if self.row_shapes != other.row_shapes:
            raise KVTransferError(
                f"the holder's blocks are {other.row_shapes} per rank, this group's {self.row_shapes}"
            )
        if self.tensor_scales != other.tensor_scales:
            raise KVTransferError("the holder's float8 KV scales differ from this group's calibration")


@dataclass
class BlockExport:
    """The leading blocks of a chain that a holder has, as one shard per rank.

    A shard is a list of uint8 tensors, one per block tensor of the rank's pool, each
    (len(block_hashes), *row_shape), or a reference to one in another process (a Ray ObjectRef),
    or None where the rank keeps it for a peer to fetch (`export_id`)."""

    format: KVFormat
    block_hashes: tuple[bytes, ...]  # the chain's leading blocks, in order
    shards: list[Any]  # per rank
    export_id: bytes = b""  # 16 bytes naming the shards kept on the holder's other ranks

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


__all__ = ["BlockExport", "KVFormat", "KVTransferError"]
