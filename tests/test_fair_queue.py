"""Tenants' fair share of one group (worker/engine/fair_queue.py), on the real scheduler and
block manager, and through the engine and both layers above it."""

from __future__ import annotations

import pytest

from tests.factories import make_request, make_scheduler
from worker.config import SchedulerConfig
from worker.engine.request import RequestStatus


def tenant_request(tenant: str, prompt: int = 8, max_tokens: int = 8, **kw):
    r = make_request(prompt, max_tokens, **kw)
    r.tenant = tenant
    return r


def step(sched, token: int = 7):
    """One step with a fake forward that samples `token` for every sampling request."""
    out = sched.schedule()
    sched.update_from_output(out, {s.request.request_id: token for s in out.scheduled if s.samples})
    return out


def first_scheduled(sched, requests, max_steps: int = 2000) -> dict[str, int]:
    """The step at which each request was first scheduled, running the scheduler to the end."""
    first: dict[str, int] = {}
    for i in range(max_steps):
        if not sched.has_unfinished():
            break
        for s in step(sched).scheduled:
            first.setdefault(s.request.request_id, i)
    assert not sched.has_unfinished()
    assert set(first) == {r.request_id for r in requests}
    return first


def test_one_tenant_is_first_come_first_served_as_before():
    """With every request of the one tenant "", admission order is arrival order and nothing is
    counted (the queue is that tenant's FCFS queue)."""
    sched, _ = make_scheduler(num_blocks=256, max_num_seqs=2)
    reqs = [make_request(8, 6) for _ in range(8)]
    for r in reqs:
        sched.add_request(r)
    first = first_scheduled(sched, reqs)
    order = sorted(first, key=lambda rid: (first[rid], rid))
    assert [first[r.request_id] for r in reqs] == sorted(first[r.request_id] for r in reqs)
    assert len(order) == 8 and not sched.waiting.fair and sched.waiting.served == {}


def test_a_burst_delays_its_own_tenant_not_another():
    """Tenant A queues 40 requests, then B sends 3: under first come first served B would wait
    behind all of A's; with tenants, B's are admitted as soon as slots free."""
    firsts = {}
    for fair in (False, True):
        sched, _ = make_scheduler(num_blocks=512, max_num_seqs=4)
        a = [tenant_request("A" if fair else "") for _ in range(40)]
        b = [tenant_request("B" if fair else "") for _ in range(3)]
        for r in a + b:
            sched.add_request(r)
        first = first_scheduled(sched, a + b)
        firsts[fair] = (max(first[r.request_id] for r in b), sorted(first[r.request_id] for r in a))
    b_fifo, a_fifo = firsts[False]
    b_fair, a_fair = firsts[True]
    assert b_fifo > a_fifo[-4]  # behind (nearly) every A request
    assert b_fair < a_fair[12]  # ahead of most of them: a slot's worth of A's steps at most


def test_weights_split_the_tokens_of_two_backlogged_tenants():
    """Both tenants always have work waiting: the tokens processed for each follow the weights
    (3:1) within a few requests' worth."""
    sched, _ = make_scheduler(num_blocks=1024, max_num_seqs=8, tenant_weights={"A": 3.0, "B": 1.0})
    for i in range(600):  # (more than 150 steps serve: both stay backlogged)
        sched.add_request(tenant_request("A" if i % 2 else "B", prompt=8, max_tokens=8))
    done = {"A": 0, "B": 0}
    for _ in range(150):
        for s in step(sched).scheduled:
            done[s.request.tenant] += s.num_tokens
    assert sched.waiting.fair
    assert 2.5 < done["A"] / done["B"] < 3.5, done


def test_a_tenant_under_its_share_of_slots_takes_one_from_the_tenant_over_it():
    """Every slot is A's; B's request preempts A's newest running request (recomputed later,
    mostly from the prefix cache) and runs in the next step, and every request still ends."""
    sched, _ = make_scheduler(num_blocks=512, max_num_seqs=4)
    a = [tenant_request("A", max_tokens=30) for _ in range(6)]
    for r in a:
        sched.add_request(r)
    step(sched)
    assert {r.tenant for r in sched.running} == {"A"} and len(sched.running) == 4
    newest = max(sched.running, key=lambda r: r.arrival_time)
    b = tenant_request("B", max_tokens=4)
    sched.add_request(b)  # (at A's counter: it is first once A's next step is counted)
    outs = [step(sched), step(sched)]
    assert [rid for out in outs for rid in out.preempted_ids] == [newest.request_id]
    assert b.request_id in [s.request.request_id for s in outs[1].scheduled]
    assert newest.status is RequestStatus.PREEMPTED
    first_scheduled(sched, [r for r in a if r.status is not RequestStatus.FINISHED_LENGTH] + [b])


