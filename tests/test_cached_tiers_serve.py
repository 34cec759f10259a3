"""Cached tokens by tier on a real `pagefleet serve` (built-in model, a device pool of 40 blocks
and a host tier), through both doors: a question on a document still on the device reports its
cached tokens under device, one asked after the document was pushed off the device (onto the
host tier) under host, each beside the router's prediction; the Prometheus counters by tier
add up to what the responses said.

HTTP calls go through the official `openai` client (the tiers are an extra field of
`usage.prompt_tokens_details`, which it keeps), gRPC ones through the generated stub.
"""

from __future__ import annotations

import re
import urllib.request

import grpc
import openai
import pytest

from protos.pagefleet.v1 import pagefleet_pb2 as pb
from protos.pagefleet.v1 import pagefleet_pb2_grpc as pb_grpc
from tests.redis_server import free_port
from tests.serve_process import builtin_model_flags, start_serve

BS = 16
TIERS = ("device", "host", "disk", "pull")
DOC = [(7 * i + 11) % 500 + 3 for i in range(BS * 8)]  # 8 blocks
QUESTIONS = ([1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(gRPC stub, openai client, model name, /metrics URL, the project's client)."""
    tmp = tmp_path_factory.mktemp("cached-tiers")
    http_port, metrics_port, port = free_port(), free_port(), free_port()
    flags = [
        *builtin_model_flags(),
        f"--http-port={http_port}",
        f"--metrics-port={metrics_port}",
        "--grace=1",
        f"--block-size={BS}",
        "--max-model-len=512",
        "--num-blocks=40",
        "--kv-host-bytes=16MiB",
    ]
    proc, client = start_serve(flags, port, tmp / "serve.log", 240)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0, timeout=60)
    try:
        model, url = client.model_info().model, f"http://127.0.0.1:{metrics_port}/metrics"
        yield pb_grpc.PageFleetStub(channel), oa, model, url, client
    finally:
        channel.close()
        client.close()
        proc.terminate()
        proc.wait(60)


def grpc_ask(stub, ids: list[int]) -> tuple[pb.Placement, pb.Usage]:
    request = pb.GenerateRequest(token_ids=ids, sampling=pb.SamplingParams(max_tokens=2))
    responses = list(stub.Generate(request, timeout=60))
    return responses[0].placement, responses[-1].usage


def http_ask(oa, model: str, ids: list[int]):
    """(usage's cached tokens, its tiers, the router's predicted tiers, the tokens)."""
    out = oa.completions.create(model=model, prompt=ids, max_tokens=2, temperature=0.0)
    details = out.usage.prompt_tokens_details
    (row,) = out.model_extra["pagefleet"]["choices"]
    return details.cached_tokens, details.model_extra["cached_tokens_by_tier"], row["predicted_cached_tiers"], out


def tiers(message: pb.CachedTiers) -> dict[str, int]:
    return {t: getattr(message, t) for t in TIERS}


def scraped(url: str) -> dict[tuple[str, str], float]:
    """(series, tier) -> the value summed over groups, of the two by-tier counters."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[tuple[str, str], float] = {}
    for name, labels, value in re.findall(r"^pagefleet:(\w+_cached_tier_tokens)_total\{([^}]*)\} (\S+)$", text, re.M):
        tier = re.search(r'tier="(\w+)"', labels).group(1)
        out[(name, tier)] = out.get((name, tier), 0.0) + float(value)
    return out


def test_a_device_hit_and_a_host_restore_report_their_tiers_in_both_doors_and_the_metrics(served):
    stub, oa, model, metrics, client = served
    before = scraped(metrics)
    said = {t: 0 for t in TIERS}  # what the responses reported, by tier
    guessed = {t: 0 for t in TIERS}
    cold = grpc_ask(stub, DOC + QUESTIONS[0])[1]
    assert cold.cached_tokens == 0 and tiers(cold.cached_tiers) == dict.fromkeys(TIERS, 0)

    # on the device: both doors say device, as the router predicted
    cached, by_tier, predicted, _ = http_ask(oa, model, DOC + QUESTIONS[1])
    assert cached == len(DOC) and by_tier == {**dict.fromkeys(TIERS, 0), "device": len(DOC)}
    assert predicted == by_tier
    placement, usage = grpc_ask(stub, DOC + QUESTIONS[2])
    assert usage.cached_tokens == len(DOC) and tiers(usage.cached_tiers) == by_tier
    assert tiers(placement.predicted_cached_tiers) == by_tier
    assert client.generate(token_ids=DOC + [13, 14], max_tokens=2).cached_tiers == by_tier  # pagefleet.Client
    for t in TIERS:
        said[t] += by_tier[t] * 3
        guessed[t] += by_tier[t] * 3

    # two other prompts of 30 blocks each take the device pool's 40: the document's blocks
    # go to the host tier, and the next question restores them from there (once per door)
    host = {**dict.fromkeys(TIERS, 0), "host": len(DOC)}
    for door, question in (("http", DOC + QUESTIONS[3]), ("grpc", DOC + QUESTIONS[0][::-1])):
        for k in range(2):
            grpc_ask(stub, [(13 * i + 101 * k + (door == "grpc")) % 900 + 1 for i in range(BS * 30)])
        if door == "http":
            cached, by_tier, predicted, _ = http_ask(oa, model, question)
        else:
            placement, usage = grpc_ask(stub, question)
            cached, by_tier, predicted = (
                usage.cached_tokens,
                tiers(usage.cached_tiers),
                tiers(placement.predicted_cached_tiers),
            )
        assert (cached, by_tier) == (len(DOC), host), door
        assert predicted == by_tier, door  # the index saw the blocks leave the device for the host
        for t in TIERS:
            said[t] += by_tier[t]
            guessed[t] += predicted[t]

    after = scraped(metrics)
    for t in TIERS:
        assert after[("actual_cached_tier_tokens", t)] - before.get(("actual_cached_tier_tokens", t), 0) == said[t]
        assert (
            after[("predicted_cached_tier_tokens", t)] - before.get(("predicted_cached_tier_tokens", t), 0)
            == (guessed[t])
        )
