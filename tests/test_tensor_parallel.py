"""Tensor-parallel groups on a real Ray cluster (two loopback nodes), on CPU with gloo.

Every group's greedy output must equal transformers' (float32) and the in-process TP=1 engine's,
in a run with prefix-cache hits and preemption: models with 4, 2 and 1 KV heads at TP=2
(sharded, one head each, replicated) and 2 KV heads at TP=4 (replicated). Groups start
together once per module (process starts dominate the run time) and serve every test.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
import random
import signal
import threading
import time

import pytest
import torch
from factories import make_requests, make_scheduler, transformers_greedy
from transformers import AutoModelForCausalLM

from cluster.planner import KVShape
from cluster.ray.config import parse_cpu_binding
from cluster.ray.group import RayGroup, RayGroupConfig
from cluster.ray.runtime import ray
from pagefleet.llm import LLM, engine_config
from router.launch.local import router_side
from worker.exec.model_runner import ModelRunner
from worker.exec.step_codec import decode_step, encode_step
from worker.model.builtin_model import make_model_dir
from worker.protocol import EngineDeadError, GenerationRequest
from worker.sampling_params import SamplingParams
from worker.step import SchedulerOutput

KV_HEADS = {"kv4": 4, "kv2": 2, "kv1": 1}
# 12 blocks of 8 tokens (one max_model_len sequence): six requests of ~60 tokens cannot run at once
OPTIONS = dict(  # float32: the reference runs in it
    block_size=8,
    num_blocks=12,
    max_model_len=96,
    watermark=0.0,
    max_num_batched_tokens=32,
    dtype="float32",
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
HANG_TIMEOUT_S = 8.0  # collective timeout of the group used for the hang test
SECRET = "tp-test-secret"  # the kv2 groups hash alike, so that one pulls another's blocks


def prompts_of(lengths, seed, vocab=256):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def workload(seed):
    """Three questions on each of two documents: shared prefixes, more than the pool holds."""
    docs, questions = prompts_of([40, 33], seed), prompts_of([3, 5, 7], seed + 1)
    return [d + q for d in docs for q in questions]


def hf_greedy(model_dir, prompts, n):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return transformers_greedy(hf, prompts, n)


def settled_stats(group, timeout_s=15.0):
    """Rank 0's stats once the engine is idle (stats refresh after the step that finished the
    last request, a moment after its output went out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = group.engine_stats()
        if s["running"] == s["waiting"] == 0:
            return s
        time.sleep(0.05)
    return group.engine_stats()


async def stream_all(group, prompts, params=GREEDY):
    async def one(p):
        outs = [o async for o in group.generate(GenerationRequest(p, params))]
        assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == len(outs[-1].token_ids)
        return outs[-1].token_ids

    return list(await asyncio.gather(*map(one, prompts)))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {
        name: make_model_dir(
            tmp_path_factory.mktemp(name),
            arch="llama",
            seed=11 + kv,
            output_scale=8.0,
            num_attention_heads=4,
            num_key_value_heads=kv,
        )
        for name, kv in KV_HEADS.items()
    }


@pytest.fixture(scope="module")
def expected(model_dirs):
    """Per model: (its workload, transformers' greedy tokens, the TP=1 engine's tokens)."""
    out = {}
    for i, (name, path) in enumerate(model_dirs.items()):
        prompts = workload(seed=10 * i)
        tp1 = LLM(str(path), **OPTIONS)
        ours = [[o.token_ids for o in tp1.generate(prompts, GREEDY)] for _ in range(2)]
        assert tp1.stats()["preemptions"] > 0 and tp1.stats()["prefix_cache_hits"] > 0
        out[name] = (prompts, hf_greedy(path, prompts, GREEDY.max_tokens), ours)
    return out


