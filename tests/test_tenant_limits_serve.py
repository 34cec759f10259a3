"""Tenants configured in one place, enforced at both doors of a real `pagefleet serve`.

The YAML's `tenants:` section gives "trial" one request per 20 s and "acme" no limit; the key
file maps each key to its tenant. Over its limit, trial is refused with HTTP 429 and a
Retry-After header (the official `openai` client) and with gRPC RESOURCE_EXHAUSTED and a retry
hint in the trailers (the project's client); acme, on the same server, is served throughout. A
bad `tenants:` section stops the server at start, naming the tenant and the field.
"""

from __future__ import annotations

import time

import grpc
import openai
import pytest
from test_cli_serve import free_port, pagefleet, serving_tenants

from pagefleet.client import Client

TENANTS_YAML = """
tenants:
  trial: {requests_per_s: 0.05}
  acme: {weight: 2}
"""


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    with serving_tenants(tmp, TENANTS_YAML, "trial k-trial\nacme k-acme\n", "k-acme") as served:
        yield served


def http_client(http_port: int, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=key, max_retries=0, timeout=60)


def test_a_tenant_over_its_rate_gets_429_with_retry_after_and_others_are_served(limited):
    _, http_port, _ = limited
    trial, acme = http_client(http_port, "k-trial"), http_client(http_port, "k-acme")
    first = trial.completions.create(model="builtin-v1", prompt="The baker", max_tokens=2)
    assert first.choices[0].finish_reason == "length"
    with pytest.raises(openai.RateLimitError) as refused:
        trial.completions.create(model="builtin-v1", prompt="The baker", max_tokens=2)
    assert refused.value.status_code == 429
    wait = float(refused.value.response.headers["retry-after"])
    assert 0 < wait <= 20
    for _ in range(3):  # another tenant's requests pass on the same server meanwhile
        assert acme.completions.create(model="builtin-v1", prompt="The baker", max_tokens=2).choices


def test_grpc_refuses_the_same_tenant_with_resource_exhausted_and_a_retry_hint(limited):
    port, _, _ = limited
    trial, acme = (Client(f"127.0.0.1:{port}", timeout=60, api_key=key) for key in ("k-trial", "k-acme"))
    try:
        codes = []
        for _ in range(2):  # the first may pass if the HTTP test's window ran out; one is refused
            try:
                trial.generate("The baker", max_tokens=2)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
                trailers = dict(e.trailing_metadata() or ())
                assert float(trailers["retry-after"]) > 0
                assert int(trailers["grpc-retry-pushback-ms"]) > 0
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes, codes
        assert acme.generate("The baker", max_tokens=2).token_ids
    finally:
        trial.close()
        acme.close()


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ("tenants:\n  trial: {requests_per_sec: 1}\n", "tenants.trial: unknown field"),
        ("tenants:\n  trial: {concurrent: 0}\n", "tenants.trial.concurrent"),
        ("tenants:\n  trial: {weight: -1}\n", "tenants.trial.weight"),
    ],
)
def test_a_bad_tenants_section_stops_the_server_naming_tenant_and_field(tmp_path, section, words):
    path = tmp_path / "serve.yaml"
    path.write_text(section)
    started = time.monotonic()
    done = pagefleet("serve", "--model", "builtin", "--config", str(path), "--port", str(free_port()), timeout=120)
    assert done.returncode != 0 and words in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - started < 60  # refused before any group loads
