"""Pinned blocks in the block manager: held by hash with reference semantics, never evicted
(not to the free queue, not down to the host tier), released by unpin with nothing leaked."""

import pytest
from factories import make_block_manager, make_hasher, make_request

from worker.engine.block_manager import BlockManager
from worker.engine.tier_index import TierIndex
from worker.kv_events import HOST, BlockRemoved


def admit(bm, req):
    match = bm.match_prefix(req)
    n = req.num_tokens - match.num_tokens
    assert bm.can_allocate(req, match, n)
    bm.allocate(req, match, n)
    req.num_computed_tokens = req.num_tokens
    return match


def run_to_end(engine, prompt, params, **kw):
    """Step `engine` until it is idle; the final output of the request made of `prompt`."""
    rid = engine.add_request(prompt, params, **kw)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                last = out
    return last


def check_accounting(bm):
    """Every block's ref count is its requests' references plus its pins; the free queue holds
    exactly the unreferenced blocks."""
    free = {b.block_id for b in bm.free_queue}
    for b in bm.blocks:
        holders = sum(blocks.count(b) for blocks in bm.req_blocks.values())
        pins = bm.pinned.get(b.block_hash, 0) if b.block_hash is not None else 0
        assert b.ref_cnt == holders + pins, f"{b}: {holders} holders + {pins} pins"
        assert (b.block_id in free) == (b.ref_cnt == 0)


def test_a_pinned_document_survives_a_flood_and_unpin_releases_every_block():
    bm, events = make_block_manager(num_blocks=8, block_size=4)
    doc = make_request(list(range(100, 116)) + [1])  # 4 full blocks
    admit(bm, doc)
    bm.free(doc)
    hashes = doc.block_hashes[:4]
    assert bm.pin(hashes) == 4 and bm.num_pinned_blocks == 4
    assert bm.num_free_blocks == 4
    check_accounting(bm)
    for i in range(20):  # a flood of other prompts, each filling every free block
        other = make_request([i * 50 + j for j in range(16)])
        admit(bm, other)
        bm.free(other)
        check_accounting(bm)
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert not removed & set(hashes)
    hit = make_request(list(range(100, 116)) + [7, 8])
    assert admit(bm, hit).num_tokens == 16  # the whole document, from the pinned blocks
    bm.free(hit)
    bm.unpin(hashes)
    check_accounting(bm)
    assert not bm.pinned and not bm.req_blocks
    assert bm.num_free_blocks == bm.num_blocks  # nothing leaked
    assert bm.reset_prefix_cache()  # (refused while anything is held)


def test_two_pins_of_one_block_count_each():
    bm, _ = make_block_manager(num_blocks=6, block_size=4)
    a = make_request(list(range(12)) + [1])  # 3 full blocks
    admit(bm, a)
    bm.free(a)
    short, long = a.block_hashes[:2], a.block_hashes[:3]
    assert bm.pin(short) == 2 and bm.pin(long) == 3
    assert bm.pinned[short[0]] == 2 and bm.pinned[long[2]] == 1
    bm.unpin(long)
    assert bm.num_free_blocks == 4  # the short document still holds its two
    check_accounting(bm)
    bm.unpin(short)
    assert bm.num_free_blocks == 6 and not bm.pinned


def test_pin_holds_only_the_leading_cached_blocks():
    bm, _ = make_block_manager(num_blocks=4, block_size=4)
    a = make_request(list(range(9)))  # 2 full blocks
    admit(bm, a)
    bm.free(a)
    unknown = make_request(list(range(50, 59)))
    unknown.block_hashes = bm.hasher.hash_blocks(unknown.all_token_ids, unknown.hash_root, 0)
    assert bm.pin(unknown.block_hashes) == 0
    assert bm.pin([*a.block_hashes[:2], unknown.block_hashes[0]]) == 2
    bm.unpin(a.block_hashes[:2])
    assert bm.num_free_blocks == 4


