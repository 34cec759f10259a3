"""Documents as objects on a real `pagefleet serve` (built-in model, a small pool), through both
doors: put, locate, hit (usage's cached tokens) from HTTP and gRPC, a flood that evicts
everything but the pinned document, TTL expiry, delete, and each bad input's status.

Two tenants by API key: "acme" may hold two documents (`tenants:` in the YAML), "rival" the
default. HTTP calls go through httpx and the official `openai` client, gRPC ones through the
generated stub and the project's client.
"""

from __future__ import annotations

import time

import grpc
import httpx
import openai
import pytest
from test_cli_serve import serving_tenants

from pagefleet.client import Client
from protos.pagefleet.v1 import pagefleet_pb2 as pb
from protos.pagefleet.v1 import pagefleet_pb2_grpc as pb_grpc

TENANTS_YAML = """
tenants:
  acme: {max_documents: 2}
"""
BS = 16
ONE = pb.SamplingParams(max_tokens=1)
# A document of whole blocks and then some; every word a different token run.
DOC = " ".join(f"clause {i} of the lease says the tenant pays {i * 7} crowns;" for i in range(6))
CONTROL = " ".join(f"the ship log of day {i} reads calm seas and {i * 3} knots;" for i in range(6))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("documents")
    with serving_tenants(
        tmp,
        TENANTS_YAML,
        "acme k-acme\nrival k-rival\n",
        "k-acme",
        "--num-blocks",
        "64",
        "--block-size",
        str(BS),
        "--max-model-len",
        "512",
    ) as served:
        yield served


def http(http_port: int, key: str) -> httpx.Client:
    return httpx.Client(
        base_url=f"http://127.0.0.1:{http_port}", headers={"Authorization": f"Bearer {key}"}, timeout=60
    )


