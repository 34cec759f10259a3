"""KV quotas in the block manager: a tenant's unreferenced cached blocks count against its quota,
eviction takes from the tenant furthest over its quota (LRU within it), and a tenant under its
quota keeps its blocks against another tenant's flood."""

from factories import check_all_released, make_hasher, make_request, run_to_completion

from worker.engine.block_manager import BlockManager
from worker.kv_events import BlockRemoved

BS = 4  # tokens per block
DOC_BLOCKS = 4


def make_bm(num_blocks, quotas):
    events = []
    return BlockManager(num_blocks, BS, make_hasher(BS), events.append, quotas=quotas), events


def doc(tenant, n):
    """Document `n` of `tenant`: DOC_BLOCKS full blocks and one token more."""
    base = (1 if tenant == "B" else 2) * 1_000_000 + n * 100
    req = make_request(list(range(base, base + DOC_BLOCKS * BS)) + [7])
    req.tenant = tenant
    return req


def run(bm, req):
    """Admit the request with its cached prefix, compute it, free it; returns the cached tokens."""
    match = bm.match_prefix(req)
    n = req.num_tokens - match.num_tokens
    assert bm.can_allocate(req, match, n)
    bm.allocate(req, match, n)
    req.num_computed_tokens = req.num_tokens
    bm.free(req)
    check_idle(bm)
    return match.num_tokens


def check_idle(bm):
    """The per-tenant idle lists hold exactly the free cached blocks, each under its owner."""
    if bm.quotas is None:
        assert not bm._idle
        return
    free_cached = {b.block_id for b in bm.free_queue if b.block_hash is not None}
    listed = {i for idle in bm._idle.values() for i in idle}
    assert listed == free_cached
    for tenant, idle in bm._idle.items():
        assert all(b.tenant == tenant and b.ref_cnt == 0 for b in idle.values())


def removed(events):
    return {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}


