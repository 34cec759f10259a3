"""Frozen configuration of one group's engine. Environment variables are read only here."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from worker.model_source import check_model, resolve_model

POLICIES = ("fcfs", "priority")
# "auto": the model's dtype; int8 and fp8 (float8 e4m3, "fp8_e4m3") are 8-bit caches with
# scales (worker/exec/kv_pool.py says which granularity each has, and why).
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "fp8", "fp8_e4m3")
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

    def __post_init__(self) -> None:
        _positive(self, "max_num_batched_tokens", "max_num_seqs", "max_model_len", "max_waiting")
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

    def __post_init__(self) -> None:
        _positive(self, "block_size")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")


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
    device: str = "cpu"
    attention_backend: str | None = None  # None: Triton on CUDA, torch elsewhere
    max_model_len: int | None = None  # None: the model's context length
    seed: int = 0
    cluster_secret: bytes | str | None = field(default=None, repr=False)  # keys every hash
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        check_model(self.model)
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
        return cls(
            model=resolve_model(model),
            cache=CacheConfig(**{k: v for k, v in options.items() if k in _CACHE_KEYS}),
            scheduler=SchedulerConfig(**{k: v for k, v in options.items() if k in _SCHED_KEYS}),
            **{k: v for k, v in options.items() if k in _ENGINE_KEYS},
        )


_CACHE_KEYS = {f.name for f in fields(CacheConfig)}
_SCHED_KEYS = {f.name for f in fields(SchedulerConfig)} - {"max_model_len"}
_ENGINE_KEYS = {f.name for f in fields(EngineConfig)} - {"model", "cache", "scheduler"}
