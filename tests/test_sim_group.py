"""Simulated groups: the real scheduler and block manager in simulated time, real KV events."""

from __future__ import annotations

import pytest

from cluster.cost_model import CostModel
from cluster.index import InMemoryPrefixIndex
from cluster.sim_group import (
    Arrival,
    SimClock,
    SimGroup,
    SimGroupConfig,
    Simulation,
)
from tests.factories import check_all_released
from worker.hashing import BlockHasher, ModelFingerprint

HASHER = BlockHasher(b"sim-secret", ModelFingerprint("m", block_size=16))
COST = CostModel(step_s=1e-3, prefill_token_s=1e-4, decode_seq_s=1e-4)


def make_groups(n: int, index, num_blocks: int = 64) -> list[SimGroup]:
    cfg = SimGroupConfig(num_blocks, 16, cost=COST)
    return [SimGroup(f"g{i}", cfg, HASHER, index) for i in range(n)]


def test_repeat_question_hits_the_cache_and_the_index_sees_the_blocks():
    index = InMemoryPrefixIndex()
    (g,) = make_groups(1, index)
    doc = list(range(200))
    arrivals = [Arrival(f"r{i}", i * 1.0, doc + [900 + i] * 8, 4) for i in range(3)]
    done = Simulation([g], HASHER).run(arrivals, lambda a, h: g)
    assert [d.cached_tokens for d in done] == [0, 192, 192]  # 12 full blocks of the document
    first = done[0]
    # TTFT is the modelled prefill of 208 tokens in one step.
    assert first.ttft_s == pytest.approx(COST.step_seconds(208, 0))
    g.flush()
    chain = HASHER.hash_prompt(doc)
    assert index.match(chain)["g0"].blocks == len(chain)
    check_all_released(g.scheduler.bm)


def test_simulated_time_orders_groups_and_queues():
    (a, b) = make_groups(2, None)
    arrivals = [Arrival(f"r{i}", 0.0, list(range(i, i + 400)), 2) for i in range(4)]
    done = Simulation([a, b], HASHER).run(arrivals, lambda x, h: a if x.request_id < "r2" else b)
    ttft = {d.request_id: d.ttft_s for d in done}
    # The first arrival starts a step at once; the second waits for it, then prefills beside
    # the first one's decode. The groups run side by side in simulated time.
    assert ttft["r0"] == ttft["r2"] == pytest.approx(COST.step_seconds(400, 0))
    assert ttft["r1"] == ttft["r3"] == pytest.approx(ttft["r0"] + COST.step_seconds(400, 1))
    assert {d.group_id for d in done} == {"g0", "g1"}


def test_first_tokens_are_told_once_and_busy_time_is_the_steps():
    (a, b) = make_groups(2, None)
    arrivals = [Arrival(f"r{i}", 0.1 * i, list(range(i, i + 300)), 3) for i in range(4)]
    heard = []
    done = Simulation([a, b], HASHER).run(arrivals, lambda x, h: (a, b)[int(x.request_id[1]) % 2], heard.append)
    assert sorted(r.request_id for r in heard) == sorted(d.request_id for d in done)
    # each heard when its step ended, before its later tokens
    assert all(r.first_token_s is not None and r.first_token_s < r.finished_s for r in heard)
    # a group is busy exactly while its steps run: two requests of 300 tokens each, 3 tokens out
    for g in (a, b):
        steps = 2 * COST.step_seconds(300, 0) + 2 * 2 * COST.step_seconds(0, 1)
        assert g.busy_s == pytest.approx(steps)


def test_cost_model_fit_recovers_a_linear_model():
    truth = CostModel(step_s=2e-3, prefill_token_s=3e-5, decode_seq_s=4e-4)
    samples = [(p, d, truth.step_seconds(p, d)) for p in (0, 128, 1024) for d in (0, 4, 32)]
    fit = CostModel.fit(samples)
    for name in ("step_s", "prefill_token_s", "decode_seq_s"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    with pytest.raises(ValueError, match="prefill_token_s"):
        CostModel(prefill_token_s=-1)


def test_liveness_and_pending_placements_run_on_the_simulated_clock():
    clock = SimClock()
    index = InMemoryPrefixIndex(clock=clock)
    cfg = SimGroupConfig(64, 16, cost=COST)
    g = SimGroup("g0", cfg, HASHER, index, clock)
    doc = list(range(64))
    chain = HASHER.hash_prompt(doc)
    seen = []

    def place(a, hashes):
        seen.append(index.match(hashes).get("g0"))  # the group must look live at every arrival
        index.record_pending("g0", hashes)
        return g

    # Arrivals 10 simulated seconds apart: far beyond the 3 s heartbeat TTL and 2 s pending TTL,
    # yet the whole replay takes milliseconds of wall time.
    arrivals = [Arrival(f"r{i}", 10.0 * i, doc + [900 + i] * 8, 2) for i in range(3)]
    Simulation([g], HASHER, clock=clock).run(arrivals, place)
    assert all(m is not None for m in seen)
    assert seen[1].blocks == len(chain)  # the first request's blocks were published
    assert seen[1].pending_blocks == 0  # its pending placement expired in simulated time
    index.record_pending("g0", chain)
    assert index.match(chain)["g0"].pending_blocks == len(chain)
    clock.now += 2.5
    assert "g0" not in index.match(chain) or index.match(chain)["g0"].pending_blocks == 0