@pytest.fixture(scope="module")
def tier_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def groups(request, ray_runtime, model_dirs, tier_dir):
    """kv4 at TP=2 on node_a, kv2 at TP=2 on node_b, kv2 at TP=4 on node_a, and kv1 at TP=2
    through pagefleet.LLM(tensor_parallel_size=2) wherever it fits, all starting at once while
    this process computes the expected outputs."""
    node_a, node_b = ray_runtime.node_labels

    def start(name, tp, label, timeout_s=60.0, cpu_binding=None, group_id=None, **options):
        gc = RayGroupConfig(
            tensor_parallel_size=tp,
            bundle_resources={label: 1},
            collective_timeout_s=timeout_s,
            heartbeat_s=0.5,
            cpu_binding=cpu_binding,
        )
        return RayGroup(engine_config(model_dirs[name], **OPTIONS, **options), gc, group_id=group_id, wait=False)

    started, llm, llm_started = {}, None, None
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        last = (os.cpu_count() or 1) - 1
        started["kv4"] = start("kv4", 2, node_a, cpu_binding=f"0|{min(1, last)}")  # bound ranks
        started["kv2"] = start("kv2", 2, node_b, cluster_secret=SECRET)
        started["kv2-tp4"] = start("kv2", 4, node_a, timeout_s=HANG_TIMEOUT_S, cluster_secret=SECRET)
        # (its disk reads slowed: a read stays in flight while another request decodes)
        # (under its own id: its disk tier in tier_dir/kv2-tiers, which a restart reopens)
        started["kv2-tiers"] = start(
            "kv2", 2, node_b, group_id="kv2-tiers", **tiers(tier_dir), kv_disk_read_delay_s=READ_DELAY_S
        )
        llm_started = pool.submit(LLM, str(model_dirs["kv1"]), tensor_parallel_size=2, **OPTIONS)
        request.getfixturevalue("expected")  # meanwhile, transformers and TP=1 here
        for g in started.values():
            g.wait_ready()
        llm = llm_started.result()
        yield {**started, "kv1": llm.group}, llm
    finally:
        for g in started.values():
            g.shutdown()
        if llm is None and llm_started is not None and llm_started.exception() is None:
            llm = llm_started.result()  # started, though something else failed
        if llm is not None:
            llm.shutdown()
        pool.shutdown()


def node_of(label):
    (node,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and label in n["Resources"]]
    return node


# ---- the step messages, against the real scheduler ------------------------------------
def test_step_codec_carries_the_scheduler_through_preemption_and_finishes():
    sched, _ = make_scheduler(num_blocks=24, block_size=4, max_num_batched_tokens=48, watermark=0.0)
    for r in make_requests(6, prompt_len=30, max_tokens=9):
        sched.add_request(r)
    cpu = torch.device("cpu")
    rank0, rank1 = ModelRunner(None, 4, cpu), ModelRunner(None, 4, cpu)
    empty = len(encode_step(ModelRunner(None, 4, cpu).plan(SchedulerOutput())))  # the header
    rng, steps, decode_bytes, other_bytes, sampled_all = random.Random(0), 0, [], [], None
    while sched.has_unfinished():
        out = sched.schedule()
        planned = rank0.planner.plan(out)
        message = encode_step(planned)
        received, _ = decode_step(message)
        if out.scheduled:
            rank0.prepare(planned)
            inputs = rank1.prepare(received)  # the other rank's batch, from the bytes alone
            ends = inputs.meta.query_start_loc.tolist()
            for i, s in enumerate(out.scheduled):
                seq = slice(ends[i], ends[i + 1])
                assert inputs.input_ids[seq].tolist() == s.request.all_token_ids[s.start : s.end]
                assert inputs.positions[seq].tolist() == list(range(s.start, s.end))
                assert inputs.meta.slot_mapping[seq].tolist() == s.slot_mapping(4)
                assert inputs.meta.block_tables[i, : len(s.block_ids)].tolist() == s.block_ids
            want = [ends[i + 1] - 1 for i, s in enumerate(out.scheduled) if s.samples]
            assert inputs.sample_rows.tolist() == want
        if out.scheduled and not any(s.is_new for s in out.scheduled):
            n, tokens = len(out.scheduled), out.num_batched_tokens
            blocks = sum(len(s.new_block_ids) for s in out.scheduled)
            # bytes a request, besides this step's tokens and new blocks (the diffs themselves)
            other_bytes.append((len(message) - empty - 4 * tokens - 12 * blocks) / n)
            if tokens == n:
                decode_bytes.append((len(message) - empty - 12 * blocks) / n)
        sampled = {s.request.request_id: rng.randrange(256) for s in out.scheduled if s.samples}
        every = out.scheduled and planned.samples is None and planned.q_lens is None
        sampled_all = torch.tensor(list(sampled.values()), dtype=torch.int32).numpy() if every else None
        rank0.planner.commit(sampled_all, ahead=False)  # (as after a forward, without the step ahead)
        sched.update_from_output(out, sampled)
        steps += 1
    assert sched.num_preemptions > 0 and steps > 10
    # running requests travel as diffs: besides the tokens a step computes and the blocks it
    # adds, a few bytes each, not their 30+ tokens of context; in a decode batch 12 bytes a
    # request at most (row, start, token), 4 (its token) when the step continues the one before
    assert other_bytes and max(other_bytes) < 16, other_bytes
    assert decode_bytes and max(decode_bytes) <= 12 and min(decode_bytes) <= 4, decode_bytes
    rank0.plan(sched.schedule())  # the last finishes free their rows
    assert len(rank0.planner) == 0


