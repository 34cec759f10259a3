"""Step inputs built from kept block tables, on rank 0 and on a mirroring rank, against the real
scheduler: through chunked prefill, prefix-cache hits, preemption and finishes, every step's flat
batch must match what the scheduler's own entries say (ScheduledRequest.slot_mapping, the block
manager's live tables, the requests' tokens). Between steps the runners may prepare the next
step ahead, as ModelRunner.run does after a forward; a step that then does not continue (a new
request, a finish, a preemption) must discard that and come out just as right."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from factories import make_request, make_requests, make_scheduler

from worker.exec.model_runner import ModelRunner
from worker.exec.step_codec import decode_step, encode_step

BLOCK = 4


def expected(out):
    """The step's batch, spelled out entry by entry from the scheduler's output."""
    tokens, positions, slots = [], [], []
    for s in out.scheduled:
        tokens += s.request.all_token_ids[s.start : s.end]
        positions += range(s.start, s.end)
        slots += s.slot_mapping(BLOCK)
    width = max(len(s.block_ids) for s in out.scheduled)
    tables = [s.block_ids + [0] * (width - len(s.block_ids)) for s in out.scheduled]
    seq_lens = [s.end for s in out.scheduled]
    return tokens, positions, slots, tables, seq_lens, [s.samples for s in out.scheduled]


def check(inputs, want) -> None:
    tokens, positions, slots, tables, seq_lens, samples = want
    assert inputs.input_ids.tolist() == tokens
    assert inputs.positions.tolist() == positions
    assert inputs.meta.slot_mapping.tolist() == slots
    assert inputs.meta.block_tables.tolist() == tables
    assert inputs.meta.seq_lens.tolist() == seq_lens
    ends = inputs.meta.query_start_loc.tolist()[1:]
    assert inputs.sample_rows.tolist() == [ends[i] - 1 for i, smp in enumerate(samples) if smp]


def drive(sched, rng, ahead: bool = True) -> dict[str, int]:
    """Run the scheduler to the end with two runners (rank 0 plans, the other receives the
    bytes), checking every prepared batch on both against the scheduler's entries. The tokens
    rank 0 'sampled' reach its planner as its runner hands them on after a real forward; with
    `ahead`, both runners then prepare the next step ahead, as after a real forward."""
    cpu = torch.device("cpu")
    rank0, rank1 = ModelRunner(None, BLOCK, cpu), ModelRunner(None, BLOCK, cpu)
    seen = {"steps": 0, "decodes_only": 0, "continues": 0, "discarded": 0}
    sampled_all = None  # (S,) tokens of the last step, when it sampled every sequence
    speculated = False  # the runners prepared a continuation of the last step
    while sched.has_unfinished():
        out = sched.schedule()
        planned = rank0.planner.plan(out)
        received, _ = decode_step(encode_step(planned))
        if out.scheduled:
            want = expected(out)
            a, b = rank0.prepare(planned), rank1.prepare(received)
            check(a, want)
            check(b, want)
            assert list(a.sample_ids) == [s.request.request_id for s in out.scheduled if s.samples]
            seen["decodes_only"] += out.num_batched_tokens == len(out.scheduled)
            seen["continues"] += received.continues
        seen["discarded"] += speculated and not received.continues
        sampled = {s.request.request_id: rng.randrange(256) for s in out.scheduled if s.samples}
        every = planned.samples is None and planned.q_lens is None and out.scheduled
        sampled_all = np.array(list(sampled.values()), dtype=np.int32) if every else None
        speculated = ahead and bool(every)  # a one-token step where every sequence samples
        if speculated:
            rank0.speculate()
            rank1.speculate()
        rank0.planner.commit(sampled_all, ahead=speculated)
        sched.update_from_output(out, sampled)
        seen["steps"] += 1
    out = sched.schedule()  # the last finishes: every kept row is released
    rank0.execute(out)
    assert len(rank0.planner) == 0
    return seen


def test_kept_tables_match_the_scheduler_on_both_ranks():
    sched, _ = make_scheduler(num_blocks=24, block_size=BLOCK, max_num_batched_tokens=20, watermark=0.0)
    rng = random.Random(1)
    shared = [rng.randrange(3, 200) for _ in range(9)]  # a prefix that later requests hit
    for r in make_requests(7, prompt_len=14, max_tokens=12):
        r.all_token_ids[:9] = r.prompt_token_ids[:9] = shared
        sched.add_request(r)
    seen = drive(sched, rng)
    assert sched.num_preemptions > 0 and seen["decodes_only"] > 3 and seen["steps"] > 10
    assert sched.bm.prefix_hits > 0 and seen["discarded"] > 0


@pytest.mark.parametrize("ahead", [True, False])
def test_steady_decodes_continue_across_blocks_and_finishes(ahead):
    """Long runs of decode steps over the same requests (sent as tokens only) cross several
    blocks, and requests that finish at different lengths break and restart those runs (each
    break discards the step prepared ahead)."""
    sched, _ = make_scheduler(num_blocks=64, block_size=BLOCK, max_num_batched_tokens=64)
    for i in range(6):  # they finish one by one
        sched.add_request(make_request(5, max_tokens=8 + 5 * i))
    seen = drive(sched, random.Random(2), ahead)
    assert seen["continues"] > 20 and seen["decodes_only"] > seen["continues"]
    assert seen["discarded"] >= (5 if ahead else 0)


def test_a_decode_prepared_ahead_may_reach_past_the_tables_width():
    """The kept tables grow on demand (16 blocks a row at first); a decode prepared ahead that
    reaches the first block past that width has no column to read yet and must wait for the
    step that brings the block (this crashed an engine at 91 columns)."""
    sched, _ = make_scheduler(num_blocks=64, block_size=BLOCK, max_num_batched_tokens=64)
    sched.add_request(make_request(15 * BLOCK - 2, max_tokens=3 * BLOCK))  # 15 blocks, then 18
    sched.add_request(make_request(5, max_tokens=3 * BLOCK))
    seen = drive(sched, random.Random(3))
    assert seen["continues"] > 5
