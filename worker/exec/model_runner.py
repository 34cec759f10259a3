"""Turns one scheduler step into flat input tensors, runs one forward pass, samples.

A step reaches the runner of every rank as a `FlatStep` (worker/exec/step_codec.py: flat arrays of
each sequence's table row, start and length, the input tokens, the block-table entries written
this step). Rank 0 (or a single device) plans it from the scheduler's entries; the other ranks
of a tensor-parallel group decode it from rank 0's message and never build a request object.
Input preparation is then the same handful of numpy operations on every rank, and a decode
step that continues the one before only advances the kept arrays in place. That advance is made
ahead, as soon as the forward has its inputs (`speculate`: on a GPU, while the device computes),
so that a step that does continue only writes its tokens before its forward; a step that does
not simply prepares afresh, leaving the advanced arrays unused.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import compress

import numpy as np
import torch

from worker.exec.persistent_batch import DecodeInputs
from worker.exec.sampler import Masks, RowKinds, Sampler, SampleResult, SamplingRow, kinds_of
from worker.exec.step_codec import BlockTable, FlatStep, RowPlanner
from worker.model.attention_metadata import AttentionMetadata
from worker.outputs import TokenLogprobs
from worker.step import SchedulerOutput

Sampled = dict[str, tuple[int, TokenLogprobs | None]]  # request id -> (token, logprobs)


@dataclass
class SamplingRows:
    """The sampling rows of one step (rank 0), with what the sampler needs to know of them."""

    rows: list[SamplingRow]  # one per sampling sequence, in the step's order
    kinds: RowKinds  # which rows need what beyond an argmax, worked out once


@dataclass
class StepInputs:
    """One step's flat batch (T tokens of S sequences), on the device."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # (n,) int64: row of the last token of each sampling sequence
    sample_ids: Sequence[str]  # request ids of those rows, in order (rank 0 only)


