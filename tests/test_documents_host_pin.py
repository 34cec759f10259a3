"""A document pinned in the host tier on a real `pagefleet serve` (built-in model, a small pool
over a host tier): it holds no device block, survives a flood through the pool and the host,
and a question restores it from the host tier (usage's cached tokens by tier); GET reports the
pin under the host tier; DELETE releases it."""

from __future__ import annotations

import httpx
import openai
import pytest
from test_cli_serve import serving_tenants
from test_documents_serve import BS, CONTROL, DOC

# the built-in model's KV is 2 KiB a token (the engine's kv_bytes_per_token): 32 KiB a block of
# 16 tokens; a host tier of 48 blocks
BLOCK_BYTES = 32 * 1024
HOST_BLOCKS = 48


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("documents-host")
    with serving_tenants(
        tmp,
        "tenants:\n  acme: {max_documents: 2}\n",
        "acme k-acme\n",
        "k-acme",
        *("--num-blocks", "64", "--block-size", str(BS), "--max-model-len", "512"),
        *("--kv-host-bytes", str(HOST_BLOCKS * BLOCK_BYTES)),
    ) as served:
        yield served


def test_a_document_pinned_in_the_host_tier_is_restored_from_it_after_a_flood(served):
    _, http_port, _ = served
    acme = httpx.Client(
        base_url=f"http://127.0.0.1:{http_port}", headers={"Authorization": "Bearer k-acme"}, timeout=60
    )
    put = acme.post("/v1/documents", json={"text": DOC, "ttl_seconds": 300, "tier": "host"})
    assert put.status_code == 200, put.text
    doc = put.json()
    assert doc["tier"] == "host" and doc["state"] == "ready"
    host = [x for x in doc["locations"] if x["tier"] == "host"]
    assert [x["blocks_pinned"] for x in host] == [doc["blocks"]]
    assert all(x["blocks_pinned"] == 0 for x in doc["locations"] if x["tier"] == "device")

    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="k-acme", max_retries=0, timeout=60)
    oa.completions.create(model="builtin-v1", prompt=CONTROL + " Question: which day?", max_tokens=1)
    for i in range(12):  # ~190 blocks through the pool's 64 and, written back, the host's 48
        flood = " ".join(f"flood {i} line {j} with {i * j} drops" for j in range(15))
        oa.completions.create(model="builtin-v1", prompt=flood, max_tokens=1)
    hit = oa.completions.create(model="builtin-v1", prompt=DOC + " Question: who pays?", max_tokens=2)
    details = hit.usage.prompt_tokens_details
    assert details.cached_tokens == doc["blocks"] * BS  # the whole document...
    assert details.model_extra["cached_tokens_by_tier"]["host"] == doc["blocks"] * BS  # ...from the host
    control = oa.completions.create(model="builtin-v1", prompt=CONTROL + " Question: which day?", max_tokens=1)
    assert control.usage.prompt_tokens_details.cached_tokens == 0  # unpinned: gone from both tiers

    assert acme.delete(f"/v1/documents/{doc['id']}").json()["deleted"] is True
    assert acme.get(f"/v1/documents/{doc['id']}").status_code == 404
