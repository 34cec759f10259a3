"""Frozen configuration of one group's engine. Environment variables are read only here."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from decimal import Decimal, InvalidOperation
from typing import Any

from worker.model_source import check_model, resolve_model

POLICIES = ("fcfs", "priority")
# "auto": the model's dtype; int8 and fp8 (float8 e4m3, "fp8_e4m3") are 8-bit caches with
# scales (worker/exec/kv_pool.py says which granularity each has, and why).
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "fp8", "fp8_e4m3")
# How the linear layers hold their weights (worker/model/layers/quant.py); "auto": quantized
# for a GGUF file whose layers are (int4 for Q4 blocks, else int8), float otherwise
# (worker/model/dtypes.py: resolve_weight_dtype).
WEIGHT_DTYPES = ("auto", "float", "int8", "int4")
CLUSTER_SECRET_ENV = "PAGEFLEET_CLUSTER_SECRET"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 128  # running requests at most
    max_model_len: int = 4096  # prompt + output tokens of one request
    policy: str = "fcfs"
    max_waiting: int = 4096  # beyond this, new requests are refused (QueueFullError)
    watermark: float = 0.01  # fraction of blocks kept free when admitting, against thrash
    # start a decode step's forward before the last one's tokens are processed
    # (worker/exec/overlap.py); None: on for a CUDA device, off on CPU
    overlap: bool | None = None
    # tenant -> its weight in the fair share of the group's tokens (worker/engine/fair_queue.py);
    # a tenant not named weighs 1
    tenant_weights: Mapping[str, float] = field(default_factory=dict, hash=False)
    # while several tenants have requests, the prompt tokens one step computes for tenants over
    # their weighted share of the running requests (fewer by the others' prompt tokens in it):
    # bounds how long a heavy tenant's prefill step delays another's new request; None: no bound.
    # 128 by benchmarks/tenants.py: B's TTFT p99 1.18x alone against 2.09x unbounded, A's output
    # tokens/s within 0.3%; one tenant alone is never bounded
    over_share_prefill_tokens: int | None = 128

    def __post_init__(self) -> None:
        _positive(self, "max_num_batched_tokens", "max_num_seqs", "max_model_len", "max_waiting")
        if self.over_share_prefill_tokens is not None and self.over_share_prefill_tokens < 0:
            raise ValueError(f"over_share_prefill_tokens must be >= 0, got {self.over_share_prefill_tokens}")
        for tenant, weight in self.tenant_weights.items():
            if not isinstance(weight, int | float) or not weight > 0:
                raise ValueError(f"tenant_weights[{tenant!r}] must be a number > 0, got {weight!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from the memory budget
    kv_cache_memory: int | None = None  # bytes for the pool per device; None: profile
    memory_utilization: float = 0.9  # like vLLM's gpu_memory_utilization
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    enable_prefix_caching: bool = True
    # bytes of host memory per device for a tier under the pool (worker/exec/host_tier.py):
    # blocks the pool evicts are kept there and restored, not recomputed; None: no host tier
    kv_host_bytes: int | None = None
    # bytes of disk per device for a tier under the host tier (worker/exec/disk_tier.py), in
    # kv_disk_dir (local NVMe): blocks the host evicts are written there; None: no disk tier
    kv_disk_bytes: int | None = None
    kv_disk_dir: str | None = None
    # the group's own subdirectory of kv_disk_dir, its id (set by the cluster floor,
    # cluster/group.py `for_group`): the groups of one node share a --kv-disk-dir, each
    # in a directory of its own, which its replacement under the same id reopens and another
    # group of the node can read when it is gone (LLMEngine.import_from_disk); "": none
    kv_disk_group: str = ""
    # reads from the disk tier off the step's path (a reader thread per rank; a request waits
    # in a loading state meanwhile, worker/engine/scheduler.py); False: read between two steps
    kv_disk_async: bool = True
    # seconds added to each block read from the disk tier: a slower disk (network storage, a
    # busy device) emulated on a fast one, for tests and benchmarks of loads in flight; 0: none
    kv_disk_read_delay_s: float = 0.0
    # tenant -> its KV quota on the device pool (worker/engine/block_manager.py): a share of
    # the pool (a float in (0, 1]) or bytes per device (an int > 1); a tenant not named has none
    tenant_kv_quotas: Mapping[str, float | int] = field(default_factory=dict, hash=False)
    # the same for the host tier (a share of its slots or bytes per device) and the disk tier:
    # a tenant's blocks there beyond it are the first the tier evicts (worker/engine/tier_index.py)
    tenant_kv_host_quotas: Mapping[str, float | int] = field(default_factory=dict, hash=False)
    tenant_kv_disk_quotas: Mapping[str, float | int] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        _positive(self, "block_size")
        for name in ("tenant_kv_quotas", "tenant_kv_host_quotas", "tenant_kv_disk_quotas"):
            for tenant, quota in getattr(self, name).items():
                check_kv_quota(f"{name}[{tenant!r}]", quota)
        if self.kv_host_bytes is not None and (
            not isinstance(self.kv_host_bytes, int) or isinstance(self.kv_host_bytes, bool) or self.kv_host_bytes < 1
        ):
            raise ValueError(f"kv_host_bytes must be a positive number of bytes, got {self.kv_host_bytes!r}")
        delay = self.kv_disk_read_delay_s
        if not isinstance(delay, int | float) or isinstance(delay, bool) or not 0 <= delay < float("inf"):
            raise ValueError(f"kv_disk_read_delay_s must be a number of seconds >= 0, got {delay!r}")
        if not isinstance(self.kv_disk_async, bool):
            raise ValueError(f"kv_disk_async must be true or false, got {self.kv_disk_async!r}")
        if self.kv_disk_bytes is not None:
            if (
                not isinstance(self.kv_disk_bytes, int)
                or isinstance(self.kv_disk_bytes, bool)
                or self.kv_disk_bytes < 1
            ):
                raise ValueError(f"kv_disk_bytes must be a positive number of bytes, got {self.kv_disk_bytes!r}")
            if self.kv_host_bytes is None:
                raise ValueError("kv_disk_bytes needs kv_host_bytes: blocks reach the disk tier through the host's")
            if not self.kv_disk_dir:
                raise ValueError("kv_disk_bytes needs kv_disk_dir, the directory of the disk tier")
        if self.kv_disk_group:
            check_disk_group(self.kv_disk_group)
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")


_DISK_GROUP = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_disk_group(group: str) -> str:
    """A group's subdirectory name under kv_disk_dir (its id): one path component of letters,
    digits, '.', '_' and '-', so that no id can name a directory outside kv_disk_dir."""
    if not isinstance(group, str) or not _DISK_GROUP.fullmatch(group):
        raise ValueError(
            f"kv_disk_group must be 1-128 letters, digits, '.', '_' or '-' (not starting with '.'), got {group!r}"
        )
    return group


def check_kv_quota(name: str, quota: object) -> float | int:
    """A KV quota as `CacheConfig.tenant_kv_quotas` holds it: a share of the pool (a number in
    (0, 1]) or bytes (an integer > 1, or a size such as "64MiB"); ValueError naming `name`."""
    if isinstance(quota, bool):
        raise ValueError(f"{name} must be a share in (0, 1] or bytes such as 64MiB, got {quota!r}")
    if isinstance(quota, int | float) and 0 < quota <= 1:
        return float(quota)
    try:
        size = parse_size(quota) if isinstance(quota, str | int) else 0
    except ValueError:
        size = 0
    if size <= 1:
        raise ValueError(f"{name} must be a share in (0, 1] or bytes such as 64MiB, got {quota!r}")
    return size


def quota_blocks(quotas: Mapping[str, float | int], num_blocks: int, block_bytes: int) -> dict[str, int]:
    """Each tenant's quota in blocks of the pool: a share of `num_blocks`, or bytes over the
    bytes of one block (per device), rounded down."""
    return {
        t: int(q * num_blocks) if isinstance(q, float) else min(num_blocks, q // block_bytes) for t, q in quotas.items()
    }


def take_cluster_secret() -> str:
    """$PAGEFLEET_CLUSTER_SECRET, removed from this process's environment so that no process
    started from here (a local Ray runtime and its workers) inherits it; a random one when it
    is not set. Groups get it in their EngineConfig."""
    return os.environ.pop(CLUSTER_SECRET_ENV, None) or os.urandom(32).hex()


def cluster_secret(value: str | bytes | None = None) -> bytes:
    """The key of every block hash: given, else $PAGEFLEET_CLUSTER_SECRET, else random (a
    process of its own; a cluster passes one secret to all of its routers and groups)."""
    if value is None:
        value = os.environ.get(CLUSTER_SECRET_ENV)
    if value is None or value == "" or value == b"":
        return os.urandom(32)
    return value.encode() if isinstance(value, str) else value


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs; `pagefleet.LLM(model, **options)` fills it."""

    model: str
    dtype: str = "auto"  # "auto": worker/model/dtypes.py (bfloat16 on a CPU with bf16 units)
    weight_dtype: str = "auto"  # one of WEIGHT_DTYPES
    device: str = "cpu"
    attention_backend: str | None = None  # None: Triton on CUDA, torch elsewhere
    max_model_len: int | None = None  # None: the model's context length
    seed: int = 0
    cluster_secret: bytes | str | None = field(default=None, repr=False)  # keys every hash
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        check_model(self.model)
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {self.weight_dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")

    @classmethod
    def from_options(cls, model: str | None = None, **options: Any) -> EngineConfig:
        """Flat keyword options (block_size, num_blocks, max_num_seqs, ...) -> EngineConfig, each
        to the sub-config that owns it (`max_model_len` is the engine's). `model` is a model
        directory or a .gguf file; None is the default model, "builtin" the random built-in one
        (worker/model_source.py). Here, free of torch, so that a router builds its groups'
        configs without loading it."""
        unknown = set(options) - _CACHE_KEYS - _SCHED_KEYS - _ENGINE_KEYS
        if unknown:
            known = sorted(_CACHE_KEYS | _SCHED_KEYS | _ENGINE_KEYS)
            raise ValueError(f"unknown engine option(s) {sorted(unknown)}; known: {known}")
        for key in ("kv_host_bytes", "kv_disk_bytes"):
            if isinstance(options.get(key), str):  # a size such as 16GiB (a YAML's)
                options[key] = parse_size(options[key])
        return cls(
            model=resolve_model(model),
            cache=CacheConfig(**{k: v for k, v in options.items() if k in _CACHE_KEYS}),
            scheduler=SchedulerConfig(**{k: v for k, v in options.items() if k in _SCHED_KEYS}),
            **{k: v for k, v in options.items() if k in _ENGINE_KEYS},
        )


_CACHE_KEYS = {f.name for f in fields(CacheConfig)}
_SCHED_KEYS = {f.name for f in fields(SchedulerConfig)} - {"max_model_len"}
_ENGINE_KEYS = {f.name for f in fields(EngineConfig)} - {"model", "cache", "scheduler"}


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes in a size such as "24GiB", "1.5 MiB", "512MB" or "4096" (binary and SI units)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"invalid size {text!r}: must not be negative")
        return text
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(f"invalid size {text!r}: use bytes or a unit such as 24GiB, 512MB, 64KiB")
    try:
        value = Decimal(match.group(1)) * _SIZE_UNITS[unit]
    except InvalidOperation as err:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"invalid size {text!r}") from err
    if value != value.to_integral_value():
        raise ValueError(f"invalid size {text!r}: not a whole number of bytes")
    return int(value)
