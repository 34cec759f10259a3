"""Turns one scheduler step into flat input tensors, runs one forward pass, samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.attention_metadata import AttentionMetadata
from worker.sampler import Sampler, SamplingRow, TokenLogprobs
from worker.scheduler import SchedulerOutput

Sampled = dict[str, tuple[int, TokenLogprobs | None]]  # request id -> (token, logprobs)


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

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        scheduled = out.scheduled
        tokens: list[int] = []
        q_lens, seq_lens, starts, sample_ids = [], [], [], []
        for s in scheduled:
            tokens += s.request.all_token_ids[s.start : s.end]
            q_lens.append(s.num_tokens)
            seq_lens.append(s.end)
            starts.append(s.start)
            if s.samples:
                sample_ids.append(s.request.request_id)
        max_blocks = max(len(s.block_ids) for s in scheduled)
        tables = [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in scheduled]

        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
        query_start_loc = torch.zeros(len(scheduled) + 1, dtype=torch.int64)
        torch.cumsum(q_lens_t, 0, out=query_start_loc[1:])
        seq_idx = torch.repeat_interleave(torch.arange(len(scheduled)), q_lens_t)  # (T,)
        # position of each token: its sequence's start + its offset within the chunk
        positions = torch.tensor(starts, dtype=torch.int64)[seq_idx] + (
            torch.arange(len(tokens)) - query_start_loc[:-1][seq_idx]
        )
        block_tables = torch.tensor(tables, dtype=torch.int64)
        slots = (
            block_tables[seq_idx, positions // self.block_size] * self.block_size
            + positions % self.block_size
        )
        samples = torch.tensor([s.samples for s in scheduled], dtype=torch.bool)
        sample_rows = (query_start_loc[1:] - 1)[samples]

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev),
            block_tables=block_tables.to(device=dev, dtype=torch.int32),
            query_start_loc=query_start_loc.to(device=dev, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
        )
        return StepInputs(
            input_ids=torch.tensor(tokens, dtype=torch.int64, device=dev),
            positions=positions.to(dev),
            meta=meta,
            sample_rows=sample_rows.to(dev),
            sample_ids=sample_ids,
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, sample: bool = True) -> Sampled:
        """Run the step; returns the sampled token (and logprobs) of each sampling request.
        Ranks other than 0 of a tensor-parallel group run the forward with `sample=False`."""
        for rid in out.finished_ids:
            self._generators.pop(rid, None)
        if out.is_empty:
            return {}
        inputs = self.prepare(out)
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
