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
        rid = engine.add_request(prompt, greedy, **kw)
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    last = out
        return last

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