def test_tensor_parallel_size_that_cannot_split_the_heads_is_refused(model_dirs):
    config = engine_config(model_dirs["kv2"], **OPTIONS)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide .* 4 attention"):
        RayGroup(config, RayGroupConfig(tensor_parallel_size=3))
    many_heads = make_model_dir(
        model_dirs["kv2"].parent / "h6kv2",
        seed=1,
        num_attention_heads=6,
        num_key_value_heads=2,
        hidden_size=48,
    )
    with pytest.raises(ValueError, match=r"cannot split the model's 2 KV heads: tp=3 is not a multiple"):
        RayGroup(engine_config(many_heads, **OPTIONS), RayGroupConfig(tensor_parallel_size=3))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(model_dirs["kv2"]), tensor_parallel_size=0)


# ---- exactness at every TP size --------------------------------------------------------
@pytest.mark.parametrize("name", ["kv4", "kv2", "kv1"])
def test_tp2_equals_tp1_and_transformers_with_prefix_hits_and_preemption(name, groups, expected):
    by_name, llm = groups
    prompts, want, tp1 = expected[name]
    if name == "kv1":  # through pagefleet.LLM(tensor_parallel_size=2)
        rounds = [[o.token_ids for o in llm.generate(prompts, GREEDY)] for _ in range(2)]
    else:
        rounds = [asyncio.run(stream_all(by_name[name], prompts)) for _ in range(2)]
    assert rounds[0] == rounds[1] == want == tp1[0] == tp1[1]
    assert len({tuple(t) for t in want}) > 1
    s = settled_stats(by_name[name])
    assert s["preemptions"] > 0 and s["prefix_cache_hits"] > 0, s
    assert s["blocks_free"] == s["blocks_total"] and s["running"] == s["waiting"] == 0


TIER_SECRET = SECRET  # (a restarted group names its blocks alike; a puller as its holder)
READ_DELAY_S = 0.06  # added to each block read from kv2-tiers' disk tier


def tiers(directory) -> dict:
    """A host tier of 6 blocks over a disk tier, per rank (kv2 at TP=2: one KV head of 16
    float32 values per layer and rank, 2 layers: 2 KiB a block of 8 tokens)."""
    block = 2 * 2 * 1 * 16 * 4 * 8
    return dict(
        kv_host_bytes=6 * block, kv_disk_bytes=100 * block, kv_disk_dir=str(directory), cluster_secret=TIER_SECRET
    )


def test_tp2_restores_evicted_documents_from_the_host_and_disk_tiers(groups, model_dirs):
    """Every rank saves, demotes, fetches and loads its own shard, as rank 0 decides."""
    docs = prompts_of([40] * 4, seed=77)
    prompts = [docs[0] + [5, 6], docs[1] + [5], docs[2] + [6], docs[3] + [7], docs[0] + [9, 10]]
    group = groups[0]["kv2-tiers"]
    got = [asyncio.run(stream_all(group, [p]))[0] for p in prompts]
    tp1 = LLM(str(model_dirs["kv2"]), **OPTIONS)
    assert got == [tp1.generate([p], GREEDY)[0].token_ids for p in prompts]
    s = settled_stats(group)
    assert s["kv_host_hits"] == 40 and s["kv_disk_hits"] > 0 and s["kv_disk_failures"] == 0, s


