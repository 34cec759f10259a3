"""Groups of one node sharing a --kv-disk-dir: each has its own subdirectory (its id), so that
they start side by side, a restart under the same id reopens its blocks, and a group can read
the blocks that a group of its node which is gone left there (`GroupHandle.pull_from_disk`,
`LLMEngine.import_from_disk`): the leading blocks whose files are whole, into its host tier,
where the next request finds them, with the tokens the gone group gave.

In this process (LocalGroup), built-in model, float32 on CPU; tests/test_tensor_parallel.py
reads a TP=2 Ray group's directory, each rank its own rank's files.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from cluster.index import InMemoryPrefixIndex
from cluster.local_group import LocalGroup
from pagefleet.llm import engine_config
from router.launch.local import router_side
from router.router import ModelInfo, Router, RouteRequest
from tests.factories import fail_after
from worker.config import check_disk_group
from worker.protocol import GenerationRequest
from worker.sampling_params import SamplingParams

SECRET = "disk-siblings-test-secret"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
DOC_BLOCKS = 6  # the document: 6 full blocks of 16 tokens
READ_DELAY_S = 0.2  # a slow disk: 1.2 s to read the document's files


def config(directory, **options):
    return engine_config(
        "builtin",
        dtype="float32",
        num_blocks=32,
        max_model_len=256,
        kv_host_bytes=1 << 20,
        kv_disk_bytes=1 << 24,
        kv_disk_dir=str(directory),
        cluster_secret=SECRET,
        **options,
    )


def ask(group, ids: list[int], rid: str):
    async def run():
        request = GenerationRequest(ids, GREEDY, request_id=rid, block_hashes=group.hasher.hash_prompt(ids))
        return [o async for o in group.generate(request)][-1]

    return asyncio.run(run())


def document(seed: int) -> list[int]:
    return [(7 * i + seed) % 900 + 3 for i in range(DOC_BLOCKS * 16)]


@pytest.fixture
def gone(tmp_path):
    """Group g-gone answered a question on a document, then stopped: its clean stop wrote its
    blocks down to its own subdirectory. (its answer, the question, the directory)"""
    g = LocalGroup(config(tmp_path), group_id="g-gone")
    question = document(1) + [5, 6, 7]
    answer = ask(g, question, "gone-q")
    g.shutdown()
    return answer, question, tmp_path


def test_groups_of_one_node_share_a_disk_directory_each_in_its_own_subdirectory(tmp_path):
    a, b = LocalGroup(config(tmp_path), group_id="g-a"), LocalGroup(config(tmp_path), group_id="g-b")
    try:
        ask(a, document(2) + [1], "a")
        ask(b, document(3) + [1], "b")
    finally:
        a.shutdown()
        b.shutdown()
    a_files = {f.name for f in tmp_path.glob("g-a/*/rank0/*.kv")}
    b_files = {f.name for f in tmp_path.glob("g-b/*/rank0/*.kv")}
    assert len(a_files) >= DOC_BLOCKS and len(b_files) >= DOC_BLOCKS and not a_files & b_files


def test_a_group_reads_the_blocks_a_gone_group_of_its_node_left_and_answers_as_it_did(gone):
    answer, question, directory = gone
    reader = LocalGroup(config(directory), group_id="g-reader")
    try:
        chain = reader.hasher.hash_prompt(question)
        before = reader.engine.engine.stats()
        assert asyncio.run(reader.pull_from_disk("g-gone", chain, timeout_s=30)) == DOC_BLOCKS
        got = ask(reader, question, "reader-q")
        after = reader.engine.engine.stats()
    finally:
        reader.shutdown()
    assert got.outputs[0].token_ids == answer.outputs[0].token_ids
    assert got.num_cached_tokens == DOC_BLOCKS * 16 and got.cached_tiers.pull == DOC_BLOCKS * 16  # (as a pull's)
    assert after["kv_blocks_imported"] - before["kv_blocks_imported"] == DOC_BLOCKS
    assert after["tokens_computed"] - before["tokens_computed"] == 3 + GREEDY.max_tokens - 1
    assert {f.name for f in directory.glob("g-gone/*/rank0/*.kv")}  # read, not taken: still there


def test_reading_a_gone_groups_files_leaves_the_other_streams_stepping(gone):
    """The files are read on a thread of their own, not between two of the reader's steps: on a
    slow disk (READ_DELAY_S a block), a stream the reader serves meanwhile keeps coming."""
    _, question, directory = gone
    reader = LocalGroup(config(directory, kv_disk_read_delay_s=READ_DELAY_S), group_id="g-reader")
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    arrivals: list[float] = []

    async def run():
        async def stream():
            async for _ in reader.generate(GenerationRequest(list(range(3, 11)), long, request_id="busy")):
                arrivals.append(time.monotonic())

        task = asyncio.create_task(stream())
        while len(arrivals) < 2:
            await asyncio.sleep(0.005)
        start = time.monotonic()
        pulled = await reader.pull_from_disk("g-gone", reader.hasher.hash_prompt(question), timeout_s=30)
        end = time.monotonic()
        await task
        return pulled, start, end

    try:
        pulled, start, end = asyncio.run(run())
        got = ask(reader, question, "reader-q")
    finally:
        reader.shutdown()
    assert pulled == DOC_BLOCKS and got.num_cached_tokens == DOC_BLOCKS * 16
    assert end - start >= DOC_BLOCKS * READ_DELAY_S
    during = [t for t in arrivals if start <= t <= end]
    assert len(during) >= 20, f"{len(during)} tokens in the {end - start:.2f} s of the read"


def test_only_the_leading_blocks_whose_files_are_whole_are_read(gone):
    answer, question, directory = gone
    reader = LocalGroup(config(directory), group_id="g-reader")
    try:
        chain = reader.hasher.hash_prompt(question)
        (rank_dir,) = directory.glob("g-gone/*/rank0")
        third = rank_dir / f"{chain[2].hex()}.kv"
        data = bytearray(third.read_bytes())
        data[-1] ^= 0xFF  # a flipped bit: its checksum fails
        third.write_bytes(bytes(data))
        assert asyncio.run(reader.pull_from_disk("g-gone", chain, timeout_s=30)) == 2
        got = ask(reader, question, "reader-q")
    finally:
        reader.shutdown()
    assert got.num_cached_tokens == 2 * 16 and got.outputs[0].token_ids == answer.outputs[0].token_ids


def test_nothing_comes_from_a_group_that_left_nothing_from_itself_or_without_a_disk_tier(gone):
    _, question, directory = gone
    reader = LocalGroup(config(directory), group_id="g-reader")
    bare = LocalGroup(
        engine_config("builtin", num_blocks=32, max_model_len=256, cluster_secret=SECRET), group_id="g-bare"
    )
    try:
        chain = reader.hasher.hash_prompt(question)
        assert asyncio.run(reader.pull_from_disk("g-never", chain, timeout_s=30)) == 0
        assert asyncio.run(reader.pull_from_disk("g-reader", chain, timeout_s=30)) == 0
        assert asyncio.run(reader.pull_from_disk("../g-gone", chain, timeout_s=30)) == 0  # not a group's name
        assert asyncio.run(bare.pull_from_disk("g-gone", chain, timeout_s=30)) == 0
        assert ask(reader, question, "reader-q").num_cached_tokens == 0
    finally:
        reader.shutdown()
        bare.shutdown()


def test_another_secret_reads_nothing_from_the_same_directory(gone):
    _, question, directory = gone
    other = engine_config(
        "builtin",
        num_blocks=32,
        max_model_len=256,
        kv_host_bytes=1 << 20,
        kv_disk_bytes=1 << 24,
        kv_disk_dir=str(directory),
        cluster_secret="another-secret",
    )
    reader = LocalGroup(other, group_id="g-reader")
    try:
        hasher = router_side(config(directory), "builtin")[0]  # the gone group's names
        assert asyncio.run(reader.pull_from_disk("g-gone", hasher.hash_prompt(question), timeout_s=30)) == 0
    finally:
        reader.shutdown()


@pytest.mark.parametrize("bad", ["", "..", ".hidden", "a/b", "x" * 129, "gr oup"])
def test_a_disk_group_is_one_safe_path_component(bad):
    with pytest.raises(ValueError, match="kv_disk_group"):
        check_disk_group(bad)
    assert check_disk_group("group-0.g_1") == "group-0.g_1"


def test_a_stream_whose_group_dies_resumes_from_the_blocks_its_disk_tier_left(tmp_path, caplog):
    """d0 holds the document on its disk (it read it once, stopped, came back under its id);
    a question streams on d0, which dies after 12 steps: the router resumes it on d1, which
    first reads the document's blocks that d0's disk tier left and recomputes only the rest.
    The tokens are an undisturbed run's."""
    question = document(4) + [5, 6, 7]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = LocalGroup(engine_config("builtin", dtype="float32", num_blocks=32, max_model_len=256, cluster_secret=SECRET))
    try:
        want = ask_with(ref, question, params)
    finally:
        ref.shutdown()
    first = LocalGroup(config(tmp_path), group_id="d0")
    ask(first, document(4) + [1], "warm")
    first.shutdown()  # (its blocks written down to tmp_path/d0)
    index = InMemoryPrefixIndex()
    d0, d1 = LocalGroup(config(tmp_path), index, group_id="d0"), LocalGroup(config(tmp_path), index, group_id="d1")
    try:
        router = Router([d0, d1], index, d0.hasher, ModelInfo("builtin", 256, 16, "auto", 1024), policy="round_robin")
        fail_after(d0, 12)
        before = d1.engine.engine.stats()

        async def stream():
            request = RouteRequest(prompt_token_ids=question, params=params)
            return [o async for o in router.generate(request)]

        with caplog.at_level(logging.INFO):
            outs = asyncio.run(stream())
        record = router.records[outs[-1].request_id]
        after = d1.engine.engine.stats()
    finally:
        d0.shutdown()
        d1.shutdown()
    assert "resuming it elsewhere" in caplog.text and "left on its node's disk" in caplog.text
    assert record.group_id == "d1" and record.resumes == 1
    assert record.pulled_from == "d0" and record.pulled_blocks == DOC_BLOCKS
    assert [t for o in outs for t in o.new_token_ids] == want
    computed = after["tokens_computed"] - before["tokens_computed"]
    assert after["kv_blocks_imported"] - before["kv_blocks_imported"] == DOC_BLOCKS
    # everything but the document's blocks: the prompt's tail, the tokens d0 gave, the rest's decodes
    assert computed <= len(question) + params.max_tokens - DOC_BLOCKS * 16, computed


def ask_with(group, ids: list[int], params: SamplingParams) -> list[int]:
    async def run():
        request = GenerationRequest(ids, params, request_id="ref", block_hashes=group.hasher.hash_prompt(ids))
        return [o async for o in group.generate(request)][-1]

    return list(asyncio.run(run()).outputs[0].token_ids)
