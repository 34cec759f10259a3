"""KV tiers under the device pool: a prefix the pool evicted is restored, not recomputed.

The block manager's side is driven directly (saves, loads, pins, KV events by medium); the
engine's on a tiny random Llama with a pool too small for its documents, against a run whose
pool holds everything and against transformers' greedy output on the same weights: a
restored block must be the very KV the device computed, scales included for 8-bit caches.
"""

from __future__ import annotations

import logging
import random
import shutil

import pytest
import torch
from factories import check_all_released, make_hasher, make_request, transformers_greedy
from transformers import AutoModelForCausalLM

from pagefleet.llm import LLM
from worker.engine.block_manager import BlockManager
from worker.engine.tier_index import TierIndex
from worker.exec.step_codec import FETCH, decode_moves, encode_moves
from worker.kv_events import DEVICE, DISK, HOST, BlockRemoved, BlockStored
from worker.model.builtin_model import make_model_dir
from worker.outputs import CachedTiers
from worker.sampling_params import SamplingParams
from worker.step import KVMoves

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
# a pool of 24 blocks of 8 tokens (192 tokens): each document of 80 tokens takes 11 blocks, so
# a third one evicts the first
SMALL = dict(dtype="float32", block_size=8, num_blocks=24, max_model_len=128, watermark=0.0)
BIG = {**SMALL, "num_blocks": 200}
HOST_BYTES = 1 << 22


def tiered(num_blocks: int = 6, host_slots: int = 8) -> tuple[BlockManager, list]:
    events: list = []
    host = TierIndex(host_slots, HOST)
    return BlockManager(num_blocks, BS, make_hasher(BS), events.append, host), events


def admit(bm: BlockManager, req) -> list[int]:
    match = bm.match_prefix(req)
    n = req.num_tokens - match.num_tokens
    assert bm.can_allocate(req, match, n)
    ids = bm.allocate(req, match, n)
    req.num_computed_tokens = req.num_tokens
    return ids


def of(events, kind, medium) -> list[bytes]:
    return [h for e in events if isinstance(e, kind) and e.medium == medium for h in e.block_hashes]


# ---- the block manager ----------------------------------------------------------------


def test_an_evicted_block_is_saved_to_the_host_and_loaded_back_once():
    bm, events = tiered()
    a = make_request(list(range(13)))  # 3 full blocks, and the last token's
    admit(bm, a)
    bm.free(a)
    assert bm.take_moves() is None  # nothing evicted yet
    b = make_request(list(range(100, 124)))  # 6 blocks: evicts all of a's
    admit(bm, b)
    moves = bm.take_moves()
    evicted = of(events, BlockRemoved, DEVICE)
    assert evicted == a.block_hashes[2::-1]  # tail first
    assert of(events, BlockStored, HOST) == evicted  # written back, in order
    assert [d for d, _ in moves.saves] == [2, 1, 0]  # a's blocks, read before b writes them
    bm.free(b)

    events.clear()
    c = make_request(list(range(13)) + [50, 51])  # a's prefix again
    d = make_request(list(range(13)) + [60])  # and again, in the same step
    ids_c = admit(bm, c)
    assert bm.match_prefix(d).loads == ()  # c's restored blocks are on the device now
    ids_d = admit(bm, d)
    moves = bm.take_moves()
    assert len(moves.loads) == 3 and [b for _, b in moves.loads] == ids_c[:3] == ids_d[:3]
    assert of(events, BlockStored, DEVICE)[:3] == a.block_hashes[:3]  # restored: stored on the device
    assert not of(events, BlockRemoved, HOST)  # the host keeps its copy
    assert bm.host_hits == 12 and c.num_computed_tokens == c.num_tokens
    bm.free(c)
    bm.free(d)
    check_all_released(bm)


def test_a_slot_read_in_a_step_is_not_reused_in_it():
    bm, events = tiered(num_blocks=6, host_slots=3)
    a = make_request(list(range(13)))
    admit(bm, a)
    bm.free(a)
    b = make_request(list(range(100, 124)))
    admit(bm, b)  # a's 3 blocks fill the host
    bm.free(b)
    bm.take_moves()
    # a's prefix comes back while b's 6 blocks are evicted: the host is full and its 3 slots
    # are read in this step, so none of b's blocks may take one
    c = make_request(list(range(13)) + list(range(200, 211)))
    admit(bm, c)
    moves = bm.take_moves()
    assert len(moves.loads) == 3 and moves.saves == []
    assert sorted(s for s, _ in moves.loads) == [0, 1, 2]
    assert not of(events, BlockRemoved, HOST)
    bm.free(c)
    check_all_released(bm)


