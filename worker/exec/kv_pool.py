"""The paged KV pool of one device: K and V tensors per layer, sized once at start-up.

Each layer holds key and value caches of shape (num_blocks, block_size, local_kv_heads,
head_dim) in the KV dtype. An 8-bit cache holds codes and their scales (kernels/kv_quant.py):

- int8: a float16 scale per token and KV head, computed as the token is written. A scale per
  head or per tensor must be fixed in advance and spends the 8 bits on the largest value any
  token may have; on the real model they left several times the error in the next-token
  distribution (benchmarks/RESULTS.md), to save 2 bytes in 2 + head_dim.
- fp8 (float8 e4m3): one float32 scale per layer for K and one for V, calibrated once at
  start-up (worker/exec/kv_calibration.py). A float8 code carries its exponent, so its
  relative error is the same across its range and the scale only has to place the range;
  finer scales measured little better (benchmarks/RESULTS.md, scale granularity: a per-token
  float8 cache would cost int8's bytes for several times int8's error), and one scale per
  tensor keeps float8's bytes at head_dim.

Under tensor parallelism int8's scales shard with their heads; float8's are the group's (the
calibration takes the largest absmax over the ranks), so neither depends on the split.

The number of blocks comes, in order of precedence, from an explicit
`num_blocks`, from an explicit byte budget `kv_cache_memory`, or from the device's memory:

    budget = device_memory x memory_utilization - weights - activation peak of the largest step

as vLLM does with `gpu_memory_utilization`. On CUDA the peak is measured by running the largest
step (`max_num_batched_tokens` tokens); on CPU, where the process shares memory with everything
else on the machine, the budget is also capped at `CPU_DEFAULT_KV_MEMORY`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.kv_quant import FP8_E4M3, TENSOR_SCALE_DTYPE, TOKEN_SCALE_DTYPE, is_quantized
from worker.config import KV_CACHE_DTYPES, CacheConfig
from worker.hashing import ModelFingerprint
from worker.model.dtypes import resolve_dtype, resolve_weight_dtype
from worker.model.layers.quant import QuantizedWeight
from worker.model.model_config import ModelConfig

CPU_DEFAULT_KV_MEMORY = 1 << 30  # 1 GiB: a CPU pool must leave the host room to work
_KV_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "fp8": FP8_E4M3,
    "fp8_e4m3": FP8_E4M3,
}
assert set(_KV_DTYPES) == set(KV_CACHE_DTYPES) - {"auto"}


def kv_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element dtype of the pool for `CacheConfig.kv_cache_dtype`."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return _KV_DTYPES[kv_cache_dtype]


def kv_fingerprint(config, mc: ModelConfig) -> ModelFingerprint:
    """Everything of an engine's `config` (an EngineConfig) and model `mc` that changes the
    K/V values of a block: what block hashes are keyed over (worker/engine/llm_engine.py
    `block_hasher`), and what names a disk tier's directory (worker/exec/disk_tier.py)."""
    model_dtype = resolve_dtype(config.dtype, mc, config.device)
    kv_dtype = kv_torch_dtype(config.cache.kv_cache_dtype, model_dtype)
    return ModelFingerprint(
        model_id=mc.model_id,
        revision=mc.revision,
        dtype=str(model_dtype).removeprefix("torch."),
        kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
        block_size=config.cache.block_size,
        weight_dtype=resolve_weight_dtype(config.weight_dtype, config.model, config.device, model_dtype),
    )


@dataclass(frozen=True)
class KVLayout:
    """The shape of one device's pool, without the number of blocks."""

    num_layers: int
    local_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # of K and V: a float dtype, or int8 / float8 codes

    @property
    def token_scales(self) -> bool:
        """int8: a scale per token and KV head, written beside the codes."""
        return self.dtype == torch.int8

    @property
    def tensor_scales(self) -> bool:
        """float8: one scale per layer for K and one for V, calibrated at start-up."""
        return is_quantized(self.dtype) and not self.token_scales

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x local KV heads x (head dim x bytes per element, plus a
        per-token scale's bytes)."""
        per_head = self.head_dim * self.dtype.itemsize
        if self.token_scales:
            per_head += TOKEN_SCALE_DTYPE.itemsize
        return 2 * self.num_layers * self.local_kv_heads * per_head

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def pool_scale_bytes(self) -> int:
        """Bytes outside the blocks: the per-tensor scales, K and V of every layer."""
        return 2 * self.num_layers * TENSOR_SCALE_DTYPE.itemsize if self.tensor_scales else 0

    def blocks_in(self, budget: int) -> int:
        """Blocks that fit `budget` bytes, after the per-tensor scales."""
        return max(0, budget - self.pool_scale_bytes) // self.block_bytes


def device_memory(device: torch.device) -> int:
    """Total bytes of the device: GPU memory, or the host's RAM for CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights: parameters, and the buffers of quantized weights."""
    quantized = (b for m in model.modules() if isinstance(m, QuantizedWeight) for b in m.buffers(recurse=False))
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *quantized))


