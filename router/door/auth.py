"""Who may call the doors, and over what: API keys (each naming a tenant) and TLS files.

Both doors read a key the same way: gRPC from the `authorization` metadata, HTTP from the
`Authorization` header, each as `Bearer KEY`. A key is compared in constant time against every
configured key (the SHA-256 digests of the keys, each compared with `hmac.compare_digest`, and
no early exit), so neither a key's content nor which key matched shows in the time taken. The
key's tenant is the request's prefix-cache namespace (worker/hashing.py: cache_namespace): a
client cannot choose another tenant's blocks by naming it.

A key file has one key per line, `TENANT KEY` (whitespace between, `#` starts a comment); a
tenant may have several keys (rotation). `--api-key KEY` alone is the tenant `default`. After
the key, a line may give its tenant's weight and limits as `FIELD=VALUE` words, the fields of
the YAML `tenants:` section (router/door/limits.py), e.g.

    acme  sk-acme-1  weight=2 requests_per_s=5 tokens_per_min=60000 concurrent=4 kv_quota=0.25

so that the tenants are configured in one place (`key_file_tenants`; two lines of one tenant
giving one field two values are refused, naming both lines).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import socket
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TENANT = "default"  # the tenant of a key given as `--api-key`
_TENANT = re.compile(r"[A-Za-z0-9_.\-]{1,128}")  # as the gRPC API's `tenant` field
_KEY = re.compile(r"[\x21-\x7e]{1,512}")  # printable ASCII, no spaces: a header value


class ApiKeys:
    """The configured keys, as digests, each with its tenant."""

    def __init__(self, keys: dict[str, str]) -> None:
        """`keys`: key -> tenant."""
        if not keys:
            raise ValueError("ApiKeys needs at least one key")
        self._digests = [(_digest(k), t) for k, t in keys.items()]
        self.tenants = frozenset(keys.values())

    @classmethod
    def load(cls, api_key: str | None = None, key_file: str | None = None) -> ApiKeys | None:
        """The keys of `--api-key` and `--api-key-file`; None when neither is given."""
        keys: dict[str, str] = {}
        if api_key is not None:
            if not _KEY.fullmatch(api_key):
                raise ValueError("api_key must be 1-512 printable ASCII characters, no spaces")
            keys[api_key] = DEFAULT_TENANT
        if key_file is not None:
            for key, tenant in read_key_file(key_file):
                if key in keys:
                    raise ValueError(f"api_key_file {key_file}: a key is given twice")
                keys[key] = tenant
        return cls(keys) if keys else None

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of an `Authorization` value (`Bearer KEY`); None if it names no key."""
        if authorization is None:
            return None
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key:
            return None
        given, found = _digest(key.strip()), None
        for digest, tenant in self._digests:  # every key, whatever matched
            if hmac.compare_digest(given, digest):
                found = tenant
        return found


def read_key_file(path: str) -> list[tuple[str, str]]:
    """(key, tenant) per line of a key file; ValueError naming the file and line."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"api_key_file {path}: {e.strerror}") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) < 2 or not _TENANT.fullmatch(parts[0]) or not _KEY.fullmatch(parts[1]):
            raise ValueError(
                f"api_key_file {path} line {n}: expected 'TENANT KEY [FIELD=VALUE ...]' (tenant: 1-128 "
                "of [A-Za-z0-9_.-]; key: 1-512 printable ASCII characters, no spaces)"
            )
        out.append((parts[1], parts[0]))
    if not out:
        raise ValueError(f"api_key_file {path} has no keys")
    return out


def key_file_tenants(path: str) -> dict[str, dict[str, object]]:
    """The tenants' fields a key file gives (`FIELD=VALUE` after a line's key), tenant ->
    {field: value}, each value read as a YAML scalar (`2`, `0.25`, `64MiB`); every tenant of
    the file is named, with no fields when none are given. ValueError naming the file, the line
    and the field for a word that is not `FIELD=VALUE` or a field given two values. The fields
    themselves are checked with the YAML section's (router/door/limits.py: parse_tenants)."""
    import yaml

    read_key_file(path)  # (the lines' tenants and keys checked)
    out: dict[str, dict[str, object]] = {}
    where: dict[tuple[str, str], int] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        parts = line.split("#", 1)[0].split()
        if not parts:
            continue
        tenant = parts[0]
        fields = out.setdefault(tenant, {})
        for word in parts[2:]:
            name, eq, text = word.partition("=")
            if not eq or not name or not text:
                raise ValueError(f"api_key_file {path} line {n}: {word!r} is not FIELD=VALUE (e.g. weight=2)")
            try:
                value = yaml.safe_load(text)
            except yaml.YAMLError:
                value = text
            if (tenant, name) in where and fields[name] != value:
                raise ValueError(
                    f"api_key_file {path} line {n}: {tenant}.{name} is {value!r} here and {fields[name]!r} "
                    f"on line {where[tenant, name]}: give it once"
                )
            where.setdefault((tenant, name), n)
            fields[name] = value
    return out


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class TlsFiles:
    """The server's certificate chain and key (PEM), and for mutual TLS the CA that signs
    client certificates: a client without a certificate from it is refused."""

    cert: str
    key: str
    client_ca: str | None = None

    def __post_init__(self) -> None:
        for name in ("cert", "key", "client_ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"tls_{name} {path!r} is not a file")

    def grpc_credentials(self):
        """`grpc.ServerCredentials` for `add_secure_port`."""
        import grpc

        ca = None if self.client_ca is None else Path(self.client_ca).read_bytes()
        pair = (Path(self.key).read_bytes(), Path(self.cert).read_bytes())
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def uvicorn_options(self) -> dict:
        """`uvicorn.Config` keywords."""
        import ssl

        options = {"ssl_certfile": self.cert, "ssl_keyfile": self.key}
        if self.client_ca is not None:
            options |= {"ssl_ca_certs": self.client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        return options


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) binds loopback only."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)