def test_an_idle_tenant_banks_no_credit():
    """A tenant that had nothing in the group comes back at the lowest busy counter, not at the
    counter it left with (which would let it run alone for as long as it was away)."""
    sched, _ = make_scheduler(num_blocks=1024, max_num_seqs=4)
    b0 = tenant_request("B", max_tokens=2)
    sched.add_request(b0)
    for r in [tenant_request("A", max_tokens=8) for _ in range(30)]:
        sched.add_request(r)
    for _ in range(40):
        step(sched)
    assert b0.status.is_finished
    busy = sched.waiting.served["A"]
    sched.add_request(tenant_request("B"))
    assert sched.waiting.served["B"] == busy


def test_a_bad_weight_is_refused_naming_the_tenant():
    with pytest.raises(ValueError, match=r"tenant_weights\['acme'\] must be a number > 0"):
        SchedulerConfig(tenant_weights={"acme": 0})


def test_tenants_reach_the_group_through_the_router_and_share_it():
    """Requests checked and routed for two tenants reach a real engine as those tenants: B's
    two requests, sent after A's twelve, finish before A's last ones, and the engine's stats
    count both tenants' tokens."""
    import asyncio

    from cluster.index import InMemoryPrefixIndex
    from cluster.local_group import LocalGroup
    from pagefleet.llm import engine_config
    from router.router import ModelInfo, Router, RouteRequest
    from worker.sampling_params import SamplingParams

    config = engine_config("builtin", num_blocks=128, max_model_len=256, max_num_seqs=2, cluster_secret="t")
    index = InMemoryPrefixIndex()
    group = LocalGroup(config, index, group_id="fair0")
    try:
        router = Router([group], index, group.hasher, ModelInfo("builtin", 256, 16, "auto", 1024))
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        done: list[str] = []

        async def one(tenant: str, i: int) -> None:
            request = RouteRequest(prompt_token_ids=[3 + i, 5, 7, 9], params=params, tenant=tenant)
            async for out in router.generate(request):
                if out.finished:
                    done.append(tenant)

        async def run() -> None:
            a = [asyncio.create_task(one("A", i)) for i in range(12)]
            await asyncio.sleep(0.05)  # A's burst is queued first
            b = [asyncio.create_task(one("B", 100 + i)) for i in range(2)]
            await asyncio.gather(*a, *b)

        asyncio.run(run())
        assert sorted(done) == ["A"] * 12 + ["B"] * 2
        assert max(i for i, t in enumerate(done) if t == "B") < len(done) - 4  # not behind all of A
        counted = group.engine.stats()["tenant_tokens"]
        assert set(counted) >= {"A", "B"} and counted["A"] > counted["B"] > 0
    finally:
        group.shutdown()


def test_an_over_share_tenant_prefill_per_step_is_bounded_while_another_sends():
    """A's long prompts take 6 of 8 slots; B's 2 requests arrive: while both have requests in the
    group, a step computes at most the bound of A's prompt tokens (fewer by B's), B's prefill
    is not bounded, and without the bound A takes the whole token budget."""
    for bound in (None, 16):
        sched, _ = make_scheduler(
            num_blocks=1024, max_num_seqs=8, max_num_batched_tokens=256, over_share_prefill_tokens=bound
        )
        for _ in range(6):
            sched.add_request(tenant_request("A", prompt=200, max_tokens=40))
        step(sched)
        b = [tenant_request("B", prompt=100, max_tokens=40) for _ in range(2)]
        for r in b:
            sched.add_request(r)
        a_tokens, b_tokens = [], []
        over = []  # whether A held more than its half of the running requests at the step
        for _ in range(10):
            over.append(2 * sum(r.tenant == "A" for r in sched.running) > len(sched.running) + 1)
            out = step(sched)
            prefill = [s for s in out.scheduled if s.is_new or s.num_tokens > 1]
            a_tokens.append(sum(s.num_tokens for s in prefill if s.request.tenant == "A"))
            b_tokens.append(sum(s.num_tokens for s in prefill if s.request.tenant == "B"))
        if bound is None:
            assert max(a_tokens) > 100
        else:
            assert any(over)
            assert all(a + min(bb, bound) <= bound for a, bb, o in zip(a_tokens, b_tokens, over, strict=True) if o)
            assert max(b_tokens) == 100  # (B's prompt in one step)
