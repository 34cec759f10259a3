"""What the attention layers need to know about one step's flat batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where one step's tokens come from and where their K/V go (filled by the model runner).

    The step is one flat batch of T tokens from num_seqs sequences. Sequence s owns rows
    query_start_loc[s]:query_start_loc[s+1]; they are its last q_len tokens, at positions
    seq_lens[s] - q_len .. seq_lens[s] - 1. Prefill chunks and decodes mix freely.
    """

    slot_mapping: torch.Tensor  # (T,) int64: block_id * block_size + offset of each token, -1 skips
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32: each sequence's blocks in order
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32: cumulative query lengths
    seq_lens: torch.Tensor  # (num_seqs,) int32: context length including this step's tokens
    max_query_len: int  # longest q_len in the batch (kernels size their grids by it)
    max_seq_len: int  # longest seq_len in the batch

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]
