"""Step inputs built from kept block tables, on rank 0 and on a mirroring rank, against the real
scheduler: through chunked prefill, prefix-cache hits, preemption and finishes, every step's flat
batch must match what the scheduler's own entries say (ScheduledRequest.slot_mapping, the block
manager's live tables, the requests' tokens)."""

from __future__ import annotations

import random

import torch
from factories import make_requests, make_scheduler

from worker.model_runner import ModelRunner
from worker.step_codec import StepDecoder, StepEncoder

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


def test_kept_tables_match_the_scheduler_on_both_ranks():
    sched, _ = make_scheduler(
        num_blocks=24, block_size=BLOCK, max_num_batched_tokens=20, watermark=0.0
    )
    rng = random.Random(1)
    shared = [rng.randrange(3, 200) for _ in range(9)]  # a prefix that later requests hit
    for r in make_requests(7, prompt_len=14, max_tokens=12):
        r.all_token_ids[:9] = r.prompt_token_ids[:9] = shared
        sched.add_request(r)
    cpu = torch.device("cpu")
    rank0, rank1 = ModelRunner(None, BLOCK, cpu), ModelRunner(None, BLOCK, cpu)
    encoder, decoder = StepEncoder(), StepDecoder()
    steps = decodes_only = 0
    while sched.has_unfinished():
        out = sched.schedule()
        mirrored, _ = decoder.decode(encoder.encode(out))
        if out.scheduled:
            want = expected(out)
            a, b = rank0.prepare(out), rank1.prepare(mirrored)
            check(a, want)
            check(b, want)
            assert a.sample_ids == [s.request.request_id for s in out.scheduled if s.samples]
            decodes_only += out.num_batched_tokens == len(out.scheduled)
        sampled = {s.request.request_id: rng.randrange(256) for s in out.scheduled if s.samples}
        sched.update_from_output(out, sampled)
        steps += 1
    assert sched.num_preemptions > 0 and decodes_only > 3 and steps > 10
    assert sched.bm.prefix_hits > 0
    out = sched.schedule()  # the last finishes: every kept row is released
    decoder.decode(encoder.encode(out))
    rank0.execute(out)
    assert len(rank0.tables) == 0 and encoder.num_mirrored == 0
