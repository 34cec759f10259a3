"""Disk-tier reads off the step: a request whose prefix is on the disk waits in the loading
state while a reader thread reads its blocks, and nothing else waits for it.

A tiny random Llama over a SMALL pool, a host tier too small for two documents and a disk
tier (tests/test_kv_tiers.py's set-up), with `kv_disk_read_delay_s` standing for a slow disk.
Outputs are checked against a pool that holds everything; the reads against the disk tier's
own count of files read.
"""

from __future__ import annotations

import pytest
from factories import check_all_released
from test_kv_tiers import BIG, GREEDY, SECRET, SMALL, block_bytes, documents, one_by_one, tokens, visits

from pagefleet.llm import LLM
from worker.kv_events import DEVICE, BlockStored
from worker.model.builtin_model import make_model_dir
from worker.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("disk-async"), seed=1, output_scale=8.0)


def slow_disk(model_dir, directory, delay_s: float = 0.0) -> LLM:
    b = block_bytes(model_dir)
    options = {**SMALL, "kv_host_bytes": 12 * b, "kv_disk_bytes": 200 * b, "kv_disk_read_delay_s": delay_s}
    return LLM(str(model_dir), kv_disk_dir=str(directory), cluster_secret=SECRET, **options)


def run_all(engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return out


def test_a_running_decode_goes_on_while_another_requests_prefix_is_read(model_dir, tmp_path):
    prompts = visits(documents(4, seed=11))
    llm = slow_disk(model_dir, tmp_path, delay_s=0.04)
    one_by_one(llm, prompts[:4])  # document 0 goes down to the disk
    engine = llm.engine
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    engine.add_request([9, 8, 7, 6, 5], long, request_id="decode")
    for _ in range(3):
        engine.step()
    engine.add_request(prompts[4], GREEDY, request_id="revisit")
    during, seen_loading, outputs, cached = 0, False, {}, None
    while engine.has_unfinished():
        loading = engine.stats()["loading"] == 1
        seen_loading |= loading
        for o in engine.step():
            if o.request_id == "decode" and loading:
                during += len(o.outputs[0].token_ids) - outputs.get("decode_n", 0)
                outputs["decode_n"] = len(o.outputs[0].token_ids)
            elif o.request_id == "decode":
                outputs["decode_n"] = len(o.outputs[0].token_ids)
            if o.finished:
                outputs[o.request_id] = o.outputs[0].token_ids
                if o.request_id == "revisit":
                    cached = o.num_cached_tokens
    assert seen_loading, "the revisit never waited in the loading state"
    assert during >= 3, f"the decode made {during} tokens while the disk was read"
    device = one_by_one(LLM(str(model_dir), **BIG), prompts)
    assert outputs["revisit"] == tokens(device)[4]
    assert cached == 80
    stats = engine.stats()
    assert stats["kv_disk_hits"] > 0 and stats["kv_disk_failures"] == 0 and stats["loading"] == 0
    check_all_released(engine.scheduler.bm)
    engine.executor.shutdown()


def test_two_requests_on_one_document_on_the_disk_read_each_block_once(model_dir, tmp_path):
    prompts = visits(documents(4, seed=11))
    reads = {}
    for n in (1, 2):
        directory = tmp_path / f"n{n}"
        llm = slow_disk(model_dir, directory, delay_s=0.01)
        one_by_one(llm, prompts[:4])
        disk = llm.engine.executor.worker.disk_tier
        before = disk.reads
        for i in range(n):
            llm.engine.add_request(prompts[4], GREEDY, request_id=f"q{i}")
        out = run_all(llm.engine)
        reads[n] = disk.reads - before
        device = one_by_one(LLM(str(model_dir), **BIG), prompts)
        assert all(t == tokens(device)[4] for t in out.values()) and len(out) == n
        llm.engine.executor.shutdown()
    assert reads[1] > 0
    assert reads[2] == reads[1], reads


def test_a_damaged_block_in_the_middle_of_the_chain_ends_the_hit_there(model_dir, tmp_path):
    prompts = visits(documents(4, seed=11))
    llm = slow_disk(model_dir, tmp_path)
    events: list = []
    llm.engine.on_kv_events = events.extend
    one_by_one(llm, prompts[:1])
    chain = [h for e in events if isinstance(e, BlockStored) and e.medium == DEVICE for h in e.block_hashes][:10]
    one_by_one(llm, prompts[1:4])
    disk = llm.engine.executor.worker.disk_tier
    on_disk = [i for i, h in enumerate(chain) if i >= 3 and disk.path(h).exists()]
    assert on_disk, "none of the document's later blocks reached the disk"
    bad = on_disk[0]
    f = disk.path(chain[bad])
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))
    last = llm.generate([prompts[4]], GREEDY)[0]
    device = one_by_one(LLM(str(model_dir), **BIG), prompts)
    assert last.outputs[0].token_ids == tokens(device)[4]
    assert last.num_cached_tokens == 8 * bad  # the chain's blocks before the damaged one
    stats = llm.engine.stats()
    assert stats["kv_disk_failures"] == 1
    assert not f.exists()
    llm.engine.executor.shutdown()


def test_a_request_aborted_while_its_blocks_are_read_leaks_nothing(model_dir, tmp_path):
    prompts = visits(documents(4, seed=11))
    llm = slow_disk(model_dir, tmp_path, delay_s=0.05)
    one_by_one(llm, prompts[:4])
    engine, bm = llm.engine, llm.engine.scheduler.bm
    engine.add_request(prompts[4], GREEDY, request_id="revisit")
    engine.step()
    assert engine.stats()["loading"] == 1 and bm.loads_in_flight > 0
    engine.abort("revisit")
    for _ in range(200):
        if not bm.loads_in_flight:
            break
        engine.step()
    assert bm.loads_in_flight == 0 and bm.host.num_held == 0
    assert engine.stats()["loading"] == 0 and not engine.has_unfinished()
    check_all_released(bm)
    again = llm.generate([prompts[4]], GREEDY)[0]  # what the aborted load read is a host hit now
    assert again.num_cached_tokens == 80
    engine.executor.shutdown()