def flood(quotas):
    """B caches 3 documents, then A runs documents totalling 10x its quota, B asking about its
    documents every few of A's; returns the block manager, its events and B's hashes."""
    bm, events = make_bm(64, quotas)
    b_docs = [doc("B", i) for i in range(3)]
    for d in b_docs:
        assert run(bm, d) == 0
    b_hashes = {h for d in b_docs for h in d.block_hashes[:DOC_BLOCKS]}
    for i in range(10 * 8 // DOC_BLOCKS):  # A's quota is 8 blocks
        run(bm, doc("A", i))
        if i in (14, 19):  # (15 of A's documents outgrow the pool: LRU would evict B's)
            for j in range(3):  # B's questions hit its documents whole
                assert run(bm, doc("B", j)) == DOC_BLOCKS * BS or quotas is None
    return bm, events, b_hashes


def test_a_flood_evicts_only_its_own_blocks_while_the_other_tenant_is_under_quota():
    bm, events, b_hashes = flood({"A": 8, "B": 16})
    assert not removed(events) & b_hashes  # B's blocks were never evicted
    assert bm.evictions_suffered.get("B", 0) == 0
    assert bm.evictions_caused["A"] == bm.evictions_suffered["A"] > 0  # A's own evictions
    assert bm.idle_blocks("B") == 12
    assert bm.tenant_cached_blocks() == {"A": 64 - 12 - 1, "B": 12}  # (one block of a partial tail)
    for j in range(3):
        assert run(bm, doc("B", j)) == DOC_BLOCKS * BS


def test_without_quotas_the_same_flood_evicts_the_other_tenants_blocks():
    bm, events, b_hashes = flood(None)
    assert removed(events) & b_hashes  # global LRU: what the quotas prevent
    assert bm.evictions_caused == {} and bm.tenant_cached_blocks() == {}


def test_eviction_is_lru_within_the_tenant_and_takes_the_furthest_over_first():
    bm, events = make_bm(18, {"A": 4, "B": 4})  # 16 cached blocks, 2 uncached
    a_docs = [doc("A", i) for i in range(2)]  # 8 blocks: 4 over
    b_docs = [doc("B", i) for i in range(2)]  # 8 blocks: 4 over
    for d in a_docs + b_docs:
        run(bm, d)
    run(bm, a_docs[0])  # A's first document is now its most recently used
    assert bm.idle_blocks("A") == bm.idle_blocks("B") == 8
    c = doc("B", 9)  # needs 5 blocks: the 2 uncached, then 3 evicted
    c.tenant = "C"  # (a tenant with no quota: all its idle blocks are over)
    run(bm, c)
    gone = removed(events)
    # the first eviction ties A and B at 4 over: the first listed (A) loses its LRU block
    # (the tail of its least recently used document), then B is furthest over, and so on
    assert gone & set(a_docs[1].block_hashes[:DOC_BLOCKS])
    assert not gone & set(a_docs[0].block_hashes[:DOC_BLOCKS])
    assert not gone & set(b_docs[1].block_hashes[:DOC_BLOCKS])
    assert gone & set(b_docs[0].block_hashes[:DOC_BLOCKS])
    assert bm.evictions_caused == {"C": 3}
    assert bm.evictions_suffered == {"A": 2, "B": 1}
    assert abs(bm.idle_blocks("A") - bm.idle_blocks("B")) <= 1


def test_pins_and_reset_keep_the_idle_lists_exact():
    bm, _ = make_bm(16, {"B": 4})
    d = doc("B", 0)
    run(bm, d)
    hashes = d.block_hashes[:DOC_BLOCKS]
    assert bm.pin(hashes) == DOC_BLOCKS
    assert bm.idle_blocks("B") == 0  # pinned blocks are not idle: no quota counts them
    check_idle(bm)
    bm.unpin(hashes)
    assert bm.idle_blocks("B") == DOC_BLOCKS
    check_idle(bm)
    assert bm.reset_prefix_cache()
    assert bm.idle_blocks("B") == 0
    check_idle(bm)


def test_kv_quota_is_a_share_or_bytes_checked_at_start_naming_tenant_and_field():
    import pytest

    from router.launch.build import engine_config
    from router.launch.config import ServeConfig
    from worker.config import quota_blocks

    config = ServeConfig.from_mapping(
        {"model": "builtin", "tenants": {"A": {"kv_quota": 0.25}, "B": {"kv_quota": "64KiB", "weight": 2}}}
    )
    assert config.tenants.kv_quotas == {"A": 0.25, "B": 65536}
    engine = engine_config(config, "secret")
    assert engine.cache.tenant_kv_quotas == {"A": 0.25, "B": 65536}
    assert quota_blocks(engine.cache.tenant_kv_quotas, 100, 4096) == {"A": 25, "B": 16}
    for bad in (0, 1.5, -0.1, True, "lots", "1"):
        with pytest.raises(ValueError, match=r"tenants\.A\.kv_quota"):
            ServeConfig.from_mapping({"tenants": {"A": {"kv_quota": bad}}})


def flood_running(quotas):
    """On a scheduler over 32 blocks: B's document (8 blocks) cached and idle, then 3 of A's
    (each 8 blocks of prompt and growing), all submitted at once: more than the pool holds
    beside B's document. Returns B's revisit's cached tokens, the steps A needed, and the
    most of A's requests that ran at once."""
    from worker.config import SchedulerConfig
    from worker.engine.scheduler import Scheduler

    events: list = []
    bm = BlockManager(32, BS, make_hasher(BS), events.append, quotas=quotas)
    sched = Scheduler(SchedulerConfig(max_model_len=256, watermark=0.0), bm)
    b_doc = make_request(list(range(1_000_000, 1_000_000 + 8 * BS)) + [7], max_tokens=2)
    b_doc.tenant = "B"
    sched.add_request(b_doc)
    run_to_completion(sched)
    for i in range(3):
        a = make_request(list(range(2_000_000 + i * 100, 2_000_000 + i * 100 + 8 * BS)) + [7], max_tokens=8)
        a.tenant = "A"
        sched.add_request(a)
    at_once = []
    steps = run_to_completion(sched, on_step=lambda out: at_once.append(len(sched.running)))
    check_all_released(bm)
    again = make_request(list(range(1_000_000, 1_000_000 + 8 * BS)) + [9], max_tokens=2)
    again.tenant = "B"
    return bm.match_prefix(again).num_tokens, len(steps), max(at_once)


def test_a_tenants_idle_blocks_within_its_quota_are_kept_from_the_others_running_requests():
    """The quotas rank idle blocks only: with A's requests holding the rest of the pool, B's
    idle document is all that eviction could take. A request of A is admitted only beside the
    other tenants' idle blocks within their quotas while A has requests running (they will free
    blocks); so B's document survives, and A's third request waits for one of its first two."""
    kept, steps, at_once = flood_running({"A": 4, "B": 8})
    assert kept == 8 * BS and at_once == 2
    lost, lru_steps, lru_at_once = flood_running(None)  # the global LRU admits all three at once
    assert lost < 8 * BS and lru_at_once == 3
    assert steps <= lru_steps + 10  # (A waits a few steps; nothing hangs)