def test_tp2_decodes_on_while_a_requests_prefix_is_read_from_the_disk(groups, model_dirs):
    """A question whose document is on the disk waits in the loading state while both ranks
    read its blocks (slowed by `kv_disk_read_delay_s`); a request decoding meanwhile makes
    tokens; the question's greedy tokens are the untiered TP=1 engine's; nothing is left held."""
    group = groups[0]["kv2-tiers"]
    docs = prompts_of([40] * 5, seed=79)
    for d in docs:  # document 0 goes down to the disk
        asyncio.run(stream_all(group, [d + [5]]))
    question, short = docs[0] + [9, 10], SamplingParams(temperature=0.0, max_tokens=8)
    decode_prompt, long = [9, 8, 7], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    before = settled_stats(group)
    decoded: list[float] = []  # when each of the decode's tokens came
    seen_loading: set[int] = set()

    async def run() -> tuple[list[int], list[int], float, float]:
        async def decode() -> list[int]:
            async for o in group.generate(GenerationRequest(decode_prompt, long)):
                decoded.extend([time.monotonic()] * len(o.new_token_ids))
            return o.token_ids

        task = asyncio.create_task(decode())
        while len(decoded) < 2:
            await asyncio.sleep(0.002)
        asked, first = time.monotonic(), None
        async for o in group.generate(GenerationRequest(question, short)):
            if first is None and o.new_token_ids:
                first = time.monotonic()
        return await task, o.token_ids, asked, first

    def watch(done: threading.Event) -> None:
        while not done.is_set():
            seen_loading.add(group.engine_stats()["loading"])
            time.sleep(0.01)

    done = threading.Event()
    watcher = threading.Thread(target=watch, args=(done,))
    watcher.start()
    try:
        decode_tokens, answer, asked, first = asyncio.run(run())
    finally:
        done.set()
        watcher.join()
    s = settled_stats(group)
    read = s["kv_disk_hits"] - before["kv_disk_hits"]
    assert read == 40 and s["kv_disk_failures"] == before["kv_disk_failures"], s
    assert 1 in seen_loading, seen_loading
    assert first - asked >= 5 * READ_DELAY_S  # the question waited for its five blocks' reads
    during = sum(asked <= t < first for t in decoded)
    assert during >= 3, f"the decode made {during} tokens while the disk was read"
    tp1 = LLM(str(model_dirs["kv2"]), **OPTIONS)
    assert answer == tp1.generate([question], short)[0].token_ids
    assert decode_tokens == tp1.generate([decode_prompt], long)[0].token_ids
    assert s["blocks_free"] == s["blocks_total"] and s["running"] == s["waiting"] == s["loading"] == 0, s
    assert s["kv_loads_in_flight"] == 0 and s["kv_host_blocks_held"] == 0, s


def test_tp2_pulls_a_document_from_another_tp2_group_rank_by_rank(groups, model_dirs):
    """kv2-tiers pulls a document kv2 computed: each rank fetches its own KV head's shard from
    the holder's rank of the same number, and the question is served from them; a TP=4 group
    is refused the same blocks, by name."""
    by_name = groups[0]
    holder, puller = by_name["kv2"], by_name["kv2-tiers"]
    hasher = router_side(engine_config(model_dirs["kv2"], **OPTIONS, cluster_secret=SECRET), "kv2")[0]
    doc = prompts_of([40], seed=91)[0]
    asyncio.run(stream_all(holder, [doc + [3]]))
    question = doc + [4, 5]
    chain = hasher.hash_prompt(question)
    before = settled_stats(puller)
    assert asyncio.run(puller.pull_from(holder, chain, timeout_s=30)) == 5
    got = asyncio.run(stream_all(puller, [question]))
    after = settled_stats(puller)
    assert got == asyncio.run(stream_all(holder, [question]))
    assert after["kv_blocks_imported"] - before["kv_blocks_imported"] == 5
    assert after["kv_host_hits"] - before["kv_host_hits"] == 40
    assert after["tokens_computed"] - before["tokens_computed"] == 2 + GREEDY.max_tokens - 1
    tp4 = by_name["kv2-tp4"]
    with pytest.raises(ray.exceptions.RayTaskError, match="tensor-parallel ranks"):
        ray.get(tp4._rank0.pull.remote(holder._rank0, tuple(chain), 10.0), timeout=30)