def test_a_pinned_block_is_never_written_down_to_the_host_tier():
    events: list = []
    bm = BlockManager(4, 4, make_hasher(4), events.append, TierIndex(8, HOST))
    doc = make_request(list(range(100, 108)) + [1])  # 2 full blocks
    admit(bm, doc)
    bm.free(doc)
    hashes = doc.block_hashes[:2]
    bm.pin(hashes)
    for i in range(6):
        other = make_request([500 + i * 10 + j for j in range(8)])
        admit(bm, other)
        bm.free(other)
    assert bm.host_saves > 0  # the flood's blocks went down to the host
    assert all(h not in bm.host for h in hashes)  # the pinned ones were never evicted, so never saved
    assert all(bm.cached[h].ref_cnt == 1 for h in hashes)
    bm.unpin(hashes)
    check_accounting(bm)


# ---- the engine: a document's prefill pinned, hit, expired, unpinned ----------------------


def test_the_engine_pins_a_prefilled_document_until_its_deadline():
    import time

    from pagefleet.llm import engine_config
    from worker.engine.llm_engine import LLMEngine
    from worker.protocol import Pin, PinRefusedError
    from worker.sampling_params import SamplingParams

    engine = LLMEngine(engine_config("builtin", num_blocks=24, max_model_len=64, block_size=4))
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    doc = [(7 * i + 3) % 200 + 10 for i in range(32)]  # 8 full blocks

    def run(prompt, **kw):
        return run_to_end(engine, prompt, greedy, **kw)

    run(doc, pin=Pin("doc-a", time.time() + 60))
    assert engine.stats()["pinned"] == {"doc-a": 8} and engine.stats()["blocks_pinned"] == 8
    for i in range(12):  # a flood that needs every unpinned block, again and again
        run([(i * 31 + j) % 300 + 5 for j in range(60)])
    assert run(doc + [5, 6, 7]).num_cached_tokens == 32  # the whole document is still there
    with pytest.raises(PinRefusedError):  # pins may hold 8 blocks: 24, less a context's 16
        engine.add_request([9] * 20, greedy, pin=Pin("doc-b", time.time() + 60))
    bm = engine.scheduler.bm
    assert engine.expire_pins(time.time() + 61) == ["doc-a"]
    assert not bm.pinned and bm.num_free_blocks == bm.num_blocks  # nothing leaked
    run(doc, pin=Pin("doc-a", time.time() + 60))
    assert engine.unpin("doc-a") and not engine.unpin("doc-a")
    assert bm.num_free_blocks == bm.num_blocks and engine.stats()["pinned"] == {}


# ---- a pin in the host tier ------------------------------------------------------------


def test_a_document_pinned_in_the_host_tier_leaves_the_device_and_stays_in_the_host():
    """A host pin holds no device block: the document's blocks are evicted from the pool as any
    idle block and written back to the host, which then never evicts them while the pin holds,
    however many other blocks pass through it; the unpinned control is lost from both."""
    events: list = []
    bm = BlockManager(4, 4, make_hasher(4), events.append, TierIndex(4, HOST))
    doc = make_request(list(range(100, 108)) + [1])  # 2 full blocks
    control = make_request(list(range(300, 308)) + [1])
    admit(bm, doc)
    bm.free(doc)
    hashes = doc.block_hashes[:2]
    assert bm.pin(hashes, "host") == 2
    assert bm.num_pinned_blocks == 0 and bm.num_host_pinned_blocks == 2
    assert all(bm.cached[h].ref_cnt == 0 for h in hashes)  # nothing held on the device
    admit(bm, control)
    bm.free(control)
    bm.take_moves()
    for i in range(8):  # a flood through the pool (4 blocks) and the host (4 slots), twice over
        other = make_request([500 + i * 10 + j for j in range(8)] + [1])
        admit(bm, other)
        bm.free(other)
        bm.take_moves()  # (the step is handed over: its host slots may be reused)
    assert all(h not in bm.cached for h in hashes)  # evicted from the device...
    assert all(h in bm.host for h in hashes)  # ...and kept by the host
    assert all(h not in bm.host and h not in bm.cached for h in control.block_hashes[:2])
    removed = {h for e in events if isinstance(e, BlockRemoved) and e.medium == HOST for h in e.block_hashes}
    assert not removed & set(hashes)
    hit = make_request(list(range(100, 108)) + [7])
    match = bm.match_prefix(hit)
    assert match.num_tokens == 8  # the whole document, through the host tier
    bm.unpin(hashes, "host")
    assert bm.num_host_pinned_blocks == 0
    for i in range(8):  # unpinned: the next flood takes its slots like any others
        other = make_request([900 + i * 10 + j for j in range(8)] + [1])
        admit(bm, other)
        bm.free(other)
        bm.take_moves()  # (the step is handed over: its host slots may be reused)
    assert not any(h in bm.host for h in hashes)
    check_accounting(bm)


