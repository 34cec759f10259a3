"""Pins survive a group's replacement: the router's documents are pinned again on the new
group (a fresh engine under the same id), and an untargeted document whose group left is
pinned on another; requests then hit it there. Real LocalGroups with the built-in model."""

from __future__ import annotations

import asyncio
import time

import pytest

import router.documents as documents
from cluster.index import InMemoryPrefixIndex
from cluster.local_group import LocalGroup
from pagefleet.llm import engine_config
from router.router import ModelInfo, Router, RouteRequest
from worker.sampling_params import SamplingParams
from worker.token_ids import check_token_ids

DOC = [(11 * i) % 900 + 20 for i in range(64)]  # 4 blocks of 16
OTHER = [(13 * i) % 900 + 30 for i in range(48)]  # 3 blocks


@pytest.fixture
def fast_reconcile(monkeypatch):
    monkeypatch.setattr(documents, "RECONCILE_S", 0.05)
    monkeypatch.setattr(documents, "REPIN_GRACE_S", 0.2)


async def until(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def cached_tokens(router: Router, prompt: list[int]) -> tuple[int, str]:
    req = RouteRequest(prompt_token_ids=prompt, params=SamplingParams(max_tokens=1, temperature=0.0))
    outs = [out async for out in router.generate(req)]
    return outs[-1].num_cached_tokens, router.records[outs[-1].request_id].group_id


def test_pins_are_renewed_on_a_replacement_group_and_moved_off_a_gone_one(fast_reconcile):
    index = InMemoryPrefixIndex()
    config = engine_config("builtin", num_blocks=64, max_model_len=256, cluster_secret="repin")
    g0, g1 = (LocalGroup(config, index, group_id=f"g{i}") for i in range(2))
    made = [g0, g1]
    info = ModelInfo("builtin", 256, 16, "auto", 1024)

    async def run() -> None:
        router = Router([g0, g1], index, g0.hasher, info)
        store = router.documents
        ids = check_token_ids(DOC, 1024)[1]
        targeted = await store.put(ids, None, "", ttl_s=300, groups=["g0"])
        assert store.holders(targeted) == {"g0": 4}
        loose = await store.put(check_token_ids(OTHER, 1024)[1], None, "", ttl_s=300, groups=["g1"])
        loose.groups = ()  # (placed on g1 to begin with; from now on wherever the router likes)

        g0.shutdown()  # g0 is replaced under its id by a fresh engine: nothing pinned, nothing cached
        fresh = LocalGroup(config, index, group_id="g0")
        made.append(fresh)
        router.set_groups([fresh, g1])
        assert await until(lambda: store.holders(targeted) == {"g0": 4})
        assert store.state(targeted) == documents.READY
        assert fresh.status().pinned == {targeted.document_id: 4}
        assert await cached_tokens(router, DOC + [5, 6]) == (64, "g0")

        g1.shutdown()  # g1 leaves for good: its document moves to the one group left
        router.set_groups([fresh])
        assert await until(lambda: store.holders(loose) == {"g0": 3})
        assert await cached_tokens(router, OTHER + [7]) == (48, "g0")

        store.delete(targeted.document_id, None)
        store.delete(loose.document_id, None)
        assert await until(lambda: fresh.status().pinned == {} and fresh.status().blocks_free == 64)
        store.close()

    try:
        asyncio.run(run())
    finally:
        for g in made:
            g.shutdown()


def test_a_document_with_replicas_is_kept_on_that_many_groups(fast_reconcile):
    """replicas 2 over three groups: pinned on two (the placed one first); when one of them
    leaves, the reconciler pins it on the third, so that two groups hold it again. Asking for
    more replicas than groups, none, or replicas beside named groups names the field."""
    index = InMemoryPrefixIndex()
    config = engine_config("builtin", num_blocks=64, max_model_len=256, cluster_secret="replicas")
    groups = [LocalGroup(config, index, group_id=f"g{i}") for i in range(3)]
    info = ModelInfo("builtin", 256, 16, "auto", 1024)

    async def run() -> None:
        router = Router(groups, index, groups[0].hasher, info)
        store = router.documents
        ids = check_token_ids(DOC, 1024)[1]
        for kw, field in [({"replicas": 4}, "replicas"), ({"replicas": 0}, "replicas")]:
            with pytest.raises(documents.DocumentFieldError) as refused:
                await store.put(ids, None, "", ttl_s=300, **kw)
            assert refused.value.field == field
        with pytest.raises(documents.DocumentFieldError, match="groups or replicas"):
            await store.put(ids, None, "", ttl_s=300, groups=["g0"], replicas=2)
        doc = await store.put(ids, None, "", ttl_s=300, replicas=2)
        held = store.holders(doc)
        assert len(held) == 2 and set(held.values()) == {4}
        assert {x.group_id for x in await store.locate(doc) if x.blocks_pinned} == set(held)

        gone = sorted(held)[0]
        router.set_groups([g for g in groups if g.group_id != gone])
        next(g for g in groups if g.group_id == gone).shutdown()
        assert await until(lambda: len(store.holders(doc)) == 2)
        assert set(store.holders(doc)) == {g.group_id for g in groups} - {gone}
        store.delete(doc.document_id, None)
        store.close()

    try:
        asyncio.run(run())
    finally:
        for g in groups:
            g.shutdown()


def test_a_ray_group_pins_reports_and_unpins_a_document(ray_runtime):
    from cluster.ray.group import RayGroup, RayGroupConfig
    from router.launch.local import router_side

    index = InMemoryPrefixIndex()
    config = engine_config("builtin", num_blocks=64, max_model_len=256, cluster_secret="repin")
    group = RayGroup(config, RayGroupConfig(), group_id="ray-docs", index=index)
    hasher, _, info = router_side(config, "builtin")

    async def run() -> None:
        router = Router([group], index, hasher, info)
        store = router.documents
        doc = await store.put(check_token_ids(DOC, 1024)[1], None, "", ttl_s=300)
        assert store.state(doc) == documents.READY  # rank 0's stats carried the pin across Ray
        assert group.status().pinned == {doc.document_id: 4}
        assert await cached_tokens(router, DOC + [9]) == (64, "ray-docs")
        store.delete(doc.document_id, None)
        assert await until(lambda: group.status().pinned == {}, 10)
        store.close()

    try:
        asyncio.run(run())
    finally:
        group.shutdown()


def test_documents_benchmark_smoke():
    """benchmarks/documents.py: under a flood the unpinned document is evicted, the pinned one
    is hit whole (one JSON line per case)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.documents", "--quick"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    cases = {c["case"]: c for c in map(json.loads, out.stdout.splitlines())}
    assert cases["pinned"]["hit_rate"] == 1.0 and cases["unpinned"]["hit_rate"] < 0.5
    assert cases["pinned"]["ratio_vs_peer"] > 0 and cases["pinned"]["peer"] == "unpinned"


def test_max_documents_is_checked_at_start_naming_the_tenant():
    from router.launch.config import TenantsConfig

    assert TenantsConfig.parse({"acme": {"max_documents": 3}}).max_documents == {"acme": 3}
    for bad in (0, 1.5, True, "3"):
        with pytest.raises(ValueError, match=r"tenants\.acme\.max_documents must be an integer > 0"):
            TenantsConfig.parse({"acme": {"max_documents": bad}})


def test_a_replacement_group_re_pins_a_document_from_its_disk_tier(fast_reconcile, tmp_path):
    """A group replaced on its disk directory (its clean shutdown wrote the pinned document
    down) pins the document again from the disk: every full block read back, none of its
    prompt tokens computed; then a question on it is a whole hit with the first group's tokens."""
    index = InMemoryPrefixIndex()
    tiers = {"kv_host_bytes": "2MiB", "kv_disk_bytes": "8MiB", "kv_disk_dir": str(tmp_path)}
    config = engine_config("builtin", num_blocks=64, max_model_len=256, cluster_secret="repin", **tiers)
    g0 = LocalGroup(config, index, group_id="g0")
    made = [g0]
    info = ModelInfo("builtin", 256, 16, "auto", 1024)
    question = DOC + [5, 6]

    def stats(group: LocalGroup) -> dict:
        return group.engine.call(lambda e: e.stats()).result(10)

    async def answer(router: Router) -> tuple[int, list[int]]:
        req = RouteRequest(prompt_token_ids=question, params=SamplingParams(max_tokens=4, temperature=0.0))
        outs = [out async for out in router.generate(req)]
        return outs[-1].num_cached_tokens, list(outs[-1].token_ids)

    async def run() -> None:
        router = Router([g0], index, g0.hasher, info)
        store = router.documents
        doc = await store.put(check_token_ids(DOC, 1024)[1], None, "", ttl_s=300, groups=["g0"])
        assert store.holders(doc) == {"g0": 4}
        _, before = await answer(router)

        g0.shutdown()  # a clean stop: the device's pinned blocks are written down to the disk
        assert len(list(tmp_path.rglob("*.kv"))) >= 4
        fresh = LocalGroup(config, index, group_id="g0")
        made.append(fresh)
        router.set_groups([fresh])
        assert await until(lambda: fresh.status().pinned == {doc.document_id: 4})
        got = stats(fresh)
        assert got["kv_disk_hits"] == 48 and got["kv_disk_failures"] == 0
        assert got["tokens_computed"] == 16  # the last block only
        assert await answer(router) == (64, before)
        store.close()

    try:
        asyncio.run(run())
    finally:
        for g in made:
            g.shutdown()