class ModelRunner:
    """Runs the model of one device over the steps the scheduler hands it."""

    def __init__(self, model: torch.nn.Module, block_size: int, device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self._on_cpu = device.type == "cpu"  # tensors share the numpy arrays' memory
        self.sampler = Sampler()
        self.tables = BlockTable()
        # used on rank 0 (or a single device) only
        self.planner = RowPlanner(self.tables, block_size)
        self.forward_started = 0.0  # perf_counter when the latest forward began (inputs ready)
        self._kept: DecodeInputs | None = None  # the last decode batch, for a step that continues it
        self._kept_inputs: StepInputs | None = None  # its tensors
        # the last sampling rows, when no row changes with the output's length (nothing
        # suppressed before min_tokens): a step that `continues` the one before samples the
        # same requests in the same order, with these rows
        self._rows: SamplingRows | None = None
        self._mask_thread: ThreadPoolExecutor | None = None  # fills masks beside a forward

    def plan(self, out: SchedulerOutput) -> FlatStep:
        """Rank 0: the scheduler's step as flat arrays, for prepare here and on the other
        ranks. Steps must be planned and prepared in the same order."""
        return self.planner.plan(out)

    def prepare(self, step: FlatStep) -> StepInputs:
        """The step's flat batch from its arrays: the kept tables take the step's entries,
        then a handful of numpy operations (none per sequence) give every input, each made in
        its tensor's dtype so that on CPU it becomes a tensor without a copy. A step that
        continues the one before advances that step's arrays in place instead."""
        self.tables.apply(step)
        if step.continues:
            return self._advance(step)
        table, bs = self.tables.table, self.block_size
        rows, n = step.rows, step.num_seqs
        starts = step.starts  # (S,) int32
        if step.q_lens is None:  # one token per sequence: the token sits at its start
            query_start_loc = np.arange(n + 1, dtype=np.int32)  # (S+1,)
            positions = starts.astype(np.int64)  # (T,) == (S,)
            seq_lens, max_q = starts + 1, 1
            blocks = table[rows, starts // bs]  # (T,) each token's block
        else:
            query_start_loc = np.zeros(n + 1, dtype=np.int32)  # (S+1,)
            np.cumsum(step.q_lens, out=query_start_loc[1:])
            seq_idx = np.repeat(np.arange(n), step.q_lens)  # (T,) sequence of each token
            # position of each token: its sequence's start + its offset within the chunk
            positions = (starts - query_start_loc[:-1]).astype(np.int64)[seq_idx]
            positions += np.arange(len(seq_idx))
            seq_lens, max_q = starts + step.q_lens, int(step.q_lens.max())
            blocks = table[rows[seq_idx], positions // bs]  # (T,)
        slots = blocks.astype(np.int64)  # (T,) block * block_size + offset
        slots *= bs
        slots += positions % bs
        if step.samples is None:  # (n,) == (S,): the last token of each sequence
            sample_rows = np.arange(n, dtype=np.int64) if max_q == 1 else query_start_loc[1:] - 1
        else:
            sample_rows = (query_start_loc[1:] - 1)[step.samples]
        kept = DecodeInputs(
            rows=rows,
            tokens=step.tokens.astype(np.int64),
            positions=positions,
            slots=slots,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            sample_rows=sample_rows,
            block_tables=self._block_tables(rows),
            max_query_len=max_q,
            max_seq_len=int(seq_lens.max()),
            until=int((bs - positions % bs).min()),
        )
        self._kept = kept if max_q == 1 and step.samples is None else None
        return self._inputs(kept, step.sample_ids)

    def speculate(self) -> None:
        """Once a forward has its inputs (`forward` calls it): advance the kept decode batch to
        the step that would continue it, so that such a step only brings its tokens. A step
        that does not continue prepares afresh and never reads the advanced arrays."""
        kept = self._kept
        if kept is not None and not kept.ahead:
            kept.advance(self.tables.table, self.tables.count, self.block_size)

    def _advance(self, step: FlatStep) -> StepInputs:
        """The kept decode batch one token further (advanced ahead by `speculate`, or now):
        the step's tokens in place, and the slots of positions whose block came with it."""
        kept = self._kept
        assert kept is not None and len(kept.tokens) == len(step.tokens), "nothing to continue"
        if not kept.ahead:
            kept.advance(self.tables.table, self.tables.count, self.block_size)
        kept.ahead = False
        np.copyto(kept.tokens, step.tokens)  # in place: on CPU the tensors share these arrays
        if len(step.table_rows):  # rows gained blocks (the step's entries are applied)
            if len(kept.pending):  # positions at the start of a block the table now holds
                kept.fill_pending(self.tables.table, self.block_size)
            kept.block_tables = self._block_tables(kept.rows)
        assert not len(kept.pending), "a position reached a block that no step brought"
        inputs = self._kept_inputs
        if not self._on_cpu:  # the device's tensors are copies: copy again
            return self._inputs(kept, step.sample_ids)
        if len(step.table_rows):
            inputs.meta.block_tables = self._tensor(kept.block_tables)
        inputs.meta.max_seq_len = kept.max_seq_len
        inputs.sample_ids = step.sample_ids
        return inputs

    def _block_tables(self, rows: np.ndarray) -> np.ndarray:
        width = max(int(self.tables.count[rows].max()), 1)
        return self.tables.table[rows, :width]  # (S, max blocks), a copy

    def _inputs(self, kept: DecodeInputs, sample_ids: Sequence[str]) -> StepInputs:
        meta = AttentionMetadata(
            slot_mapping=self._tensor(kept.slots),
            block_tables=self._tensor(kept.block_tables),
            query_start_loc=self._tensor(kept.query_start_loc),
            seq_lens=self._tensor(kept.seq_lens),
            max_query_len=kept.max_query_len,
            max_seq_len=kept.max_seq_len,
        )
        self._kept_inputs = StepInputs(
            input_ids=self._tensor(kept.tokens),
            positions=self._tensor(kept.positions),
            meta=meta,
            sample_rows=self._tensor(kept.sample_rows),
            sample_ids=sample_ids,
        )
        return self._kept_inputs

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        """`a` as a tensor on the runner's device (on CPU, the same memory)."""
        t = torch.from_numpy(a)
        return t if self._on_cpu else t.to(self.device)

    def execute(self, out: SchedulerOutput, sample: bool = True) -> Sampled:
        """Plan and run the step; returns the sampled token (and logprobs) of each sampling
        request (none with `sample=False`)."""
        return self.run(self.plan(out), out if sample else None)

    def run(self, step: FlatStep, out: SchedulerOutput | None = None) -> Sampled:
        """Run a planned (or received) step. With the scheduler's `out` (rank 0), sample the
        sequences that reach their last token; without (other ranks), only join the LM head's
        all-gather, which runs on every rank. Then make the next step's inputs ahead, in case
        it continues this one. Inference mode is entered here unless the caller holds it (a
        rank's loop does: entering costs microseconds before every forward)."""
        if torch.is_inference_mode_enabled():
            return self._run(step, out)
        with torch.inference_mode():
            return self._run(step, out)

    def _run(self, step: FlatStep, out: SchedulerOutput | None) -> Sampled:
        if not step.num_seqs:
            return {}
        inputs = self.prepare(step)
        rows = None if out is None else self.rows_of(step, out)
        masks = self.start_masks(rows)  # (filled while the forward runs)
        hidden = self.forward(inputs)
        result, tokens = self.sample_tokens(step, inputs, hidden, rows, masks)
        self.advance(rows, result)
        self.commit(tokens)
        return sampled_by_id(inputs.sample_ids, result)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model over a prepared step: (T, hidden). Once the forward has its inputs, the
        kept decode batch advances to the step that would continue it (`speculate`): on a
        GPU the forward's launch has copied them and returns before the device is done, so
        this host work runs while the device computes; on a CPU the forward is over."""
        self.forward_started = time.perf_counter()
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        self.speculate()
        return hidden

    def rows_of(self, step: FlatStep, out: SchedulerOutput) -> SamplingRows:
        """The sampling row of each sequence of `out` that samples in `step`, in order. A row
        holds the request's own (growing) output list, so the rows of a decode batch serve
        every step that continues it until a row's suppressed ids would change."""
        if step.continues and self._rows is not None:
            return self._rows
        entries = out.scheduled
        if step.samples is not None:
            entries = list(compress(entries, step.samples.tolist()))
        rows = [self._row(s.request) for s in entries]
        lasting = not any(s.request.num_output_tokens < s.request.sampling_params.min_tokens for s in entries)
        batch = SamplingRows(rows, kinds_of(rows))
        self._rows = batch if lasting else None
        return batch

    def sample(
        self,
        step: FlatStep,
        inputs: StepInputs,
        hidden: torch.Tensor,
        rows: SamplingRows | None,
        masks: Future[Masks] | None = None,
    ) -> tuple[Sampled, np.ndarray | None]:
        """The LM head over the sampling rows (every rank joins its all-gather), then, with
        `rows` (rank 0), one token per row: (request id -> (token, logprobs), the tokens as an
        (S,) int32 array when every sequence of a one-token step sampled, else None). The
        caller advances the rows when it takes the tokens (`advance`)."""
        result, tokens = self.sample_tokens(step, inputs, hidden, rows, masks)
        return sampled_by_id(inputs.sample_ids, result), tokens

    def sample_tokens(
        self,
        step: FlatStep,
        inputs: StepInputs,
        hidden: torch.Tensor,
        rows: SamplingRows | None,
        masks: Future[Masks] | None = None,
    ) -> tuple[SampleResult | None, np.ndarray | None]:
        """`sample` before its tokens are keyed by request id (the overlapped runner keys them
        on the engine's thread, off the path between two forwards); `masks`: `start_masks`'."""
        if not len(inputs.sample_rows):
            return None, None
        # a decode batch samples every row: the hidden states as they are, not a gathered copy
        every = len(inputs.sample_rows) == hidden.shape[0] and step.q_lens is None
        logits = self.model.compute_logits(hidden if every else hidden[inputs.sample_rows])
        if rows is None:
            return None, None
        result = self.sampler(logits, rows.rows, rows.kinds, None if masks is None else masks.result())
        tokens = None
        if step.samples is None and step.q_lens is None:  # the next step may continue this one
            tokens = result.ids.numpy()  # (S,) int32: the result's own memory
        return result, tokens

    def start_masks(self, rows: SamplingRows | None) -> Future[Masks] | None:
        """The constrained rows' masks for the step about to run, filled on a thread of their
        own while its forward runs (on a CPU the forward holds the cores in torch, without the
        GIL; on a GPU it is queued on the device): their matchers stand at the step's start,
        advanced over every token before it by `advance`. None when no row is constrained."""
        if rows is None or not rows.kinds.constrained:
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="pagefleet-mask")
        return self._mask_thread.submit(Sampler.fill_masks, rows.rows, rows.kinds.constrained)

    def advance(self, rows: SamplingRows | None, result: SampleResult | None) -> None:
        """Once a step's tokens are taken (a forward run ahead: once it is adopted): each row
        one output token further, and each constrained row's grammar over its token, so that
        the rows serve the next step without a word from the engine, whose thread may still be
        appending these tokens while a forward run ahead samples the next ones."""
        if rows is None or result is None:
            return
        for row in rows.rows:
            row.position += 1
        if rows.kinds.constrained:
            ids = result.token_ids
            for i in rows.kinds.constrained:
                rows.rows[i].grammar.accept(ids[i])

    def commit(self, tokens: np.ndarray | None) -> None:
        """After a step's forward and sampling: keep its tokens for the next plan and, when
        every sequence sampled, build the step that continues it (its arrays are advanced)."""
        self.planner.commit(tokens)

    def _row(self, request) -> SamplingRow:
        params = request.sampling_params
        suppressed = ()
        if request.num_output_tokens < params.min_tokens:  # no stop before min_tokens
            eos = () if params.ignore_eos else request.eos_token_ids
            suppressed = (*eos, *params.stop_token_ids)
        return SamplingRow(
            params,
            request.prompt_token_ids,
            request.output_token_ids,
            suppressed,
            request.grammar,
            request.num_output_tokens,
        )

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


def sampled_by_id(sample_ids: Sequence[str], result: SampleResult | None) -> Sampled:
    """A sampler's result keyed by the request id of each row."""
    if result is None:
        return {}
    return dict(zip(sample_ids, zip(result.token_ids, result.logprobs, strict=True), strict=True))
