"""The document registry shared through a real redis-server by two router replicas over the
same groups (real LocalGroups, the built-in model): a document put through replica a is
visible, hit and deletable through replica b; both report its expiry at the same moment;
`max_documents` counts a tenant's documents across both; a document deleted through b is
neither visible through a nor pinned again by a's reconciler. A replica's metrics count each
tenant's documents and the blocks pinned for them."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis
from prometheus_client import generate_latest
from test_documents_repin import DOC, OTHER, until

import router.documents as documents
from cluster.index import InMemoryPrefixIndex
from cluster.local_group import LocalGroup
from pagefleet.llm import engine_config
from router.door.metrics import ServerMetrics
from router.router import ModelInfo, Router, RouteRequest
from worker.sampling_params import SamplingParams
from worker.token_ids import check_token_ids

THIRD = [(17 * i) % 900 + 40 for i in range(32)]  # 2 blocks


@pytest.fixture
def fast_reconcile(monkeypatch):
    monkeypatch.setattr(documents, "RECONCILE_S", 0.05)
    monkeypatch.setattr(documents, "REPIN_GRACE_S", 0.2)


def test_two_replicas_share_documents_through_redis(redis_server, fast_reconcile):
    index = InMemoryPrefixIndex()
    config = engine_config("builtin", num_blocks=64, max_model_len=256, cluster_secret="shared-docs")
    made = [LocalGroup(config, index, group_id=f"g{i}") for i in range(2)]
    info = ModelInfo("builtin", 256, 16, "auto", 1024)
    cluster = f"c{uuid.uuid4().hex[:6]}"

    async def run() -> None:
        a, b = (Router(made, index, made[0].hasher, info) for _ in range(2))
        for r in (a, b):
            r.documents.share(redis.Redis.from_url(redis_server.url), cluster)
            r.documents.max_documents = {"acme": 2}
        ids = check_token_ids(DOC, 1024)[1]
        doc = await a.documents.put(ids, "acme", "acme", ttl_s=300, groups=["g1"])
        seen = b.documents.get(doc.document_id, "acme")  # visible through b, as a registered it
        assert (seen.expires_at, seen.hashes, seen.groups) == (doc.expires_at, doc.hashes, ("g1",))
        assert b.documents.state(seen) == documents.READY and b.documents.holders(seen) == {"g1": 4}
        with pytest.raises(documents.DocumentNotFoundError):  # another owner's id: not found on b either
            b.documents.get(doc.document_id, "other")
        # a request through b that starts with the document hits it whole, on its group
        assert await cached_tokens(b, DOC + [5, 6], "acme") == (64, "g1")

        # max_documents counts across both replicas: one through each, the third refused on either
        short = await b.documents.put(check_token_ids(THIRD, 1024)[1], "acme", "acme", ttl_s=2, groups=["g0"])
        for r in (a, b):
            with pytest.raises(documents.DocumentLimitError, match="max_documents: tenant 'acme' holds 2"):
                await r.documents.put(check_token_ids(OTHER, 1024)[1], "acme", "acme", ttl_s=300)
        # per-tenant document metrics on a replica: its documents and the blocks pinned for them
        metrics = ServerMetrics("builtin", 256)
        metrics.tenants = frozenset({"acme"})
        metrics.watch_documents(b.documents.by_tenant)
        assert await until(lambda: b.documents.holders(short) == {"g0": 2}, 10)
        text = generate_latest(metrics.registry).decode()
        assert 'pagefleet:tenant_documents{model_name="builtin",tenant="acme"} 2.0' in text
        assert 'pagefleet:tenant_pinned_blocks{model_name="builtin",tenant="acme"} 6.0' in text

        # its TTL passes at one moment for both replicas; its slot is free again on both
        a_view = a.documents.get(short.document_id, "acme")
        assert a_view.expires_at == short.expires_at
        assert await until(lambda: short.expired(), 5)
        assert a.documents.state(a_view) == b.documents.state(short) == documents.EXPIRED
        third = await a.documents.put(check_token_ids(OTHER, 1024)[1], "acme", "acme", ttl_s=300, groups=["g0"])

        # deleted through b: gone on a, unpinned on the groups, not pinned again by a's reconciler
        b.documents.delete(doc.document_id, "acme")
        with pytest.raises(documents.DocumentNotFoundError):
            a.documents.get(doc.document_id, "acme")
        assert await until(lambda: doc.document_id not in made[1].status().pinned, 10)
        await asyncio.sleep(1.0)  # several reconcile rounds of both replicas
        assert doc.document_id not in made[1].status().pinned and doc.document_id not in a.documents.docs
        b.documents.delete(third.document_id, "acme")
        for r in (a, b):
            r.documents.close()

    try:
        asyncio.run(run())
    finally:
        for g in made:
            g.shutdown()


async def cached_tokens(router: Router, prompt: list[int], salt: str) -> tuple[int, str]:
    """A one-token request of the salt's tenant: (its cached tokens, its group)."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    req = RouteRequest(prompt_token_ids=prompt, params=params, cache_salt=salt, tenant=salt)
    outs = [out async for out in router.generate(req)]
    return outs[-1].num_cached_tokens, router.records[outs[-1].request_id].group_id
