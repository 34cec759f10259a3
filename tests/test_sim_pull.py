"""KV pulls between simulated groups: the blocks copied into the puller's host tier over a
modelled link, the request waiting for them; a slow or dead link falls back to recompute."""

from __future__ import annotations

import pytest

from cluster.cost_model import CostModel
from cluster.index import InMemoryPrefixIndex
from cluster.sim_group import Arrival, Placed, PullRules, SimGroup, SimGroupConfig, Simulation
from tests.factories import check_all_released
from worker.hashing import BlockHasher, ModelFingerprint

HASHER = BlockHasher(b"sim-secret", ModelFingerprint("m", block_size=16))
COST = CostModel(step_s=1e-3, prefill_token_s=1e-4, decode_seq_s=1e-4, load_block_s=1e-5)
DOC = list(range(320))  # 20 blocks
QUESTION = [900] * 8
INDEX: list[InMemoryPrefixIndex] = []  # the last groups' index


def make_groups(cost: CostModel = COST, host_blocks: int = 64) -> list[SimGroup]:
    cfg = SimGroupConfig(64, 16, cost=cost, host_blocks=host_blocks)
    index = InMemoryPrefixIndex()
    INDEX[:] = [index]
    return [SimGroup(f"g{i}", cfg, HASHER, index) for i in range(2)]


def run(
    g0: SimGroup, g1: SimGroup, wait: bool = False, at: float = 1.0, rules: PullRules | None = None, named: int = 20
):
    """The document asked on g0 at 0, a question about it placed on g1 at `at`, pulling it
    (the placement names its first `named` blocks)."""
    chain = HASHER.hash_prompt(DOC)[:named]
    heard = []
    arrivals = [Arrival("r0", 0.0, DOC + [800] * 8, 2), Arrival("r1", at, DOC + QUESTION, 2)]

    def place(a: Arrival, hashes: list[bytes]):
        if a.request_id == "r0":
            return g0
        return Placed(g1, g0, chain, wait=wait, pulled=heard.append)

    done = Simulation([g0, g1], HASHER, pulls=rules).run(arrivals, place)
    for g in (g0, g1):
        check_all_released(g.scheduler.bm)  # the holder's pins are dropped after the copy
    return {d.request_id: d for d in done}, heard


def test_question_on_a_group_lacking_the_document_pulls_it():
    g0, g1 = make_groups()
    done, heard = run(g0, g1)
    assert heard == [20] and g1.pulls == 1 and g1.pulled_blocks == 20
    assert done["r1"].cached_tokens == 320  # the whole document, restored from the host tier
    assert g1.prefill_tokens == len(QUESTION)  # computed: the question only
    assert g0.prefill_tokens == 328
    # TTFT: the link (latency + 20 blocks' bytes over the bandwidth), then one step that
    # restores 20 blocks and computes the question.
    link = COST.pull_latency_s + 20 * COST.block_bytes / COST.pull_bandwidth
    assert done["r1"].ttft_s == pytest.approx(link + COST.step_seconds(8, 0, loads=20))
    g1.flush()  # the pulled blocks are published as g1's host blocks
    assert INDEX[0].match(HASHER.hash_prompt(DOC))["g1"].tier_blocks == 20


def test_a_slow_link_times_out_and_the_question_recomputes():
    g0, g1 = make_groups(CostModel(step_s=1e-3, prefill_token_s=1e-4, decode_seq_s=1e-4, pull_latency_s=10.0))
    done, heard = run(g0, g1, rules=PullRules(timeout_s=0.5))
    assert heard == [0] and g1.pulls == 0 and g1.pull_failures == 1
    assert done["r1"].cached_tokens == 0 and g1.prefill_tokens == 328
    # it waited the timeout, then computed the whole prompt
    assert done["r1"].ttft_s == pytest.approx(0.5 + COST.step_seconds(328, 0))


@pytest.mark.parametrize("why", ["dead holder", "no host tier"])
def test_a_pull_that_cannot_happen_recomputes_at_once(why):
    g0, g1 = make_groups(host_blocks=0 if why == "no host tier" else 64)
    if why == "dead holder":
        g0.alive = False  # (still steps its own request; its blocks cannot be pulled)
    done, heard = run(g0, g1)
    assert heard == [0] and g1.pulled_blocks == 0 and g1.pull_failures == 1
    assert done["r1"].cached_tokens == 0 and g1.prefill_tokens == 328
    assert done["r1"].ttft_s == pytest.approx(COST.step_seconds(328, 0))


def test_a_cold_document_is_computed_once_and_pulled_after_its_commit():
    g0, g1 = make_groups()
    done, heard = run(g0, g1, wait=True, at=0.0)  # both arrive together; g0 computes the document
    assert heard == [20] and g1.prefill_tokens == len(QUESTION)
    assert g0.prefill_tokens + g1.prefill_tokens == 320 + 8 + 8  # the document once
    # g1's question waited for g0's prefill (polled every 10 ms), then the link
    assert done["r1"].ttft_s > done["r0"].ttft_s


def test_a_cold_wait_named_short_of_the_document_pulls_all_the_holder_committed():
    """A pending placement is indexed at probe positions, so a cold wait may name fewer blocks
    than the document has: once those are committed, the pull takes the holder's whole
    committed lead of the waiting prompt's chain (router/router.py, `_wait_and_pull`)."""
    g0, g1 = make_groups()
    done, heard = run(g0, g1, wait=True, at=0.0, named=12)
    assert heard == [20] and g1.pulled_blocks == 20
    assert done["r1"].cached_tokens == 320 and g1.prefill_tokens == len(QUESTION)


def test_a_pull_of_blocks_the_holders_step_computes_copies_them_when_it_ends():
    """Blocks are indexed when a step that computes them is scheduled: a pull asked for them
    then waits for the step's end (the holder exports between steps), and brings them all."""
    g0, g1 = make_groups()
    done, heard = run(g0, g1, at=0.001)  # g0's step computing the document ends at 0.0338
    assert heard == [20] and g1.pulls == 1 and g1.prefill_tokens == len(QUESTION)
    step = COST.step_seconds(328, 0)
    link = COST.pull_latency_s + 20 * COST.block_bytes / COST.pull_bandwidth
    assert done["r1"].ttft_s == pytest.approx(step - 0.001 + link + COST.step_seconds(8, 0, loads=20))