def test_the_chain_continues_from_the_device_to_the_host():
    bm, events = tiered(num_blocks=5)
    a = make_request(list(range(17)))  # 4 full blocks and one more: the whole pool
    admit(bm, a)
    bm.free(a)  # tail first: a's last block is evicted first
    filler = make_request(list(range(300, 308)))  # 2 blocks: the empty one, then a's 4th
    admit(bm, filler)
    bm.free(filler)
    assert len(bm.take_moves().saves) == 1
    c = make_request(list(range(17)) + [9])
    match = bm.match_prefix(c)
    assert [b.block_hash for b in match.blocks] == c.block_hashes[:3]
    assert [h for _, h, _ in match.loads] == [c.block_hashes[3]]
    ids = admit(bm, c)
    assert bm.take_moves().loads == [(0, ids[3])]
    assert len(set(ids)) == len(ids) == 5
    bm.free(c)
    check_all_released(bm)


def test_a_steps_moves_and_a_fetch_cross_to_other_ranks_whole():
    h = [bytes([i]) * 16 for i in range(5)]
    moves = KVMoves(saves=[(3, 0), (4, 1)], loads=[(2, 7)], demotes=[(5, h[0])], drops=[h[1], h[2]])
    assert decode_moves(encode_moves(moves)) == (moves, [])
    fetches = [(h[3], 6), (h[4], 8)]
    early = KVMoves(demotes=[(1, h[0])])
    assert decode_moves(encode_moves(early, fetches, kind=FETCH)) == (early, fetches)


# ---- the engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiers"), seed=1, output_scale=8.0)


def documents(n: int, length: int = 80, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(length)] for _ in range(n)]


def visits(docs) -> list[list[int]]:
    """Document 0, then three others (which evict it from a SMALL pool), then 0 again."""
    return [docs[0] + [5, 6, 7], docs[1] + [5], docs[2] + [6], docs[3] + [7], docs[0] + [9, 10, 11]]


