"""TLS on both doors, with certificates the test makes (tests/certs.py): a `pagefleet serve`
with a server certificate and mutual TLS serves clients that present a certificate from its
client CA, over gRPC and over HTTP (the `openai` package on an httpx client), and refuses one
without; a client that does not trust the server's CA refuses the server. Then the doors'
security configuration: keys files, and no open door off loopback.
"""

from __future__ import annotations

import ssl

import grpc
import httpx
import openai
import pytest

from pagefleet.client import Client
from router.door.auth import DEFAULT_TENANT, ApiKeys, is_loopback
from router.launch.build import door_security
from router.launch.config import ServeConfig
from tests.certs import make_certs
from tests.redis_server import free_port
from tests.serve_process import builtin_model_flags, start_serve

START_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def mtls(tmp_path_factory):
    """(process, gRPC client with a client certificate, HTTPS base URL, certs)."""
    tmp = tmp_path_factory.mktemp("tls")
    certs = make_certs(tmp)
    http_port = free_port()
    flags = [
        *builtin_model_flags(),
        f"--http-port={http_port}",
        "--no-metrics",
        "--grace=1",
        f"--tls-cert={certs.server_cert}",
        f"--tls-key={certs.server_key}",
        f"--tls-client-ca={certs.ca}",
        "--max-model-len=256",
        "--num-blocks=64",
    ]
    proc, client = start_serve(
        flags,
        free_port(),
        tmp / "serve.log",
        START_TIMEOUT_S,
        root_certificates=certs.ca.read_bytes(),
        certificate_chain=certs.client_cert.read_bytes(),
        private_key=certs.client_key.read_bytes(),
    )
    try:
        yield proc, client, f"https://127.0.0.1:{http_port}/v1", certs
    finally:
        client.close()
        proc.terminate()
        proc.wait(60)


def https(certs, with_client_cert: bool, trust_ca: bool = True) -> httpx.Client:
    context = ssl.create_default_context(cafile=str(certs.ca) if trust_ca else None)
    if with_client_cert:
        context.load_cert_chain(certs.client_cert, certs.client_key)
    return httpx.Client(verify=context, timeout=30)


def test_both_doors_serve_a_client_with_a_certificate(mtls):
    _, client, url, certs = mtls
    done = client.generate(token_ids=[5, 6, 7], max_tokens=4, temperature=0.0)
    api = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, http_client=https(certs, with_client_cert=True))
    model = api.models.list().data[0].id
    http = api.completions.create(
        model=model, prompt=[5, 6, 7], max_tokens=4, temperature=0.0, extra_body={"return_token_ids": True}
    )
    assert http.choices[0].token_ids == done.token_ids


def test_a_client_without_a_certificate_is_refused_by_both_doors(mtls):
    _, client, url, certs = mtls
    api = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, http_client=https(certs, with_client_cert=False))
    with pytest.raises(openai.APIConnectionError):
        api.models.list()
    with Client(client.target, timeout=10, root_certificates=certs.ca.read_bytes()) as bare:
        with pytest.raises(grpc.RpcError) as err:
            bare.generate("x", max_tokens=1)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with Client(client.target, timeout=10) as plaintext, pytest.raises(grpc.RpcError):
        plaintext.generate("x", max_tokens=1)


def test_a_client_that_does_not_trust_the_servers_ca_refuses_it(mtls):
    _, _, url, certs = mtls
    api = openai.OpenAI(
        base_url=url, api_key="unused", max_retries=0, http_client=https(certs, with_client_cert=True, trust_ca=False)
    )
    with pytest.raises(openai.APIConnectionError) as err:
        api.models.list()
    assert "CERTIFICATE_VERIFY_FAILED" in repr(err.value.__cause__)


# ---- configuration (no server) -------------------------------------------------------------


def test_keys_map_to_their_tenants(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# tenant key\nacme k-acme-1\nacme k-acme-2  # rotated\n\nglobex k-globex\n")
    keys = ApiKeys.load(api_key="k-solo", key_file=str(path))
    assert keys.tenant("Bearer k-acme-1") == keys.tenant("bearer k-acme-2") == "acme"
    assert keys.tenant("Bearer k-globex") == "globex"
    assert keys.tenant("Bearer k-solo") == DEFAULT_TENANT
    for bad in (None, "", "Bearer", "Bearer ", "Basic k-acme-1", "Bearer k-acme-", "k-acme-1"):
        assert keys.tenant(bad) is None, bad
    assert ApiKeys.load() is None


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("acme\n", "line 1"),
        ("ac/me key\n", "line 1"),
        ("a k\nb k\n", "twice"),
        ("# none\n", "no keys"),
    ],
)
def test_a_bad_key_file_is_refused_naming_the_line(tmp_path, text, words):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match=words):
        ApiKeys.load(key_file=str(path))


def test_no_open_door_off_loopback_unless_the_operator_says_so(tmp_path):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0")
    with pytest.raises(ValueError, match="0.0.0.0 is not a loopback address"):
        door_security(ServeConfig.from_mapping({"host": "0.0.0.0"}))
    assert door_security(ServeConfig.from_mapping({"host": "0.0.0.0", "allow_unauthenticated": True})) == (None, None)
    keys, tls = door_security(ServeConfig.from_mapping({"host": "0.0.0.0", "api_key": "k"}))
    assert keys.tenant("Bearer k") == DEFAULT_TENANT and tls is None
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        ServeConfig.from_mapping({"tls_cert": str(tmp_path)})
    with pytest.raises(ValueError, match="tls_key .* is not a file"):
        door_security(ServeConfig.from_mapping({"tls_cert": __file__, "tls_key": str(tmp_path / "missing.pem")}))