def test_a_restarted_tp2_group_reopens_the_disk_blocks_every_rank_holds(ray_runtime, groups, model_dirs, tier_dir):
    """Each rank reopens its own directory; rank 0 keeps the blocks that both ranks hold."""
    docs = prompts_of([40] * 5, seed=78)
    prompts = [d + [5] for d in docs] + [docs[0] + [9, 10]]  # document 0 goes down to the disk
    group = groups[0]["kv2-tiers"]
    for p in prompts[:5]:
        asyncio.run(stream_all(group, [p]))
    group.shutdown()
    rank_dirs = sorted(tier_dir.glob("kv2-tiers/*/rank*"))  # the group's own subdirectory
    assert [d.name for d in rank_dirs] == ["rank0", "rank1"]
    files = [{f.name for f in d.glob("*.kv")} for d in rank_dirs]
    hasher = LLM(str(model_dirs["kv2"]), cluster_secret=TIER_SECRET, **OPTIONS).engine.hasher
    doc0 = [h.hex() + ".kv" for h in hasher.hash_prompt(prompts[5])[:5]]
    assert set(doc0) <= files[0] and files[0] == files[1]
    doc4 = [h.hex() + ".kv" for h in hasher.hash_prompt(prompts[4])[:5]]
    assert set(doc4) <= files[0]  # on the device at the end: written down by the shutdown, on both ranks
    (rank_dirs[1] / doc0[3]).unlink()  # rank 1 lost the document's fourth block
    gc = RayGroupConfig(tensor_parallel_size=2, bundle_resources={ray_runtime.node_labels[1]: 1}, heartbeat_s=0.5)
    again = RayGroup(engine_config(model_dirs["kv2"], **OPTIONS, **tiers(tier_dir)), gc, group_id="kv2-tiers")
    try:
        got = asyncio.run(stream_all(again, [prompts[5]]))
        s = settled_stats(again)
        assert s["kv_disk_blocks_cached"] == len(files[0]) - 1 and s["kv_disk_hits"] == 3 * 8, s
        kept = [{f.name for f in d.glob("*.kv")} for d in rank_dirs]
        assert kept[0] == kept[1] == files[0] - {doc0[3]}  # rank 0 let the block go too
        tp1 = LLM(str(model_dirs["kv2"]), **OPTIONS)
        assert got == [tp1.generate([prompts[5]], GREEDY)[0].token_ids]
        last = docs[4] + [9, 10]  # restored from the blocks each rank wrote at the shutdown
        got = asyncio.run(stream_all(again, [last]))
        assert settled_stats(again)["kv_disk_hits"] - s["kv_disk_hits"] == 5 * 8
        assert got == [tp1.generate([last], GREEDY)[0].token_ids]
    finally:
        again.shutdown()


def test_a_tp2_group_reads_the_disk_blocks_a_gone_group_of_its_node_left(ray_runtime, groups, model_dirs, tier_dir):
    """kv2-tiers is gone (stopped by the test above, its blocks written down at the stop); a
    group of the same node and --kv-disk-dir under another id reads the last document's
    blocks from kv2-tiers' directory, each rank its own rank's files, into its host tier, and
    answers from them as a TP=1 engine does; a group it never heard of brings nothing."""
    doc = prompts_of([40] * 5, seed=78)[4]
    question = doc + [9, 10, 11]
    hasher = LLM(str(model_dirs["kv2"]), cluster_secret=TIER_SECRET, **OPTIONS).engine.hasher
    chain = hasher.hash_prompt(question)
    gc = RayGroupConfig(tensor_parallel_size=2, bundle_resources={ray_runtime.node_labels[1]: 1}, heartbeat_s=0.5)
    reader = RayGroup(engine_config(model_dirs["kv2"], **OPTIONS, **tiers(tier_dir)), gc, group_id="kv2-reader")
    try:
        assert asyncio.run(reader.pull_from_disk("kv2-nobody", chain, timeout_s=30)) == 0
        assert asyncio.run(reader.pull_from_disk("kv2-tiers", chain, timeout_s=30)) == 5
        got = asyncio.run(stream_all(reader, [question]))
        s = settled_stats(reader)
        assert s["kv_blocks_imported"] == 5 and s["kv_host_hits"] == 40, s
        tp1 = LLM(str(model_dirs["kv2"]), **OPTIONS)
        assert got == [tp1.generate([question], GREEDY)[0].token_ids]
    finally:
        reader.shutdown()


