"""The paged KV pool of one device: K and V tensors per layer, sized once at start-up.

Each layer holds key and value caches of shape (num_blocks, block_size, local_kv_heads,
head_dim) in the KV dtype. The number of blocks comes, in order of precedence, from an explicit
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

from worker.config import CacheConfig
from worker.model_config import ModelConfig

CPU_DEFAULT_KV_MEMORY = 1 << 30  # 1 GiB: a CPU pool must leave the host room to work


def kv_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if kv_cache_dtype not in dtypes:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} is not supported by the engine yet; "
            f"choose one of {['auto', *dtypes]}"
        )
    return dtypes[kv_cache_dtype]


@dataclass(frozen=True)
class KVLayout:
    """The shape of one device's pool, without the number of blocks."""

    num_layers: int
    local_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x local KV heads x head dim x bytes per element."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.local_kv_heads * self.head_dim * elem

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size


def device_memory(device: torch.device) -> int:
    """Total bytes of the device: GPU memory, or the host's RAM for CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def weights_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


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
        return cache.kv_cache_memory // layout.block_bytes
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
    return max(0, budget) // layout.block_bytes


class KVPool:
    """K/V tensors of every layer on one device, bound to the model's attention layers."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (num_blocks, layout.block_size, layout.local_kv_heads, layout.head_dim)
        self.k_caches = [
            torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)
        ]
        self.v_caches = [
            torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)
        ]

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k_caches, *self.v_caches))

    def bind(self, attention_layers: list) -> None:
        if len(attention_layers) != self.layout.num_layers:
            raise ValueError(
                f"{len(attention_layers)} attention layers for a pool of {self.layout.num_layers}"
            )
        for layer, k, v in zip(attention_layers, self.k_caches, self.v_caches, strict=True):
            layer.bind_kv_cache(k, v)


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