def one_by_one(llm: LLM, prompts) -> list:
    return [llm.generate([p], GREEDY)[0] for p in prompts]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_host_tiers_copies_move_the_rows_named_in_runs_and_scattered(model_dir, kv_cache_dtype):
    """HostTier.apply on a rank's real pool (an int8 cache's scale rows too): saves and loads in
    one run, in runs of a few rows, and scattered, each row landing where its pair names it."""
    llm = LLM(str(model_dir), **{**SMALL, "kv_host_bytes": HOST_BYTES, "kv_cache_dtype": kv_cache_dtype})
    tier = llm.engine.executor.worker.host_tier
    rng = random.Random(3)
    n = min(tier.num_slots, SMALL["num_blocks"])
    orders = {
        "run": list(range(n)),
        "runs": [b for start in rng.sample(range(0, n - 3, 4), (n - 3) // 4 + 1) for b in range(start, start + 4)],
        "scattered": rng.sample(range(n), n),
    }
    for name, blocks in orders.items():
        slots = rng.sample(range(tier.num_slots), len(blocks)) if name == "scattered" else list(range(len(blocks)))
        for t in (*tier.device_tensors, *tier.host_tensors):
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
        device = [t.clone() for t in tier.device_tensors]
        tier.apply(KVMoves(saves=list(zip(blocks, slots, strict=True))))
        for h, d in zip(tier.host_tensors, device, strict=True):
            assert all(torch.equal(h[s], d[b]) for b, s in zip(blocks, slots, strict=True)), name
        for t in tier.device_tensors:
            t.zero_()
        loads = list(zip(slots, reversed(blocks), strict=True))  # each slot into another block
        tier.apply(KVMoves(loads=loads))
        for h, d in zip(tier.host_tensors, tier.device_tensors, strict=True):
            assert all(torch.equal(d[b], h[s]) for s, b in loads), name
            loaded = {b for _, b in loads}
            assert all(not d[b].any() for b in range(d.shape[0]) if b not in loaded), name


def test_a_document_evicted_from_the_device_is_restored_from_the_host(model_dir):
    prompts = visits(documents(4))
    tier = LLM(str(model_dir), kv_host_bytes=HOST_BYTES, **SMALL)
    restored = one_by_one(tier, prompts)
    none = LLM(str(model_dir), **SMALL)
    recomputed = one_by_one(none, prompts)
    device = one_by_one(LLM(str(model_dir), **BIG), prompts)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = transformers_greedy(hf, prompts, GREEDY.max_tokens)
    assert tokens(restored) == tokens(recomputed) == tokens(device) == expected
    # the last visit's document came back from the host: 10 full blocks of its 80 tokens
    assert recomputed[-1].num_cached_tokens == 0
    assert restored[-1].num_cached_tokens == device[-1].num_cached_tokens == 80
    assert (restored[-1].cached_tiers, device[-1].cached_tiers) == (CachedTiers(host=80), CachedTiers(device=80))
    stats, base = tier.engine.stats(), none.engine.stats()
    assert stats["kv_host_hits"] == 80 and stats["kv_host_saves"] > 0
    block = stats["kv_bytes_per_token"] * stats["block_size"]
    assert (
        stats["kv_host_bytes_loaded"] == 10 * block and stats["kv_host_bytes_saved"] == stats["kv_host_saves"] * block
    )
    assert base["tokens_computed"] - stats["tokens_computed"] == 80  # restored, not recomputed
    assert stats["blocks_free"] == stats["blocks_total"]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_an_8_bit_cache_is_restored_with_its_scales(model_dir, kv_cache_dtype):
    prompts = visits(documents(4, seed=3))
    options = {**SMALL, "kv_cache_dtype": kv_cache_dtype}
    tier = LLM(str(model_dir), kv_host_bytes=HOST_BYTES, **options)
    restored = one_by_one(tier, prompts)
    device = one_by_one(LLM(str(model_dir), **{**options, "num_blocks": 200}), prompts)
    assert tokens(restored) == tokens(device)
    assert restored[-1].num_cached_tokens == 80 and tier.engine.stats()["kv_host_hits"] == 80
    pool = tier.engine.executor.worker.pool
    if kv_cache_dtype == "int8":  # the scales travel: the host tier holds K, V and scales per layer
        assert len(tier.engine.executor.worker.host_tier.host_tensors) == 4 * len(pool.k_caches)


@pytest.mark.parametrize("overlap", [False, True])
def test_concurrent_visits_with_preemption_and_overlap_match_a_pool_that_holds_everything(model_dir, overlap):
    docs = documents(6, length=48, seed=5)
    rng = random.Random(1)
    prompts = [docs[rng.randrange(6)] + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 6))] for _ in range(24)]
    tight = {**SMALL, "num_blocks": 20, "max_num_batched_tokens": 32, "overlap": overlap}
    tier = LLM(str(model_dir), kv_host_bytes=HOST_BYTES, **tight)
    outs = []
    for i in range(0, len(prompts), 6):  # six at a time: they preempt each other
        outs += tier.generate(prompts[i : i + 6], GREEDY)
    device = LLM(str(model_dir), **BIG).generate(prompts, GREEDY)
    assert tokens(outs) == tokens(device)
    stats = tier.engine.stats()
    assert stats["kv_host_hits"] > 0 and stats["preemptions"] > 0
    assert stats["blocks_free"] == stats["blocks_total"]


def test_a_request_aborted_while_its_restored_prefix_is_read_leaks_nothing(model_dir):
    docs = documents(4, seed=7)
    prompts = visits(docs)
    long_tail = docs[0] + list(range(30, 60))  # 30 tokens after the document: 4 steps of 8
    chunked = {**SMALL, "max_num_batched_tokens": 8}
    tier = LLM(str(model_dir), kv_host_bytes=HOST_BYTES, **chunked)
    one_by_one(tier, prompts[:4])
    engine = tier.engine
    rid = engine.add_request(long_tail, GREEDY)
    engine.step()  # admitted: its document restored, its first chunk computed
    assert engine.stats()["kv_host_hits"] == 80
    engine.abort(rid)
    bm = engine.scheduler.bm
    assert bm.num_free_blocks == bm.num_blocks and not bm.req_blocks
    again = tier.generate([prompts[4]], GREEDY)[0]  # the restored blocks serve on the device
    device = one_by_one(LLM(str(model_dir), **BIG), prompts)
    assert again.outputs[0].token_ids == device[-1].outputs[0].token_ids
    assert again.num_cached_tokens == 80