def stub(port: int) -> tuple[grpc.Channel, pb_grpc.PageFleetStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return channel, pb_grpc.PageFleetStub(channel)


def key(k: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {k}"),)


def test_put_locate_and_hit_from_both_doors_survive_a_flood(served):
    port, http_port, _ = served
    acme = http(http_port, "k-acme")
    put = acme.post("/v1/documents", json={"text": DOC, "ttl_seconds": 300})
    assert put.status_code == 200, put.text
    doc = put.json()
    assert doc["state"] == "ready" and doc["blocks"] == doc["tokens"] // BS >= 4
    (where,) = doc["locations"]
    assert where["tier"] == "device" and where["blocks_pinned"] == doc["blocks"]
    assert acme.get(f"/v1/documents/{doc['id']}").json()["locations"] == doc["locations"]

    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="k-acme", max_retries=0, timeout=60)
    oa.completions.create(model="builtin-v1", prompt=CONTROL + " Question: which day?", max_tokens=1)
    for i in range(6):  # a flood of other prompts: 96 blocks through the pool's 55 unpinned
        flood = " ".join(f"flood {i} line {j} with {i * j} drops" for j in range(15))
        oa.completions.create(model="builtin-v1", prompt=flood, max_tokens=1)
    cached = doc["blocks"] * BS
    hit = oa.completions.create(model="builtin-v1", prompt=DOC + " Question: who pays?", max_tokens=2)
    assert hit.usage.prompt_tokens_details.cached_tokens == cached  # the pinned document, whole
    control = oa.completions.create(model="builtin-v1", prompt=CONTROL + " Question: which day?", max_tokens=1)
    assert control.usage.prompt_tokens_details.cached_tokens == 0  # an unpinned prefix was evicted

    client = Client(f"127.0.0.1:{port}", timeout=60, api_key="k-acme")
    try:
        # (the question's first words too, from the hit before: at least the document)
        assert client.generate(DOC + " Question: how much?", max_tokens=2).cached_tokens >= cached
    finally:
        client.close()
    rival = http(http_port, "k-rival")  # another tenant's salt: no hit, and no sight of the id
    assert rival.get(f"/v1/documents/{doc['id']}").status_code == 404
    assert rival.delete(f"/v1/documents/{doc['id']}").status_code == 404
    assert acme.delete(f"/v1/documents/{doc['id']}").json() == {"id": doc["id"], "object": "document", "deleted": True}
    assert acme.get(f"/v1/documents/{doc['id']}").status_code == 404


def test_grpc_put_get_delete_with_token_ids_and_messages(served):
    port, _, _ = served
    channel, api = stub(port)
    try:
        ids = [(5 * i + 11) % 250 + 3 for i in range(3 * BS + 5)]
        doc = api.PutDocument(pb.PutDocumentRequest(token_ids=ids, ttl_seconds=300), metadata=key("k-acme"))
        assert doc.state == pb.DOCUMENT_STATE_READY and doc.blocks == 3 and doc.tokens == len(ids)
        assert doc.locations[0].blocks_pinned == 3
        got = api.GetDocument(pb.GetDocumentRequest(document_id=doc.document_id), metadata=key("k-acme"))
        assert got.locations[0].blocks_cached >= 3  # the prefix index knows them: the router places by it
        stream = api.Generate(pb.GenerateRequest(token_ids=ids + [7, 8, 9], sampling=ONE), metadata=key("k-acme"))
        last = list(stream)[-1]
        assert last.usage.cached_tokens == 3 * BS
        with pytest.raises(grpc.RpcError) as other:
            api.GetDocument(pb.GetDocumentRequest(document_id=doc.document_id), metadata=key("k-rival"))
        assert other.value.code() == grpc.StatusCode.NOT_FOUND
        gone = api.DeleteDocument(pb.DeleteDocumentRequest(document_id=doc.document_id), metadata=key("k-acme"))
        assert gone.deleted
        with pytest.raises(grpc.RpcError) as deleted:
            api.GetDocument(pb.GetDocumentRequest(document_id=doc.document_id), metadata=key("k-acme"))
        assert deleted.value.code() == grpc.StatusCode.NOT_FOUND

        chat = [pb.ChatMessage(role="system", content=DOC)]
        doc = api.PutDocument(pb.PutDocumentRequest(messages=chat), metadata=key("k-rival"))
        assert doc.state == pb.DOCUMENT_STATE_READY and doc.ttl_seconds == 3600
        asked = pb.GenerateRequest(messages=[*chat, pb.ChatMessage(role="user", content="Who pays?")], sampling=ONE)
        last = list(api.Generate(asked, metadata=key("k-rival")))[-1]
        assert last.usage.cached_tokens == doc.blocks * BS  # the conversation starts with it
        api.DeleteDocument(pb.DeleteDocumentRequest(document_id=doc.document_id), metadata=key("k-rival"))
    finally:
        channel.close()


def test_a_document_expires_with_its_ttl(served):
    _, http_port, _ = served
    acme = http(http_port, "k-acme")
    doc = acme.post("/v1/documents", json={"text": CONTROL, "ttl_seconds": 2}).json()
    assert doc["state"] == "ready"
    time.sleep(2.5)
    after = acme.get(f"/v1/documents/{doc['id']}").json()
    assert after["state"] == "expired" and after["locations"] == []
    # expired documents do not count against the tenant's two
    kept = [acme.post("/v1/documents", json={"text": DOC + f" copy {i}", "ttl_seconds": 60}) for i in range(2)]
    assert [r.status_code for r in kept] == [200, 200]
    over = acme.post("/v1/documents", json={"text": DOC + " copy 3", "ttl_seconds": 60})
    assert over.status_code == 429 and over.json()["error"]["param"] == "max_documents"
    for r in kept:
        acme.delete(f"/v1/documents/{r.json()['id']}")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"text": DOC, "ttl_seconds": 0}, "ttl_seconds"),
        ({"text": DOC, "ttl_seconds": 10**9}, "ttl_seconds"),
        ({"text": DOC, "ttl_seconds": "60"}, "ttl_seconds"),
        ({"text": DOC, "token_ids": [1, 2, 3]}, "text"),
        ({}, "text"),
        ({"text": "too short"}, "text"),
        ({"text": DOC, "tier": "disk"}, "tier"),
        ({"text": DOC, "tier": "host"}, "tier"),  # (this server has no host tier)
        ({"text": DOC, "replicas": 0}, "replicas"),
        ({"text": DOC, "replicas": 2}, "replicas"),  # (one group)
        ({"text": DOC, "replicas": "2"}, "replicas"),
        ({"text": DOC, "groups": ["no-such-group"]}, "groups[0]"),
        ({"text": DOC, "ttl": 60}, "ttl"),
        ({"token_ids": [1, -2, 3]}, "token_ids"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(served, body, param):
    _, http_port, _ = served
    r = http(http_port, "k-rival").post("/v1/documents", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param or param in error["message"], error


def test_grpc_bad_inputs_are_invalid_argument_naming_the_field(served):
    port, _, _ = served
    channel, api = stub(port)
    try:
        for request, field in [
            (pb.PutDocumentRequest(text=DOC, ttl_seconds=0), "ttl_seconds"),
            (pb.PutDocumentRequest(text=DOC, token_ids=[1, 2]), "exactly one"),
            (pb.PutDocumentRequest(text=DOC, tier="host"), "tier"),
            (pb.PutDocumentRequest(text=DOC, groups=["nope"]), "groups[0]"),
            (pb.PutDocumentRequest(text=DOC, replicas=3), "replicas"),
            (pb.PutDocumentRequest(token_ids=[10**6] * 40), "token"),
        ]:
            with pytest.raises(grpc.RpcError) as refused:
                api.PutDocument(request, metadata=key("k-rival"))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
            assert field in refused.value.details()
        with pytest.raises(grpc.RpcError) as unknown:
            api.GetDocument(pb.GetDocumentRequest(document_id="doc-nope"), metadata=key("k-rival"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "document_id" in unknown.value.details()
    finally:
        channel.close()


def test_pins_over_the_groups_share_are_429(served):
    _, http_port, _ = served
    rival = http(http_port, "k-rival")
    big = rival.post("/v1/documents", json={"text": DOC + " " + CONTROL, "ttl_seconds": 60})
    assert big.status_code == 200 and big.json()["blocks"] > 16, big.text
    # the group pins at most 32 of its 64 blocks (half, and never one whole context's 32)
    over = rival.post("/v1/documents", json={"text": CONTROL + " " + DOC, "ttl_seconds": 60})
    assert over.status_code == 429, over.text
    assert "cannot be pinned" in over.json()["error"]["message"]
    rival.delete(f"/v1/documents/{big.json()['id']}")
    again = rival.post("/v1/documents", json={"text": CONTROL + " " + DOC, "ttl_seconds": 60})
    assert again.status_code == 200  # room again once the first is deleted
    rival.delete(f"/v1/documents/{again.json()['id']}")
