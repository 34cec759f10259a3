"""What `pagefleet serve` builds: a `ServeConfig` of five typed sections, from flags and YAML.

The YAML file (`--config`) is one flat mapping whose keys are the flags' names (dashes or
underscores), plus `engine:` (the engine's options), `policy_options:`, `http_headers:` and
`tenants:`; each key belongs to one section:

- `DoorsConfig`: where the doors and the metrics endpoint listen, and what bounds a request;
- `SecurityConfig`: the API keys and TLS files of both doors;
- `ClusterConfig`: the groups (how many, how placed, this process's role), the index, the policy;
- `EngineSection`: the model and the flat options of every group's `EngineConfig`;
- `TenantsConfig`: each tenant's weight and limits (router/door/limits.py), from `tenants:` and
  the API key file's `FIELD=VALUE` words (router/door/auth.py), one set of tenants.

A key no section knows, and a value a section refuses, is a ValueError naming the key, before
anything binds or loads. Environment variables are read here and in worker/config.py only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from router.door.auth import key_file_tenants
from router.door.http import DEFAULT_HTTP_PORT
from router.door.http_limits import HeaderLimits
from router.door.limits import KV_QUOTA_FIELDS, TenantLimits, merge_tenants, parse_tenants
from router.door.server import DEFAULT_PORT, MAX_MESSAGE_BYTES
from worker.config import EngineConfig
from worker.model_source import check_model_name

DEFAULT_METRICS_PORT = 9151


class ServeError(RuntimeError):
    """The server cannot start as configured; the message tells the operator what to change."""


def _check_port(name: str, value: object) -> None:
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 65536):
        raise ValueError(f"{name} must be a port number in [0, 65535], got {value!r}")


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_mapping(name: str, value: object) -> None:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a mapping, got {value!r}")


@dataclass(frozen=True)
class DoorsConfig:
    """Where both doors (one host) and the metrics endpoint listen; what bounds a request."""

    host: str = "127.0.0.1"  # not loopback needs a key or allow_unauthenticated
    port: int = DEFAULT_PORT  # gRPC
    http_port: int | None = DEFAULT_HTTP_PORT  # the OpenAI-compatible door; None: none
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = DEFAULT_METRICS_PORT  # None: no metrics endpoint
    max_message_bytes: int = MAX_MESSAGE_BYTES
    # the HTTP door's bounds on a request's headers (YAML: {max_bytes, max_count, timeout_s})
    http_headers: HeaderLimits = field(default_factory=HeaderLimits)
    grace_s: float = 30.0  # SIGTERM: how long in-flight calls may finish

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port", "http_port"):
            _check_port(name, getattr(self, name))
        _check_positive("max_message_bytes", self.max_message_bytes)
        if not isinstance(self.grace_s, int | float) or not self.grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s!r}")


@dataclass(frozen=True)
class SecurityConfig:
    """Who may call the doors, and over what (router/door/auth.py reads the files)."""

    api_key: str | None = None  # one key, of the tenant "default"
    api_key_file: str | None = None  # one `TENANT KEY` per line
    allow_unauthenticated: bool = False  # serve without keys on a non-loopback host
    tls_cert: str | None = None  # PEM certificate chain of both doors
    tls_key: str | None = None
    tls_client_ca: str | None = None  # mutual TLS: clients need a certificate from this CA

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")


@dataclass(frozen=True)
class ClusterConfig:
    """The groups this process serves, where they run, and how a request picks one."""

    name: str = "pagefleet"  # YAML `cluster`: the index's namespace and the Ray namespace's name
    # "all": this process runs the router and its groups (in-process, or on Ray with a
    # supervisor of its own); "router": a router over the groups of the cluster `name`, which
    # `pagefleet groups start` placed (needs `address` and `redis`)
    role: str = "all"
    groups: int = 1
    tp: int = 1  # devices per group (tensor parallel)
    device: str = "cpu"  # "cuda" gives group i device cuda:i (in-process groups)
    redis: str | None = None  # redis://host:port for the shared prefix index (and limits)
    address: str | None = None  # Ray address ("auto", "ray://head:10001"); None: see `ray`
    ray: bool = False  # Ray-placed groups on a local runtime even for one TP=1 group
    policy: str = "prefix_aware"
    # the policy's config fields, e.g. {"load_slack": 0.2} (router/placement/registry.py)
    policy_options: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        _check_positive("tp", self.tp)
        _check_positive("groups", self.groups)
        _check_mapping("policy_options", self.policy_options)
        if self.role not in ("all", "router"):
            raise ValueError(f"role must be 'all' or 'router', got {self.role!r}")
        if self.role == "router" and (self.address is None or self.redis is None):
            raise ValueError("role 'router' needs address (the Ray cluster) and redis (its index)")

    @property
    def uses_ray(self) -> bool:
        """Whether the groups are Ray-placed (one in-process TP=1 group is the default)."""
        return self.ray or self.tp > 1 or self.groups > 1 or self.address is not None


@dataclass(frozen=True)
class EngineSection:
    """The model every group runs and the flat options of its `EngineConfig`."""

    model: str | None = None  # model dir or .gguf; None: the default model; "builtin": random
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)  # YAML `engine`

    def __post_init__(self) -> None:
        check_model_name(self.model)
        if not isinstance(self.options, Mapping):
            raise ValueError(f"engine must be a mapping of engine options, got {self.options!r}")

    def engine_config(self, **extra: Any) -> EngineConfig:
        """The groups' `EngineConfig` (resolving the model's name), `extra` over the options."""
        return EngineConfig.from_options(self.model, **{**self.options, **extra})


@dataclass(frozen=True)
class TenantsConfig:
    """The tenants the configuration names, each with its weight and limits (YAML `tenants`)."""

    limits: Mapping[str, TenantLimits] = field(default_factory=dict, hash=False)

    @classmethod
    def parse(cls, section: object, key_file: str | None = None) -> TenantsConfig:
        """The YAML section checked, naming the tenant and the field (router/door/limits.py),
        merged with the weights and limits the API key file gives (`TENANT KEY FIELD=VALUE`,
        router/door/auth.py); a field both give two values is refused, naming both."""
        if key_file is None or not Path(key_file).is_file():
            # (a key file that is not there yet, e.g. a secret mounted in the pod that runs the
            # configuration, is the door's to refuse when it starts: router/door/auth.py)
            return cls(parse_tenants(section))  # type: ignore[arg-type]
        if section is not None and not isinstance(section, Mapping):
            raise ValueError("tenants must be a mapping of tenant name to its limits")
        return cls(merge_tenants(section, key_file_tenants(key_file), f"api_key_file {key_file}"))

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.limits)

    @property
    def limited(self) -> bool:
        """Whether any tenant has a limit the doors enforce."""
        return any(lim.limited for lim in self.limits.values())

    @property
    def max_documents(self) -> dict[str, int]:
        """The tenants whose number of documents is limited, with their limits."""
        return {t: lim.max_documents for t, lim in self.limits.items() if lim.max_documents is not None}

    @property
    def kv_quotas(self) -> dict[str, float | int]:
        """The tenants with a KV quota, each a share or bytes (CacheConfig.tenant_kv_quotas)."""
        return self._quotas("kv_quota")

    def _quotas(self, name: str) -> dict[str, float | int]:
        return {t: getattr(lim, name) for t, lim in self.limits.items() if getattr(lim, name) is not None}

    @property
    def weights(self) -> dict[str, float]:
        """Each named tenant's weight in a group's fair share (SchedulerConfig.tenant_weights)."""
        return {t: lim.weight for t, lim in self.limits.items()}

    def engine_options(self) -> dict[str, Any]:
        """What the groups' engines take of the tenants: their weights in the fair share
        (SchedulerConfig.tenant_weights) and their KV quotas per tier (CacheConfig.tenant_kv_quotas,
        tenant_kv_host_quotas, tenant_kv_disk_quotas);
        the same for `pagefleet serve`'s groups and `pagefleet groups start`'s."""
        options: dict[str, Any] = {"tenant_weights": self.weights} if self.limits else {}
        for name, option in KV_QUOTA_FIELDS.items():
            if quotas := self._quotas(name):
                options[option] = quotas
        return options


# The flat keys whose name differs from their section's field; every other key is the field's.
_RENAMED = {"cluster": ("cluster", "name"), "model": ("engine", "model"), "engine": ("engine", "options")}
_SECTIONS = {
    "doors": DoorsConfig,
    "security": SecurityConfig,
    "cluster": ClusterConfig,
    "engine": EngineSection,
}


def _key_table() -> dict[str, tuple[str, str]]:
    table = {f.name: (section, f.name) for section, cls in _SECTIONS.items() for f in fields(cls)}
    table = {k: v for k, v in table.items() if v not in _RENAMED.values()}
    return {**table, **_RENAMED, "tenants": ("tenants", "limits")}


KEYS = _key_table()  # flat key (a flag's name) -> (section, field)


@dataclass(frozen=True)
class ServeConfig:
    """What `pagefleet serve` builds, in five sections; `from_mapping` takes the flat keys."""

    doors: DoorsConfig = field(default_factory=DoorsConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    engine: EngineSection = field(default_factory=EngineSection)
    tenants: TenantsConfig = field(default_factory=TenantsConfig)

    def __post_init__(self) -> None:
        if self.tenants.limits and "tenant_weights" in self.engine.options:
            raise ValueError("engine.tenant_weights: give each tenant's weight in tenants: instead, not both")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ServeConfig:
        """From a YAML mapping or flags; keys may use dashes (`metrics-port`)."""
        normal = {str(k).replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(normal) - set(KEYS))
        if unknown:
            raise ValueError(f"unknown serve option(s) {unknown}; known: {sorted(KEYS)}")
        by_section: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        for key, value in normal.items():
            section, name = KEYS[key]
            if section != "tenants":
                by_section[section][name] = value
        if "http_headers" in by_section["doors"]:
            by_section["doors"]["http_headers"] = _header_limits(by_section["doors"]["http_headers"])
        made = {name: cls_(**by_section[name]) for name, cls_ in _SECTIONS.items()}
        tenants = TenantsConfig.parse(normal.get("tenants"), made["security"].api_key_file)
        return cls(**made, tenants=tenants)


def _header_limits(values: object) -> HeaderLimits:
    _check_mapping("http_headers", values)
    known = sorted(f.name for f in fields(HeaderLimits))
    unknown = sorted(set(values) - set(known))  # type: ignore[arg-type]
    if unknown:
        raise ValueError(f"http_headers: unknown field(s) {unknown}; known fields are {', '.join(known)}")
    return HeaderLimits(**values)  # type: ignore[arg-type]  (its ValueError names the field)


def load_config(path: str | None, overrides: Mapping[str, Any]) -> ServeConfig:
    """The YAML file at `path` (if any), with `overrides` (flags the user gave; None: not given)
    on top; the engine's options merge, a flag's over the file's."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"--config {path}: {e}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"--config {path}: expected a mapping of serve options")
        values.update({str(k).replace("-", "_"): v for k, v in loaded.items()})
    given = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(values.get("engine"), Mapping) and "engine" in given:
        given["engine"] = {**values["engine"], **given["engine"]}
    values.update(given)
    return ServeConfig.from_mapping(values)