def test_a_host_pin_without_a_host_tier_is_refused():
    bm, _ = make_block_manager(num_blocks=8, block_size=4)
    doc = make_request(list(range(100, 108)) + [1])
    admit(bm, doc)
    bm.free(doc)
    with pytest.raises(ValueError, match="host tier"):
        bm.pin(doc.block_hashes[:2], "host")


def test_the_engine_pins_a_document_in_its_host_tier_until_its_deadline():
    import time

    from pagefleet.llm import engine_config
    from worker.engine.llm_engine import LLMEngine
    from worker.outputs import CachedTiers
    from worker.protocol import Pin, PinRefusedError
    from worker.sampling_params import SamplingParams

    def engine_with(**kw):
        return LLMEngine(engine_config("builtin", num_blocks=24, max_model_len=64, block_size=4, **kw))

    probe = engine_with()
    block_bytes = probe.stats()["kv_bytes_per_token"] * 4
    engine = engine_with(kv_host_bytes=24 * block_bytes)  # a host tier of 24 blocks
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    doc = [(7 * i + 3) % 200 + 10 for i in range(32)]  # 8 full blocks
    control = [(11 * i + 5) % 200 + 10 for i in range(32)]

    def run(e, prompt, **kw):
        return run_to_end(e, prompt, greedy, **kw)

    run(engine, doc, pin=Pin("doc-a", time.time() + 60, "host"))
    stats = engine.stats()
    assert stats["pinned"] == {"doc-a": 8}
    assert stats["blocks_pinned"] == 0 and stats["blocks_pinned_host"] == 8  # no device block held
    run(engine, control)
    for i in range(12):  # a flood through the pool and, written back, through the host tier
        run(engine, [(i * 31 + j) % 300 + 5 for j in range(60)])
    hit = run(engine, doc + [5, 6, 7])
    assert hit.num_cached_tokens == 32 and hit.cached_tiers == CachedTiers(host=32)  # restored whole
    assert run(engine, control + [5, 6, 7]).num_cached_tokens == 0  # the unpinned prefix is gone
    assert engine.scheduler.bm.num_pinned_blocks == 0
    with pytest.raises(PinRefusedError, match="host tier"):  # at most half the tier: 12 of 24
        engine.add_request(control + doc[:24], greedy, pin=Pin("doc-b", time.time() + 60, "host"))
    with pytest.raises(PinRefusedError, match="no host tier"):
        probe.add_request(doc, greedy, pin=Pin("doc-c", time.time() + 60, "host"))
    assert engine.expire_pins(time.time() + 61) == ["doc-a"]
    assert engine.stats()["blocks_pinned_host"] == 0 and engine.stats()["pinned"] == {}
    bm = engine.scheduler.bm
    assert bm.num_free_blocks == bm.num_blocks  # nothing leaked