def test_tp4_with_replicated_kv_heads(groups, expected):
    prompts, want, _ = expected["kv2"]
    assert asyncio.run(stream_all(groups[0]["kv2-tp4"], prompts)) == want


def test_two_groups_on_two_nodes_serve_at_once(ray_runtime, groups, expected):
    a, b = groups[0]["kv4"], groups[0]["kv2"]
    node_a, node_b = map(node_of, ray_runtime.node_labels)
    assert node_a != node_b
    assert set(a.node_ids) == {node_a} and set(b.node_ids) == {node_b}
    assert a.status().devices == (f"cpu@{node_a}",) * 2

    async def both():
        return await asyncio.gather(stream_all(a, expected["kv4"][0]), stream_all(b, expected["kv2"][0]))

    got_a, got_b = asyncio.run(both())
    assert got_a == expected["kv4"][1] and got_b == expected["kv2"][1]
    assert a.status().alive and b.status().alive


def test_leaving_a_stream_early_aborts_and_bad_requests_fail_alone(groups):
    group = groups[0]["kv4"]
    long = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)

    async def leave_early():
        stream = group.generate(GenerationRequest(prompts_of([8], seed=5)[0], long))
        async for out in stream:
            if len(out.token_ids) >= 2:
                break
        await stream.aclose()
        with pytest.raises(ValueError, match="over the model's context"):
            await stream_all(group, prompts_of([40], seed=6), long)

    asyncio.run(leave_early())
    s = settled_stats(group)
    assert s["running"] == s["waiting"] == 0 and s["blocks_free"] == s["blocks_total"], s
    assert group.status().alive


def test_per_device_kv_bytes_equal_the_planner(groups, model_dirs):
    for key, name, tp in [("kv4", "kv4", 2), ("kv2", "kv2", 2), ("kv2-tp4", "kv2", 4), ("kv1", "kv1", 2)]:
        group = groups[0][key]
        shape = KVShape.from_hf_config(model_dirs[name], kv_dtype="float32", block_size=8)
        per_rank = [r["kv_bytes_per_token"] for r in group.ranks]
        assert per_rank == [shape.bytes_per_token(tp)] * tp, (key, per_rank)
        stats = group.engine_stats()
        assert stats["kv_pool_bytes"] == stats["blocks_total"] * shape.block_bytes(tp)
    # sharded heads shrink each device's share; replicated ones cannot go below one head
    assert KVShape.from_hf_config(model_dirs["kv4"], "float32", 8).bytes_per_token(2) * 2 == (
        KVShape.from_hf_config(model_dirs["kv4"], "float32", 8).bytes_per_token(1)
    )


# ---- health ----------------------------------------------------------------------------
def test_a_hung_rank_is_found_by_the_collective_timeout(groups, expected):
    group = groups[0]["kv2-tp4"]
    prompt = expected["kv2"][0][0]
    pid = group.ranks[3]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="tensor-parallel group failed"):
            asyncio.run(asyncio.wait_for(stream_all(group, [prompt]), 120))
        elapsed = time.monotonic() - t0
        assert elapsed < HANG_TIMEOUT_S + 20, elapsed
        status = group.status()
        assert not status.alive and "tensor-parallel group failed" in status.error
        with pytest.raises(EngineDeadError):  # a dead group refuses new work at once
            asyncio.run(stream_all(group, [prompt]))
    finally:
        os.kill(pid, signal.SIGCONT)
    group.shutdown()


