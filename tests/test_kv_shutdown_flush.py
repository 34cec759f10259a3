"""A clean shutdown writes what only the host tier and the device hold down to the disk tier.

Without it a restart on the same directory finds only what the host had demoted: a document
still on the device, or whose first blocks were on the host, is a miss from block 0. The block
manager's side (`flush_moves`: the batches, their order, a disk smaller than what is flushed)
is driven directly; the engine's on the built-in model, shut down through `LLM.shutdown`,
then restarted on the directory: its first question on the document takes every full block
from the disk, with the greedy tokens of the first run. A group stopped without it (as a kill
stops it) restores nothing of that document.
"""

from __future__ import annotations

import logging
import random

from factories import make_hasher, make_request

from pagefleet.llm import LLM
from worker.engine.block_manager import BlockManager
from worker.engine.tier_index import TierIndex
from worker.kv_events import DISK, HOST, BlockStored
from worker.sampling_params import SamplingParams

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
SMALL = dict(dtype="float32", block_size=8, num_blocks=24, max_model_len=128, watermark=0.0)
BLOCK_BYTES = 8 * 4096  # a block of 8 tokens of the built-in model in float32
SECRET = "flush-test-secret"


def admit(bm: BlockManager, req) -> None:
    match = bm.match_prefix(req)
    n = req.num_tokens - match.num_tokens
    bm.allocate(req, match, n)
    req.num_computed_tokens = req.num_tokens


def test_the_flush_writes_the_host_then_the_device_in_batches_through_host_slots():
    events: list = []
    host, disk = TierIndex(3, HOST), TierIndex(6, DISK)
    bm = BlockManager(4, BS, make_hasher(BS), events.append, host, disk, fetch=lambda early, f: 0)
    a = make_request(list(range(9)))  # 2 full blocks
    admit(bm, a)
    bm.free(a)
    b = make_request(list(range(100, 116)))  # 4 full blocks: a's 2 go to the host
    admit(bm, b)
    bm.free(b)
    bm.take_moves()
    assert set(host.hashes()) == set(a.block_hashes[:2]) and len(disk) == 0
    device = list(bm.cached_hashes())
    assert len(device) == 4
    events.clear()

    batches = list(bm.flush_moves(batch=2))
    # the host's two blocks; then the device's four, two per batch, each written from its
    # host slot by the batch after the one that saved it
    assert [(len(m.demotes), len(m.saves)) for m in batches] == [(2, 0), (0, 2), (2, 2), (2, 0)]
    assert [h for _, h in batches[0].demotes] == a.block_hashes[1::-1]  # least recently used first
    for before, after in zip(batches[1:], batches[2:], strict=False):
        assert [s for _, s in before.saves] == [s for s, _ in after.demotes]
    saved = [bid for m in batches for bid, _ in m.saves]
    assert sorted(saved) == sorted(bm.cached[h].block_id for h in device)
    on_disk = set(disk.hashes())
    assert on_disk == set(a.block_hashes[:2]) | set(device)
    stored = [h for e in events if isinstance(e, BlockStored) and e.medium == DISK for h in e.block_hashes]
    assert set(stored) == on_disk and len(stored) == 6
    assert list(bm.flush_moves()) == []  # everything is on the disk now

    small = TierIndex(3, DISK)  # a disk smaller than what is flushed keeps the latest written
    bm.disk = small
    batches = list(bm.flush_moves())
    written = [h for m in batches for _, h in m.demotes]
    assert len(written) == 4 and sum(len(m.drops) for m in batches) == 1  # (the host's 3, then 1)
    assert set(small.hashes()) == set(written[-3:])


def documents(n: int, length: int = 80, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(length)] for _ in range(n)]


def tiered(directory) -> LLM:
    """A pool of 24 blocks over a host tier of 12 over a disk tier of 200, on `directory`."""
    options = {**SMALL, "kv_host_bytes": 12 * BLOCK_BYTES, "kv_disk_bytes": 200 * BLOCK_BYTES}
    return LLM("builtin", kv_disk_dir=str(directory), cluster_secret=SECRET, **options)


def test_a_shut_down_engine_restarted_on_its_directory_restores_the_document_from_disk(tmp_path, caplog):
    docs = documents(3, seed=5)
    question = docs[0] + [7, 8, 9]
    first = tiered(tmp_path)
    answer = first.generate([question], GREEDY)[0]
    for d in docs[1:]:  # document 0 partly on the host, partly on the device
        first.generate([d + [5]], GREEDY)
    bm = first.engine.scheduler.bm
    doc0 = first.engine.hasher.hash_prompt(question)[:10]
    assert not set(doc0) & set(bm.disk.hashes())  # nothing of it on the disk yet
    assert set(doc0) & set(bm.host.hashes()) and set(doc0) & set(bm.cached)
    host, device = list(bm.host.hashes()), list(bm.cached)
    with caplog.at_level(logging.WARNING, logger="worker.engine.llm_engine"):
        first.shutdown()
    wrote = f"wrote {len(host)} host and {len(device)} device blocks to the disk tier at shutdown"
    assert wrote in caplog.text
    assert set(doc0) <= set(bm.disk.hashes())
    files = {bytes.fromhex(f.name[:32]) for f in tmp_path.rglob("*.kv")}
    assert files == set(bm.disk.hashes())
    assert first.engine.shutdown() == {}  # (a second call does nothing)

    again = tiered(tmp_path)
    restored = again.generate([question], GREEDY)[0]
    stats = again.engine.stats()
    assert restored.outputs[0].token_ids == answer.outputs[0].token_ids
    assert restored.num_cached_tokens == 80 and stats["kv_disk_hits"] == 80
    assert stats["tokens_computed"] == 3 + GREEDY.max_tokens - 1
    again.engine.executor.shutdown()  # (no flush: as a kill ends it)

    # a flush out of time writes nothing (as a killed process): the document's blocks are gone
    (new,) = documents(1, seed=6)
    third = tiered(tmp_path)
    third.generate([new + [5]], GREEDY)
    assert third.engine.shutdown(within_s=-1.0) == {"host": 0, "device": 0, "batches": 0}
    fourth = tiered(tmp_path)
    assert fourth.generate([new + [6]], GREEDY)[0].num_cached_tokens == 0
    fourth.engine.executor.shutdown()
