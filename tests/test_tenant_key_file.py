"""Tenants configured in the API key file: `TENANT KEY FIELD=VALUE ...` gives a tenant's weight
and limits, the same fields as the YAML `tenants:` section, merged with it into one set.

A real `pagefleet serve` enforces a limit the key file alone gives at both doors (HTTP 429 with
the official `openai` client, gRPC RESOURCE_EXHAUSTED with the project's client); a bad field
stops it at start naming the file, the tenant and the field; `pagefleet groups start` hands the
groups' engines the same weights and KV quotas `serve` does.
"""

from __future__ import annotations

import time

import grpc
import openai
import pytest
from test_cli_serve import free_port, pagefleet, serving_tenants

from pagefleet.cli import build_parser
from pagefleet.client import Client
from pagefleet.groups_run import _spec
from router.launch.build import engine_config
from router.launch.config import ServeConfig, load_config

KEYS = """\
# tenant  key        fields
trial     k-trial    requests_per_s=0.05
acme      k-acme-1   weight=2 kv_quota=0.25
acme      k-acme-2   concurrent=4      # a second key of acme (rotation) adds a field
free      k-free
"""


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_key_files_fields_are_the_tenants_and_merge_with_the_yaml_section(tmp_path):
    keys = write(tmp_path, "keys", KEYS)
    config = ServeConfig.from_mapping(
        {"model": "builtin", "api_key_file": keys, "tenants": {"free": {"tokens_per_min": 1000}}}
    )
    limits = config.tenants.limits
    assert limits["trial"].requests_per_s == 0.05 and limits["trial"].limited
    assert (limits["acme"].weight, limits["acme"].kv_quota, limits["acme"].concurrent) == (2, 0.25, 4)
    assert limits["free"].tokens_per_min == 1000
    engine = engine_config(config, "s" * 32)
    assert engine.scheduler.tenant_weights == {"trial": 1.0, "acme": 2, "free": 1.0}
    assert engine.cache.tenant_kv_quotas == {"acme": 0.25}


@pytest.mark.parametrize(
    ("keys", "tenants", "words"),
    [
        ("acme k1 wieght=2\n", None, "api_key_file {path}: tenants.acme: unknown field(s) ['wieght']"),
        ("acme k1 concurrent=0\n", None, "tenants.acme.concurrent must be an integer > 0, got 0"),
        ("acme k1 kv_quota=1.5\n", None, "tenants.acme.kv_quota"),
        ("acme k1 weight\n", None, "api_key_file {path} line 1: 'weight' is not FIELD=VALUE"),
        ("acme k1 weight=2\nacme k2 weight=3\n", None, "line 2: acme.weight is 3 here and 2 on line 1"),
        ("acme k1 weight=2\n", {"acme": {"weight": 3}}, "tenants.acme.weight is 3 in tenants: and 2 in api_key_file"),
    ],
)
def test_bad_or_conflicting_fields_are_refused_naming_the_tenant_and_field(tmp_path, keys, tenants, words):
    path = write(tmp_path, "keys", keys)
    with pytest.raises(ValueError) as refused:
        ServeConfig.from_mapping({"api_key_file": path, "tenants": tenants})
    assert words.format(path=path) in str(refused.value)


def test_one_value_given_in_both_places_is_no_conflict(tmp_path):
    path = write(tmp_path, "keys", "acme k1 weight=2\n")
    config = ServeConfig.from_mapping({"api_key_file": path, "tenants": {"acme": {"weight": 2, "concurrent": 1}}})
    assert (config.tenants.limits["acme"].weight, config.tenants.limits["acme"].concurrent) == (2, 1)


def test_groups_start_gives_its_engines_the_tenants_serve_gives(tmp_path):
    keys = write(tmp_path, "keys", KEYS)
    yaml = write(tmp_path, "serve.yaml", "tenants:\n  free: {weight: 3, kv_quota: 64MiB}\nengine: {block_size: 16}\n")
    argv = ["groups", "start", "--address", "auto", "--redis", "redis://127.0.0.1:1", "--model", "builtin"]
    args = build_parser().parse_args([*argv, "--config", yaml, "--api-key-file", keys])
    spec = _spec(args)
    served = engine_config(load_config(yaml, {"api_key_file": keys, "model": "builtin"}), "s" * 32)
    assert (
        spec.engine.scheduler.tenant_weights == served.scheduler.tenant_weights == {"free": 3, "trial": 1.0, "acme": 2}
    )
    assert spec.engine.cache.tenant_kv_quotas == served.cache.tenant_kv_quotas == {"free": 64 << 20, "acme": 0.25}
    assert spec.engine.cache.block_size == 16
    bad = build_parser().parse_args([*argv, "--api-key-file", write(tmp_path, "bad", "acme k1 weight=-1\n")])
    with pytest.raises(ValueError, match="tenants.acme.weight must be a number > 0"):
        _spec(bad)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keyfile")
    with serving_tenants(tmp, "{}\n", KEYS, "k-acme-1") as served:
        yield served


def test_a_limit_the_key_file_gives_is_enforced_at_both_doors(keyed):
    port, http_port, _ = keyed
    trial = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="k-trial", max_retries=0, timeout=60)
    acme = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="k-acme-2", max_retries=0, timeout=60)
    assert trial.completions.create(model="builtin-v1", prompt="The baker", max_tokens=2).choices
    with pytest.raises(openai.RateLimitError) as refused:
        trial.completions.create(model="builtin-v1", prompt="The baker", max_tokens=2)
    assert 0 < float(refused.value.response.headers["retry-after"]) <= 20
    assert acme.completions.create(model="builtin-v1", prompt="The baker", max_tokens=2).choices
    client = Client(f"127.0.0.1:{port}", timeout=60, api_key="k-trial")
    try:
        with pytest.raises(grpc.RpcError) as rpc:
            client.generate("The baker", max_tokens=2)
        assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        client.close()


def test_a_bad_key_file_field_stops_the_server_at_start(tmp_path):
    keys = write(tmp_path, "keys", "acme k1 requests_per_s=fast\n")
    started = time.monotonic()
    args = ("--model", "builtin", "--api-key-file", keys, "--port", str(free_port()))
    done = pagefleet("serve", *args, timeout=120)
    assert done.returncode != 0 and "tenants.acme.requests_per_s must be a number > 0" in done.stderr, done.stderr[
        -2000:
    ]
    assert "Traceback" not in done.stderr
    assert time.monotonic() - started < 60
