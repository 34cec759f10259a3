import pytest
from factories import check_all_released, check_invariants, make_block_manager, make_request

from worker.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


def admit(bm, req, n=None):
    match = bm.match_prefix(req)
    n = req.num_tokens - match.num_tokens if n is None else n
    assert bm.can_allocate(req, match, n)
    bm.allocate(req, match, n)
    req.num_computed_tokens = match.num_tokens + n
    return match


def test_allocate_and_free_return_every_block():
    bm, _ = make_block_manager(num_blocks=8, block_size=4)
    req = make_request(10)
    admit(bm, req)
    assert len(bm.req_blocks[req.request_id]) == 3  # 10 tokens -> 3 blocks
    assert bm.num_free_blocks == 5
    check_invariants(bm)
    bm.free(req)
    check_all_released(bm)


def test_prefix_hit_reuses_blocks_and_never_covers_last_token():
    bm, events = make_block_manager(num_blocks=16, block_size=4)
    doc = list(range(100, 112))  # 3 full blocks
    a = make_request(doc + [1, 2])
    admit(bm, a)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored == [BlockStored(tuple(a.block_hashes[:3]), None)]
    b = make_request(doc + [3, 4, 5])
    m = admit(bm, b)
    assert m.num_tokens == 12
    assert bm.block_ids(b.request_id)[:3] == bm.block_ids(a.request_id)[:3]
    # exactly the document, nothing more: the last token's block is recomputed
    c = make_request(list(doc))
    assert bm.match_prefix(c).num_tokens == 8
    check_invariants(bm)
    bm.free(a)
    bm.free(b)
    check_all_released(bm)
    assert bm.prefix_hits == 12 and bm.prefix_queries == 14 + 15


def test_cached_blocks_survive_free_until_evicted_lru_tail_first():
    bm, events = make_block_manager(num_blocks=4, block_size=2)
    a = make_request([1, 2, 3, 4, 5, 6, 7])  # 3 full blocks + 1 partial
    admit(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 4
    # the uncached partial block is reused first, then the chain from its tail
    order = [b.block_id for b in bm.free_queue]
    assert order[0] not in [blk.block_id for blk in bm.cached.values()]
    tail_first = [bm.cached[h].block_id for h in reversed(a.block_hashes[:3])]
    assert order[1:] == tail_first
    events.clear()
    b = make_request([9, 9, 9])  # needs 2 blocks: the empty one, then evicts a's tail
    admit(bm, b)
    assert events[0] == BlockRemoved((a.block_hashes[2],))
    # the head of a's chain is still a hit
    assert bm.match_prefix(make_request([1, 2, 3, 4, 8])).num_tokens == 4
    bm.free(b)
    check_all_released(bm)


def test_hit_on_free_cached_block_counts_against_free_budget():
    bm, _ = make_block_manager(num_blocks=3, block_size=2)
    a = make_request([1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a)
    b = make_request([1, 2, 3, 4, 6])
    match = bm.match_prefix(b)
    assert match.num_tokens == 4
    # 2 hit blocks come out of the free queue, 1 new block: exactly the pool
    assert bm.can_allocate(b, match, 1)
    assert not bm.can_allocate(b, match, 1, reserve_blocks=1)


def test_append_slots_grows_and_commits_full_blocks():
    bm, events = make_block_manager(num_blocks=8, block_size=4)
    req = make_request(6)
    admit(bm, req)
    for t in range(5):
        req.append_token(t)
        assert bm.can_append(req, 1)
        bm.append_slots(req, 1)
        req.num_computed_tokens += 1
        check_invariants(bm)
    assert req.num_computed_tokens == 11
    assert len(bm.req_blocks[req.request_id]) == 3
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == req.block_hashes[:2]
    bm.free(req)
    check_all_released(bm)


def test_duplicate_blocks_are_not_cached_twice():
    bm, events = make_block_manager(num_blocks=8, block_size=2)
    c, d = make_request([5, 6, 7]), make_request([5, 6, 8])
    # both looked up before either computed its first block: both miss
    mc, md = bm.match_prefix(c), bm.match_prefix(d)
    bm.allocate(c, mc, 3)
    bm.allocate(d, md, 3)
    assert c.block_hashes[0] == d.block_hashes[0]
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == [c.block_hashes[0]]  # the second copy stays private
    assert bm.req_blocks[d.request_id][0].block_hash is None
    check_invariants(bm)
    bm.free(c)
    bm.free(d)
    check_all_released(bm)
    assert bm.num_cached_blocks == 1


def test_reset_prefix_cache_only_when_idle():
    bm, events = make_block_manager(num_blocks=4, block_size=2)
    a = make_request([1, 2, 3])
    admit(bm, a)
    assert not bm.reset_prefix_cache()
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert events[-1] == AllBlocksCleared()
    assert bm.num_cached_blocks == 0
    check_all_released(bm)


def test_caching_disabled_never_hits_or_emits():
    bm, events = make_block_manager(num_blocks=8, block_size=2, prefix_caching=False)
    a, b = make_request([1, 2, 3, 4, 5]), make_request([1, 2, 3, 4, 5])
    admit(bm, a)
    assert bm.match_prefix(b).num_tokens == 0
    assert events == []
    bm.free(a)
    check_all_released(bm)


def test_bad_sizes():
    from worker.engine.block_manager import BlockManager

    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
