import pytest
from factories import (
    check_all_released,
    check_invariants,
    make_request,
    make_requests,
    make_scheduler,
    run_to_completion,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker.config import SchedulerConfig
from worker.engine.request import RequestStatus
from worker.protocol import QueueFullError


def test_seed_requests_a_b_c_fit_paged_where_contiguous_would_not():
    """Seed 000: A, B, C of 8192, 4096 and 2048 cached tokens at 128 KiB per token hold
    1.75 GiB paged (2 MiB blocks of 16), against 3 GiB reserved contiguously at 8192."""
    bytes_per_token = 2 * 32 * 8 * 128 * 2
    block_bytes = 16 * bytes_per_token
    pool_blocks = (7 << 30) // block_bytes  # the seed's 7 GiB pool
    sched, _ = make_scheduler(num_blocks=pool_blocks, block_size=16, max_model_len=8192, max_num_batched_tokens=2048)
    out_len = 64
    reqs = [make_request(n - out_len, out_len) for n in (8192, 4096, 2048)]
    for r in reqs:
        sched.add_request(r)
    peak = []

    def on_step(out):
        assert out.num_batched_tokens <= 2048
        peak.append(sched.bm.num_blocks - sched.bm.num_free_blocks)

    run_to_completion(sched, on_step=on_step)
    peak_blocks = max(peak)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert [r.num_tokens for r in reqs] == [8192, 4096, 2048]
    assert peak_blocks * block_bytes == int(1.75 * (1 << 30))
    assert 3 * 8192 * bytes_per_token == 3 << 30
    assert sched.num_preemptions == 0
    check_all_released(sched.bm)


def test_chunked_prefill_respects_token_budget_and_decodes_go_first():
    sched, _ = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=10)
    short = make_request(3, max_tokens=5)
    sched.add_request(short)
    out = sched.schedule()
    sched.update_from_output(out, {short.request_id: 1})
    long = make_request(25, max_tokens=2)
    sched.add_request(long)
    spans = []
    while long.num_computed_tokens < 25:
        out = sched.schedule()
        assert out.num_batched_tokens <= 10
        assert out.scheduled[0].request is short  # the decode is first
        spans.append([(s.request.request_id, s.start, s.num_tokens, s.samples) for s in out.scheduled])
        sched.update_from_output(out, {s.request.request_id: 1 for s in out.scheduled if s.samples})
    chunks = [(st, n, smp) for step in spans for rid, st, n, smp in step if rid == long.request_id]
    assert chunks == [(0, 9, False), (9, 9, False), (18, 7, True)]
    run_to_completion(sched)
    check_all_released(sched.bm)


def test_prefix_hit_skips_cached_tokens_and_reports_them():
    sched, _ = make_scheduler(num_blocks=64, block_size=4)
    doc = list(range(200, 220))  # 5 blocks
    a = make_request(doc + [1, 2], max_tokens=3)
    sched.add_request(a)
    run_to_completion(sched)
    b = make_request(doc + [7], max_tokens=3)
    sched.add_request(b)
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.start, s.num_tokens) == (20, 1)
    assert b.num_cached_tokens == 20
    assert sched.bm.block_ids(b.request_id)[:5] == [x for x in s.block_ids[:5]]
    run_to_completion(sched)
    check_all_released(sched.bm)


def test_preemption_recomputes_newest_and_keeps_its_cached_prefix():
    # 6 blocks of 4: two requests of 8-token prompts growing to 16 tokens cannot both fit
    sched, _ = make_scheduler(num_blocks=6, block_size=4, watermark=0.0)
    old, new = make_request(8, max_tokens=8), make_request(8, max_tokens=8)
    sched.add_request(old)
    sched.add_request(new)
    preempted = []

    def on_step(out):
        preempted.extend(out.preempted_ids)
        check_invariants(sched.bm)

    run_to_completion(sched, on_step=on_step)
    assert preempted and set(preempted) == {new.request_id}
    assert old.num_output_tokens == new.num_output_tokens == 8
    assert new.num_preemptions >= 1 and sched.num_preemptions == len(preempted)
    check_all_released(sched.bm)


def test_preempted_request_returns_to_the_head_of_the_queue():
    sched, _ = make_scheduler(num_blocks=6, block_size=4, watermark=0.0, max_num_seqs=2)
    a, b, c = (
        make_request(8, max_tokens=8),
        make_request(8, max_tokens=8),
        make_request(4, max_tokens=1),
    )
    for r in (a, b):
        sched.add_request(r)
    while not sched.num_preemptions:
        out = sched.schedule()
        sched.update_from_output(out, {s.request.request_id: 1 for s in out.scheduled if s.samples})
        if sched.num_waiting == 0 and c.request_id not in sched.requests:
            sched.add_request(c)
    assert list(sched.waiting)[0] is b
    run_to_completion(sched)
    check_all_released(sched.bm)


