"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous block of rows.

The vocabulary is padded up to a multiple of tp (padding rows are zero and never chosen:
logits are cut back to vocab_size after the gather). Quantized, both hold int8 rows
(worker/model/layers/quant.py); a tied head multiplies by the embedding's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.layers.linear import copy_checked, shape_of, take
from worker.model.layers.quant import QuantizableLayer
from worker.model.parallel import Collectives, SingleRank


class VocabParallelEmbedding(QuantizableLayer):
    """Token embedding with rows split across ranks; forward: ids (T,) -> (T, hidden).

    Each rank looks up the ids in its row range, zeroes the others, and the all-reduce
    assembles the full embedding.
    """

    vocab_rows = True

    def __init__(self, vocab_size: int, hidden_size: int, comm: Collectives | None = None):
        super().__init__()
        self.comm = comm or SingleRank()
        self.vocab_size = vocab_size
        tp = self.comm.world_size
        self.rows_per_rank = -(-vocab_size // tp)  # ceil: the last rank may hold padding
        self.vocab_start = self.comm.rank * self.rows_per_rank
        self.num_real_rows = max(0, min(vocab_size - self.vocab_start, self.rows_per_rank))
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return self._rows(input_ids)  # (T, hidden)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.rows_per_rank)
        out = self._rows(local.clamp(0, self.rows_per_rank - 1))  # (T, hidden)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.comm.all_reduce(out)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight) if self.quant is None else self.quant.rows(ids)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        rows, hidden = shape_of(loaded)
        if rows != self.vocab_size or hidden != param.shape[1]:
            raise ValueError(f"embedding: checkpoint shape {(rows, hidden)} != {(self.vocab_size, param.shape[1])}")
        n = self.num_real_rows
        if n > 0:
            copy_checked(param.data[:n], take(loaded, 0, self.vocab_start, n), "embedding")


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection with vocabulary rows split across ranks.

    forward: hidden (n, hidden) -> logits (n, vocab_size) float32, gathered from all ranks.
    With tied embeddings the model shares the embedding's parameter instead of loading one.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight) if self.quant is None else self.quant.matmul(hidden)  # (n, rows_per_rank)
        logits = self.comm.all_gather(local, dim=-1)  # (n, rows_per_rank * tp)
        return logits[:, : self.vocab_size].float()

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's parameter (same rows on the same rank)."""
        self.weight = embedding.weight
