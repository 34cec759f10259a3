"""KV quotas on a real `pagefleet serve` (built-in model, a 64-block pool): tenant A floods the
cache with prompts totalling 10x its quota while tenant B's three prompts stay cached, B's cached
tokens (usage, through the project's gRPC client) the same before and after the flood; the
per-tenant cache and eviction series on /metrics show A's own evictions and none of B's.
"""

from __future__ import annotations

import re
import urllib.request

import pytest
from test_cli_serve import READY_WITHIN_S, free_port, start_serve

from pagefleet.client import Client

TENANTS_YAML = """
tenants:
  A: {kv_quota: 0.125}
  B: {kv_quota: 0.25}
"""
BS = 16
B_DOCS = [" ".join(f"report {d} line {i} states the figure {i * 11 + d} exactly;" for i in range(5)) for d in range(3)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quotas")
    (tmp / "serve.yaml").write_text(TENANTS_YAML)
    (tmp / "keys").write_text("A k-a\nB k-b\n")
    port, metrics_port = free_port(), free_port()
    proc = start_serve(
        tmp / "serve.log",
        *("--model", "builtin", "--config", str(tmp / "serve.yaml"), "--api-key-file", str(tmp / "keys")),
        *("--port", str(port), "--metrics-port", str(metrics_port)),
        *("--num-blocks", "64", "--block-size", str(BS), "--max-model-len", "512"),
    )
    a = Client(f"127.0.0.1:{port}", timeout=60, api_key="k-a")
    b = Client(f"127.0.0.1:{port}", timeout=60, api_key="k-b")
    try:
        a.wait_ready(timeout=READY_WITHIN_S)
        yield a, b, metrics_port
    finally:
        a.close()
        b.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def series(metrics_port: int, name: str) -> dict[str, float]:
    """Tenant -> the value of `name` (summed over groups)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(rf'^pagefleet:{name}(?:_total)?{{[^}}]*tenant="([^"]*)"[^}}]*}} (\S+)$', text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def test_b_keeps_its_cached_prompts_under_a_flood_of_10x_a_quota(served):
    a, b, metrics_port = served
    for doc in B_DOCS:  # cached once
        b.generate(doc, max_tokens=1)
    before = [b.generate(doc, max_tokens=1).cached_tokens for doc in B_DOCS]
    assert all(n >= 2 * BS for n in before), before
    flooded = 0
    i = 0
    while flooded < 10 * 8 * BS:  # A's quota: 8 of the 64 blocks; 10x that in prompt tokens
        done = a.generate(" ".join(f"flood {i} item {j} is {j * 13 + i};" for j in range(6)), max_tokens=1)
        flooded += done.prompt_tokens
        i += 1
    after = [b.generate(doc, max_tokens=1).cached_tokens for doc in B_DOCS]
    assert after == before
    suffered = series(metrics_port, "tenant_kv_evictions_suffered")
    caused = series(metrics_port, "tenant_kv_evictions_caused")
    assert suffered.get("A", 0) > 0 and caused.get("A", 0) > 0  # A's own evictions
    assert suffered.get("B", 0) == 0
    blocks = series(metrics_port, "tenant_kv_cache_blocks")
    cache_bytes = series(metrics_port, "tenant_kv_cache_bytes")
    assert blocks["B"] >= sum(before) // BS and cache_bytes["B"] > 0