def test_priority_policy_admits_by_priority_and_preempts_lowest():
    sched, _ = make_scheduler(num_blocks=64, block_size=4, policy="priority", max_num_seqs=1)
    low, high = make_request(4, priority=5), make_request(4, priority=0)
    sched.add_request(low)
    sched.add_request(high)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [high]
    run_to_completion(sched)
    check_all_released(sched.bm)


def test_stop_conditions():
    sched, _ = make_scheduler()
    eos = make_request(4, max_tokens=10, eos=(2,))
    ignore = make_request(4, max_tokens=3, eos=(2,), ignore_eos=True)
    stop_tok = make_request(4, max_tokens=10, stop_token_ids=[5])
    for r in (eos, ignore, stop_tok):
        sched.add_request(r)
    tokens = {eos.request_id: [1, 2, 3], ignore.request_id: [2, 2, 2, 2], stop_tok.request_id: [5]}
    run_to_completion(sched, lambda r: tokens[r.request_id][r.num_output_tokens])
    assert (eos.finish_reason, eos.output_token_ids) == ("stop", [1, 2])
    assert (ignore.finish_reason, ignore.output_token_ids) == ("length", [2, 2, 2])
    assert (stop_tok.finish_reason, stop_tok.stop_reason) == ("stop", 5)
    check_all_released(sched.bm)


def test_abort_frees_blocks_at_once():
    sched, _ = make_scheduler(num_blocks=16, block_size=4)
    running, waiting = make_request(12, max_tokens=20), make_request(60, max_tokens=2)
    sched.add_request(running)
    sched.schedule()
    sched.add_request(waiting)
    used = sched.bm.num_blocks - sched.bm.num_free_blocks
    assert used == 3
    sched.abort([running.request_id, waiting.request_id, "unknown"])
    assert running.finish_reason == waiting.finish_reason == "abort"
    check_all_released(sched.bm)
    assert not sched.has_unfinished()
    assert set(sched.schedule().finished_ids) == {running.request_id, waiting.request_id}


def test_never_fits_and_queue_bound_are_refused_with_reasons():
    sched, _ = make_scheduler(num_blocks=4, block_size=4, max_model_len=64, max_waiting=2)
    with pytest.raises(ValueError, match="context of 64"):
        sched.add_request(make_request(60, max_tokens=10))
    with pytest.raises(ValueError, match="whole pool has 4"):
        sched.add_request(make_request(16, max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request([], max_tokens=4))
    sched.add_request(make_request(4, request_id="x"))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request(4, request_id="x"))
    sched.add_request(make_request(4))
    with pytest.raises(QueueFullError, match="full"):
        sched.add_request(make_request(4))


def test_new_work_waits_instead_of_running_out_of_blocks():
    sched, _ = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    reqs = make_requests(10, prompt_len=10, max_tokens=3)
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert len(out.scheduled) < 10  # the rest wait for blocks
    run_to_completion(sched)
    assert all(r.num_output_tokens == 3 for r in reqs)
    check_all_released(sched.bm)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="lifo")


# ---- property test: random admit / step / finish / abort / preempt / evict ----------------
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 30), st.integers(1, 12)),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("reset")),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(8, 24),
    budget=st.integers(4, 40),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_random_operations_keep_the_books(ops, num_blocks, budget, policy):
    sched, events = make_scheduler(
        num_blocks=num_blocks,
        block_size=4,
        max_num_batched_tokens=budget,
        max_model_len=num_blocks * 4,
        policy=policy,
        watermark=0.05,
    )
    docs = [[d * 100 + i for i in range(24)] for d in range(4)]  # shared documents -> prefix hits
    live = []
    for op in ops:
        if op[0] == "add":
            _, doc, tail, max_tokens = op
            prompt = docs[doc][: min(tail, 24)] + [len(live)]
            req = make_request(prompt, max_tokens=max_tokens, priority=tail % 3)
            try:
                sched.add_request(req)
                live.append(req)
            except ValueError:
                pass
        elif op[0] == "step":
            for _ in range(op[1]):
                out = sched.schedule()
                sched.update_from_output(out, {s.request.request_id: 9 for s in out.scheduled if s.samples})
                check_invariants(sched.bm)
        elif op[0] == "abort" and live:
            sched.abort([live[op[1] % len(live)].request_id])
        elif op[0] == "reset":
            sched.bm.reset_prefix_cache()
        check_invariants(sched.bm)
    run_to_completion(sched)
    check_all_released(sched.bm)
    for r in live:
        assert r.is_finished
        assert r.finish_reason == "abort" or r.num_output_tokens == r.max_tokens
    # the events replay into exactly the cache's contents
    held = set()
    for e in events:
        kind = type(e).__name__
        if kind == "BlockStored":
            assert held.isdisjoint(e.block_hashes)
            held |= set(e.block_hashes)
        elif kind == "BlockRemoved":
            assert set(e.block_hashes) <= held
            held -= set(e.block_hashes)
        else:
            held.clear()
    assert held == set(sched.bm.cached)