def test_a_rank_that_dies_fails_in_flight_requests_at_once(groups):
    group = groups[0]["kv1"]
    long = SamplingParams(temperature=0.0, max_tokens=88, ignore_eos=True)
    pid = group.ranks[1]["pid"]

    async def run():
        stream = group.generate(GenerationRequest(prompts_of([8], seed=99)[0], long))
        first = await stream.__anext__()  # prefilled: the request is in flight
        assert not first.finished
        os.kill(pid, signal.SIGSTOP)  # rank 0 now waits inside the next step...
        await asyncio.sleep(0.5)
        os.kill(pid, signal.SIGKILL)  # ...when rank 1 crashes
        killed = time.monotonic()
        with pytest.raises(EngineDeadError, match="tensor-parallel group failed"):
            async for _ in stream:
                pass
        return time.monotonic() - killed

    assert asyncio.run(asyncio.wait_for(run(), 120)) < 15  # not the 60 s collective timeout
    deadline = time.monotonic() + 15
    while group.status().alive and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group.status().alive and group.status().error
    group.shutdown()
    assert not group.status().alive


def test_status_follows_the_stream_and_never_waits_on_a_stopped_rank(ray_runtime, model_dirs):
    """The router reads every group's status on every decision: it must come from the output
    stream, not from a call to rank 0, so a stopped rank 0 cannot hold the router up; the
    watcher then finds it dead within a heartbeat and `status_timeout_s`."""
    gc = RayGroupConfig(heartbeat_s=0.5, status_timeout_s=2.0)
    group = RayGroup(engine_config(model_dirs["kv1"], **OPTIONS), gc)
    try:
        assert group.status().blocks_total == group.engine_stats()["blocks_total"] > 0
        long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

        async def busy():
            stream = group.generate(GenerationRequest(prompts_of([8], seed=7)[0], long))
            running = 0  # the stats of a batch are the previous step's: look over the stream
            async for _ in stream:
                running = max(running, group.status().running)
            return running

        assert asyncio.run(asyncio.wait_for(busy(), 60)) == 1
        deadline = time.monotonic() + 10  # the idle batches bring the settled stats
        while group.status().running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group.status().running == 0 and group.status().alive
        os.kill(group.ranks[0]["pid"], signal.SIGSTOP)
        try:
            stopped, slowest = time.monotonic(), 0.0
            while group.status().alive and time.monotonic() < stopped + 30:
                t0 = time.monotonic()
                group.status()
                slowest = max(slowest, time.monotonic() - t0)
                time.sleep(0.01)
            found = time.monotonic() - stopped
            status = group.status()
            assert not status.alive and "rank 0 does not answer" in status.error
            assert found < gc.heartbeat_s + gc.status_timeout_s + 5, found
            assert slowest < gc.status_timeout_s / 4, slowest  # it never waited on rank 0
        finally:
            os.kill(group.ranks[0]["pid"], signal.SIGCONT)
    finally:
        group.shutdown()


def _bound_cores(cores, q):
    from cluster.ray.rank_actor import bind_process

    threading.Thread(target=time.sleep, args=(2.0,)).start()  # a thread that exists already
    bind_process(cores)
    tasks = os.listdir("/proc/self/task")
    q.put((len(tasks), {tuple(sorted(os.sched_getaffinity(int(t)))) for t in tasks}))


def test_cpu_binding_is_parsed_and_binds_every_thread():
    assert parse_cpu_binding("0-2,5|7", 2) == [frozenset({0, 1, 2, 5}), frozenset({7})]
    for bad, words in (("0|1", "names 2 rank"), ("a|1-x", "not a list of cores"), ("|", "not a list of cores")):
        with pytest.raises(ValueError, match=words):
            parse_cpu_binding(bad, 2 if bad != "0|1" else 3)
    with pytest.raises(ValueError, match="cpu_binding"):
        RayGroupConfig(tensor_parallel_size=2, cpu_binding="0")
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=_bound_cores, args=(frozenset({0}), q))
    child.start()
    threads, affinities = q.get(timeout=60)
    assert threads >= 2 and affinities == {(0,)}
    child.join(timeout=60)