# ---- the disk tier ------------------------------------------------------------------------


def block_bytes(model_dir) -> int:
    stats = LLM(str(model_dir), **{**SMALL, "num_blocks": 16}).engine.stats()
    return stats["kv_bytes_per_token"] * stats["block_size"]


SECRET = "tiers-test-secret"


def disk_tiered(model_dir, directory, host_blocks: int = 12, disk_blocks: int = 200, secret: str = SECRET) -> LLM:
    """A SMALL pool over a host tier too small for two documents, over a disk tier (its
    directory named by the model and `secret`)."""
    b = block_bytes(model_dir)
    options = {**SMALL, "kv_host_bytes": host_blocks * b, "kv_disk_bytes": disk_blocks * b}
    return LLM(str(model_dir), kv_disk_dir=str(directory), cluster_secret=secret, **options)


def check_events_complete(llm: LLM, events: list) -> None:
    """The KV events, replayed per tier, give exactly what each tier holds."""
    held = {DEVICE: set(), HOST: set(), DISK: set()}
    for e in events:
        if isinstance(e, BlockStored):
            assert not held[e.medium] & set(e.block_hashes), "stored twice"
            held[e.medium] |= set(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            assert set(e.block_hashes) <= held[e.medium], "removed what was not stored"
            held[e.medium] -= set(e.block_hashes)
    bm = llm.engine.scheduler.bm
    assert held[DEVICE] == set(bm.cached)
    assert held[HOST] == set(bm.host.hashes()) and held[DISK] == set(bm.disk.hashes())


def test_a_document_evicted_from_the_host_is_restored_from_the_disk(model_dir, tmp_path):
    prompts = visits(documents(4, seed=11))
    tier = disk_tiered(model_dir, tmp_path)
    events: list = []
    tier.engine.on_kv_events = events.extend
    restored = one_by_one(tier, prompts)
    check_events_complete(tier, events)
    device = one_by_one(LLM(str(model_dir), **BIG), prompts)
    assert tokens(restored) == tokens(device)
    stats = tier.engine.stats()
    assert restored[-1].num_cached_tokens == 80
    assert stats["kv_disk_hits"] > 0 and stats["kv_disk_failures"] == 0
    # its blocks the host had lost came from the disk (through the host), the rest from the host
    tiers = restored[-1].cached_tiers
    assert tiers.disk > 0 and tiers.host + tiers.disk == 80 and tiers.device == tiers.pull == 0
    assert stats["kv_host_hits"] == 80  # every restored block reaches the pool through the host
    files = list(tmp_path.rglob("*.kv"))
    assert len(files) == stats["kv_disk_blocks_cached"] > 0
    with pytest.raises(RuntimeError, match="in use"):  # one owner per directory
        disk_tiered(model_dir, tmp_path)
    tier.engine.executor.shutdown()


def test_a_bfloat16_cache_restored_from_the_host_and_the_disk_gives_the_device_runs_tokens(model_dir, tmp_path):
    """In bfloat16 (the default dtype off float32 checkpoints' tests): the restored blocks are
    the very KV the device computed, so greedy outputs equal a pool that holds everything."""
    prompts = visits(documents(4, seed=17))
    b = block_bytes(model_dir) // 2  # (block_bytes is float32's)
    bf16 = {**SMALL, "dtype": "bfloat16"}
    tier = LLM(
        str(model_dir),
        kv_host_bytes=12 * b,
        kv_disk_bytes=200 * b,
        kv_disk_dir=str(tmp_path),
        cluster_secret=SECRET,
        **bf16,
    )
    restored = one_by_one(tier, prompts)
    device = one_by_one(LLM(str(model_dir), **{**bf16, "num_blocks": 200}), prompts)
    assert tokens(restored) == tokens(device)
    tiers = restored[-1].cached_tiers
    assert tiers.host + tiers.disk == 80 and tiers.disk > 0  # through both tiers
    stats = tier.engine.stats()
    assert stats["kv_disk_failures"] == 0 and stats["blocks_free"] == stats["blocks_total"]
    tier.engine.executor.shutdown()


@pytest.mark.parametrize("damage", ["bit flip", "truncated", "missing"])
def test_a_damaged_block_file_is_a_miss_never_wrong_kv(model_dir, tmp_path, damage):
    prompts = visits(documents(4, seed=11))
    tier = disk_tiered(model_dir, tmp_path)
    events: list = []
    tier.engine.on_kv_events = events.extend
    first = one_by_one(tier, prompts[:4])
    for f in tmp_path.rglob("*.kv"):  # every block on the disk
        if damage == "bit flip":
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0x10
            f.write_bytes(bytes(data))
        elif damage == "truncated":
            f.write_bytes(f.read_bytes()[:-5])
        else:
            f.unlink()
    last = tier.generate([prompts[4]], GREEDY)[0]
    device = one_by_one(LLM(str(model_dir), **BIG), prompts)
    assert tokens([*first, last]) == tokens(device)
    stats = tier.engine.stats()
    assert stats["kv_disk_failures"] == 1 and stats["kv_disk_hits"] == 0
    assert last.num_cached_tokens < 80  # what the host still held, at most
    check_events_complete(tier, events)
    if damage != "missing":  # the blocks that failed are forgotten, their files removed
        assert len(list(tmp_path.rglob("*.kv"))) == stats["kv_disk_blocks_cached"]
    tier.engine.executor.shutdown()


def test_a_disk_that_fails_its_writes_degrades_to_the_host_tier_with_one_warning(model_dir, tmp_path, caplog):
    """The disk tier's directory gone from under it (what a full or failing disk looks like to
    the writes): every write after fails, one warning says so, the engine serves on from the
    device and the host, and a block whose write failed is a miss, recomputed to the same tokens."""
    prompts = visits(documents(4, seed=11))
    tier = disk_tiered(model_dir, tmp_path)
    (rank_dir,) = {p.parent for p in tmp_path.rglob("lock")}
    shutil.rmtree(rank_dir)
    rank_dir.write_text("not a directory")  # (root may write anywhere: no permission would stop it)
    with caplog.at_level(logging.WARNING, logger="worker.exec.disk_tier"):
        served = one_by_one(tier, prompts)
    device = one_by_one(LLM(str(model_dir), **BIG), prompts)
    assert tokens(served) == tokens(device)
    stats = tier.engine.stats()
    assert stats["kv_disk_write_failures"] > 0 and stats["kv_disk_bytes_written"] == 0
    assert stats["kv_disk_hits"] == 0 and stats["kv_disk_failures"] >= 1  # the asked-for block: a miss
    warned = [r for r in caplog.records if "could not be written" in r.getMessage()]
    assert len(warned) == 1 and "serving from the host only" in warned[0].getMessage()
    tier.engine.executor.shutdown()


def disk_files(directory) -> dict[bytes, object]:
    return {bytes.fromhex(f.name[:32]): f for f in directory.rglob("*.kv")}


def down_to_disk(docs) -> list[list[int]]:
    """Document 0, then four others: document 0 goes down to the disk; then 0 again."""
    return [docs[0] + [5, 6, 7]] + [d + [5] for d in docs[1:5]] + [docs[0] + [9, 10, 11]]


def test_a_restarted_engine_reopens_its_disk_inventory_and_restores_from_it(model_dir, tmp_path):
    prompts = down_to_disk(documents(5, seed=13))
    first = disk_tiered(model_dir, tmp_path)
    before = one_by_one(first, prompts[:5])
    held = set(first.engine.scheduler.bm.disk.hashes())
    doc0 = first.engine.hasher.hash_prompt(prompts[5])[:10]
    assert set(doc0) <= held  # the document is on the disk, and more besides
    first.engine.executor.shutdown()  # (as a process's end releases the lock)
    # what a process killed mid-write leaves: a torn temporary file, a short block file, a
    # stranger; and a block whose payload rotted (its header whole: a miss only when read)
    files = disk_files(tmp_path)
    other = sorted(held - set(doc0))
    torn, short, rotten = files[other[0]], files[other[1]], files[other[2]]
    torn.rename(torn.with_suffix(".kv.tmp"))
    short.write_bytes(short.read_bytes()[:-7])
    data = bytearray(rotten.read_bytes())
    data[-3] ^= 0x01
    rotten.write_bytes(bytes(data))
    (short.parent / "notes.txt").write_text("not a block")

    again = disk_tiered(model_dir, tmp_path)
    events: list = []
    again.engine.on_kv_events = events.extend
    again.engine.flush_events()
    bm = again.engine.scheduler.bm
    reopened = held - {other[0], other[1]}
    assert set(bm.disk.hashes()) == reopened == set(disk_files(tmp_path))
    assert {p.name for p in short.parent.iterdir()} == {"lock", *(f"{h.hex()}.kv" for h in reopened)}
    assert [(e.medium, set(e.block_hashes)) for e in events] == [(DISK, reopened)]  # the index learns them
    last = again.generate([prompts[5]], GREEDY)[0]
    stats = again.engine.stats()
    assert last.num_cached_tokens == 80 and stats["kv_disk_hits"] == 80
    assert last.cached_tiers == CachedTiers(disk=80)
    assert stats["tokens_computed"] == 3 + GREEDY.max_tokens - 1  # the question, then decodes
    device = one_by_one(LLM(str(model_dir), **BIG), prompts)
    assert tokens([*before, last]) == tokens(device)
    check_events_complete(again, events)
    again.engine.executor.shutdown()


def test_a_reopened_disk_keeps_its_newest_blocks_and_another_secret_none(model_dir, tmp_path):
    prompts = visits(documents(4, seed=17))
    first = disk_tiered(model_dir, tmp_path)
    one_by_one(first, prompts[:4])
    written = list(first.engine.scheduler.bm.disk.hashes())  # oldest first
    first.engine.executor.shutdown()
    assert len(written) > 5
    smaller = disk_tiered(model_dir, tmp_path, disk_blocks=5)
    assert list(smaller.engine.scheduler.bm.disk.hashes()) == written[-5:]
    assert set(disk_files(tmp_path)) == set(written[-5:])
    smaller.engine.executor.shutdown()
    # another secret names other blocks: its directory starts empty, the old one is emptied
    other = disk_tiered(model_dir, tmp_path, secret="another secret")
    assert len(other.engine.scheduler.bm.disk) == 0 and not disk_files(tmp_path)
    assert len({f.parent.parent for f in tmp_path.rglob("lock")}) == 2
    other.engine.executor.shutdown()


# ---- the simulated group ------------------------------------------------------------------


def test_a_simulated_group_restores_from_its_tiers_and_charges_the_loads():
    """The routing simulation's groups run the same tiers, a restore costing load_block_s."""
    from cluster.cost_model import CostModel
    from cluster.sim_group import SimGroup, SimGroupConfig
    from worker.config import SchedulerConfig

    cost = CostModel(step_s=0.0, prefill_token_s=1e-3, decode_seq_s=0.0, load_block_s=1e-4, fetch_block_s=5e-4)
    sched = SchedulerConfig(max_model_len=256)
    hasher = make_hasher(BS)

    def visit_doc0_again(**tiers) -> tuple[float, SimGroup]:
        g = SimGroup("g0", SimGroupConfig(12, BS, sched, cost, **tiers), hasher)
        now, prefill_s = 0.0, 0.0
        for i, first in enumerate([0, 100, 200, 0]):  # document 0, two that evict it, 0 again
            g.submit(f"r{i}", list(range(first, first + 40)) + [250], 1, now)
            while (end := g.start_step(now)) is not None:
                if i == 3:
                    prefill_s += end - now
                now = end
                g.end_step()
        return prefill_s, g

    recompute_s, _ = visit_doc0_again()
    host_s, host = visit_doc0_again(host_blocks=24)  # holds both documents evicted
    disk_s, disk = visit_doc0_again(host_blocks=12, disk_blocks=32)  # holds about one: some go down
    assert recompute_s == pytest.approx(41e-3)  # the whole prompt
    assert host.scheduler.bm.host_hits == 40 and host_s == pytest.approx(1e-3 + 10 * 1e-4)  # 1 token, 10 loads
    fetched = disk.scheduler.bm.disk_hits // BS
    assert fetched > 0 and disk.scheduler.bm.host_hits == 40  # every restored block via the host
    assert disk_s == pytest.approx(host_s + fetched * 5e-4)  # the ones read from the disk first
