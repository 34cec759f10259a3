"""Turns one scheduler step into flat input tensors, runs one forward pass, samples."""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import compress

import numpy as np
import torch

from worker.attention_metadata import AttentionMetadata
from worker.sampler import Sampler, SamplingRow, TokenLogprobs
from worker.scheduler import SchedulerOutput

Sampled = dict[str, tuple[int, TokenLogprobs | None]]  # request id -> (token, logprobs)


class BlockTableRows:
    """The block tables of the running requests, one row each, kept from step to step.

    A table only grows while its request runs (the block manager appends; a preempted request
    comes back `is_new` with a new table), so a step copies only the blocks a row lacks: a
    decode batch touches a row once per block_size steps instead of padding every table into a
    fresh tensor each step. Rows of finished or preempted requests are reused.
    """

    def __init__(self, rows: int = 64, cols: int = 16) -> None:
        self.table = np.zeros((rows, cols), dtype=np.int32)  # (rows, max blocks) block ids
        self.count = np.zeros(rows, dtype=np.int64)  # (rows,) blocks held by each row
        self._row_of: dict[str, int] = {}  # request id -> row
        self._free = list(range(rows - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._row_of)  # rows held by running requests

    def release(self, request_ids) -> None:
        for rid in request_ids:
            row = self._row_of.pop(rid, None)
            if row is not None:
                self._free.append(row)

    def rows_for(self, scheduled: list, rids: list[str], lens: np.ndarray) -> np.ndarray:
        """(num_seqs,) row of each entry, after bringing every row up to its live table."""
        rows = list(map(self._row_of.get, rids))
        if None in rows or True in [s.is_new for s in scheduled]:
            for i, s in enumerate(scheduled):
                if rows[i] is None or s.is_new:
                    rows[i] = self._assign(rids[i])
        rows_a = np.array(rows, dtype=np.int64)
        need = max(int(lens.max()), 1)
        if need > self.table.shape[1]:
            grown = np.zeros((self.table.shape[0], max(need, 2 * self.table.shape[1])), np.int32)
            grown[:, : self.table.shape[1]] = self.table
            self.table = grown
        for i in np.flatnonzero(self.count[rows_a] != lens).tolist():  # new rows, new blocks
            row, ids = rows[i], scheduled[i].block_ids
            have = int(self.count[row])
            have = have if have <= len(ids) else 0  # (never expected: tables only grow)
            self.table[row, have : len(ids)] = ids[have:]
            self.count[row] = len(ids)
        return rows_a

    def _assign(self, rid: str) -> int:
        row = self._row_of.get(rid)
        if row is None:
            if not self._free:
                self._grow()
            row = self._row_of[rid] = self._free.pop()
        self.count[row] = 0  # (re)admitted: its table is new
        self.table[row] = 0  # padding past a table's end reads as block 0, as before
        return row

    def _grow(self) -> None:
        n = self.table.shape[0]
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.count = np.concatenate([self.count, np.zeros_like(self.count)])
        self._free.extend(range(2 * n - 1, n - 1, -1))


def _to(a: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A numpy array as a tensor of `dtype` on `device` (no copy on CPU when dtypes match)."""
    return torch.from_numpy(a).to(device=device, dtype=dtype)


@dataclass
class StepInputs:
    """One step's flat batch (T tokens of S sequences), on the device."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # (n,) int64: row of the last token of each sampling sequence
    sample_ids: list[str]  # request ids of those rows, in order


class ModelRunner:
    """Runs the model of one device over the steps the scheduler hands it."""

    def __init__(self, model: torch.nn.Module, block_size: int, device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}  # seeded requests' RNG streams
        self.tables = BlockTableRows()
        self.forward_started = 0.0  # perf_counter when the latest forward began (inputs ready)

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """The step's flat batch: one list comprehension per field, then numpy for the index
        arithmetic and block tables kept across steps, so that a running request costs tens of
        ns per step rather than a padded table copy."""
        scheduled = out.scheduled
        n = len(scheduled)
        self.tables.release(out.finished_ids)
        self.tables.release(out.preempted_ids)
        rids = [s.request.request_id for s in scheduled]
        lens = np.array([len(s.block_ids) for s in scheduled], dtype=np.int64)  # (S,)
        rows = self.tables.rows_for(scheduled, rids, lens)
        starts = [s.start for s in scheduled]
        q_lens = np.array([s.num_tokens for s in scheduled], dtype=np.int64)  # (S,)
        samples = [s.samples for s in scheduled]
        query_start_loc = np.zeros(n + 1, dtype=np.int64)  # (S+1,)
        np.cumsum(q_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        starts_a = np.array(starts, dtype=np.int64)
        if num_tokens == n:  # decodes (or 1-token chunks): one token per sequence
            tokens = [s.request.all_token_ids[s.start] for s in scheduled]
            seq_idx = np.arange(n)
            positions = starts_a
        else:
            tokens = []
            for s in scheduled:
                tokens += s.request.all_token_ids[s.start : s.start + s.num_tokens]
            seq_idx = np.repeat(np.arange(n), q_lens)  # (T,) sequence of each token
            # position of each token: its sequence's start + its offset within the chunk
            positions = (starts_a - query_start_loc[:-1])[seq_idx] + np.arange(num_tokens)
        block_tables = self.tables.table[rows, : max(int(lens.max()), 1)]  # (S, max_blocks)
        bs = self.block_size
        slots = block_tables[seq_idx, positions // bs] * np.int64(bs) + positions % bs  # (T,)
        sample_rows = (query_start_loc[1:] - 1)[np.array(samples, dtype=bool)]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=_to(slots, torch.int64, dev),
            block_tables=_to(block_tables, torch.int32, dev),
            query_start_loc=_to(query_start_loc, torch.int32, dev),
            seq_lens=_to(starts_a + q_lens, torch.int32, dev),
            max_query_len=int(q_lens.max()),
            max_seq_len=int((starts_a + q_lens).max()),
        )
        return StepInputs(
            input_ids=torch.tensor(tokens, dtype=torch.int64, device=dev),
            positions=_to(positions, torch.int64, dev),
            meta=meta,
            sample_rows=_to(sample_rows, torch.int64, dev),
            sample_ids=list(compress(rids, samples)),
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, sample: bool = True) -> Sampled:
        """Run the step; returns the sampled token (and logprobs) of each sampling request.
        Ranks other than 0 of a tensor-parallel group run the forward with `sample=False`."""
        for rid in out.finished_ids:
            self._generators.pop(rid, None)
        if out.is_empty:
            self.tables.release(out.finished_ids)
            return {}
        inputs = self.prepare(out)
        self.forward_started = time.perf_counter()
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)  # (T, hidden)
        if not inputs.sample_ids:
            return {}
        if not sample:  # the LM head's all-gather still runs on every rank
            self.model.compute_logits(hidden[inputs.sample_rows])
            return {}
        logits = self.model.compute_logits(hidden[inputs.sample_rows])  # (n, vocab) float32
        by_id = {s.request.request_id: s.request for s in out.scheduled}
        rows = [self._row(by_id[rid]) for rid in inputs.sample_ids]
        result = self.sampler(logits, rows)
        return {
            rid: (tok, lp)
            for rid, tok, lp in zip(
                inputs.sample_ids, result.token_ids, result.logprobs, strict=True
            )
        }

    def _row(self, request) -> SamplingRow:
        params = request.sampling_params
        gen = self._generators.get(request.request_id)
        if gen is None and params.seed is not None:
            gen = self._generators[request.request_id] = Sampler.make_generator(params, self.device)
        return SamplingRow(params, request.prompt_token_ids, request.output_token_ids, gen)

    @torch.inference_mode()
    def profile_step(self, num_tokens: int, vocab_size: int) -> None:
        """One forward of `num_tokens` prompt tokens (one sequence, slots skipped): the
        largest step's activation peak, for sizing the pool. Needs a bound pool."""
        num_tokens = max(1, num_tokens)
        n_blocks = -(-num_tokens // self.block_size)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros((1, n_blocks), dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
        )
        ids = torch.randint(0, vocab_size, (num_tokens,), device=self.device)
        hidden = self.model(ids, torch.arange(num_tokens, device=self.device), meta)
        self.model.compute_logits(hidden[-1:])