def num_blocks_from_memory(
    cache: CacheConfig,
    layout: KVLayout,
    model: torch.nn.Module,
    device: torch.device,
    profile_step: Callable[[], None],
) -> int:
    """Blocks that fit the configured budget (see the module docstring)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    if cache.kv_cache_memory is not None:
        return layout.blocks_in(cache.kv_cache_memory)
    weights = weights_bytes(model)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        profile_step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)  # weights + activations of the step
        budget = int(device_memory(device) * cache.memory_utilization) - peak
    else:
        budget = int(device_memory(device) * cache.memory_utilization) - weights
        budget = min(budget, CPU_DEFAULT_KV_MEMORY)
    return layout.blocks_in(budget)


class KVPool:
    """K/V tensors (and an 8-bit cache's scales) of every layer on one device, bound to the
    model's attention layers."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        n = layout.num_layers
        shape = (num_blocks, layout.block_size, layout.local_kv_heads, layout.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(n)]
        self.v_caches = [torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(n)]
        self.k_scales = [self._new_scales(device) for _ in range(n)]
        self.v_scales = [self._new_scales(device) for _ in range(n)]

    def _new_scales(self, device: torch.device) -> torch.Tensor | None:
        layout = self.layout
        if layout.token_scales:  # (num_blocks, block_size, local_kv_heads), written with K/V
            shape = (self.num_blocks, layout.block_size, layout.local_kv_heads)
            return torch.zeros(shape, dtype=TOKEN_SCALE_DTYPE, device=device)
        if layout.tensor_scales:  # (1,): 1.0 until calibrated
            return torch.ones(1, dtype=TENSOR_SCALE_DTYPE, device=device)
        return None

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the pool holds: caches and scales."""
        scales = [t for t in (*self.k_scales, *self.v_scales) if t is not None]
        return [*self.k_caches, *self.v_caches, *scales]

    @property
    def block_tensors(self) -> list[torch.Tensor]:
        """The tensors indexed by block id, as bytes: each (num_blocks, ...) uint8 view of K, V
        and an int8 cache's per-token scales. A block's KV is its row in each (what a tier
        under the pool copies)."""
        scales = [t for t in (*self.k_scales, *self.v_scales) if t is not None and self.layout.token_scales]
        return [t.view(torch.uint8) for t in (*self.k_caches, *self.v_caches, *scales)]

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def set_tensor_scales(self, k_scales: list[float], v_scales: list[float]) -> None:
        """The per-tensor scales of every layer (float8 caches), before any write."""
        if not self.layout.tensor_scales:
            raise ValueError(f"a {self.layout.dtype} pool has no per-tensor scales")
        for t, value in zip((*self.k_scales, *self.v_scales), (*k_scales, *v_scales), strict=True):
            t.fill_(value)

    def bind(self, attention_layers: list) -> None:
        if len(attention_layers) != self.layout.num_layers:
            raise ValueError(f"{len(attention_layers)} attention layers for a pool of {self.layout.num_layers}")
        per_layer = zip(self.k_caches, self.v_caches, self.k_scales, self.v_scales, strict=True)
        for layer, tensors in zip(attention_layers, per_layer, strict=True):
            layer.bind_kv_cache(*tensors)


def layout_for(
    model_config: ModelConfig, cache: CacheConfig, local_kv_heads: int, model_dtype: torch.dtype
) -> KVLayout:
    return KVLayout(
        num_layers=model_config.num_layers,
        local_kv_heads=local_kv_heads,
        head_dim=model_config.head_dim,
        block_size=cache.block_size,
        dtype=kv_torch_dtype(cache.kv_cache_dtype, model_dtype),
    )


def check_pool_fits(num_blocks: int, layout: KVLayout, max_model_len: int) -> None:
    """Refuse, with the numbers, a pool that cannot hold one sequence of max_model_len."""
    need = -(-max_model_len // layout.block_size)
    if num_blocks < need:
        raise ValueError(
            f"the KV pool has {num_blocks} blocks of {layout.block_size} tokens "
            f"({_fmt(num_blocks * layout.block_bytes)} at {layout.bytes_per_token} bytes per token), "
            f"but one sequence of max_model_len={max_model_len} tokens needs {need} blocks "
            f"({_fmt(need * layout.block_bytes)}): give the pool more memory "
            f"(num_blocks / kv_cache_memory / memory_utilization) or lower max_model_len"
        )


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
