"""The dtype a model runs in, and whether this CPU computes bfloat16 in hardware.

dtype "auto" is resolved here and only here: the model loader and the block hasher (the dtype
is part of every block's fingerprint) both call `resolve_dtype`, so an engine and a router of
the same machine name blocks alike; a router elsewhere reads the group's resolved dtype from
its ModelFacts.

On CPU, "auto" is bfloat16 where the CPU has bf16 dot-product units (x86 AVX512_BF16 or
AMX-BF16, Arm's BF16 extension): oneDNN's bf16 matmuls there run at up to four times the
float32 rate and move half the bytes (benchmarks/RESULTS.md), whatever dtype the checkpoint
was saved in. A CPU without them emulates bf16 more slowly than it computes float32, so it
keeps float32. On other devices "auto" keeps the checkpoint's dtype (float32 for GGUF files,
which are dequantized at load).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from worker.config import WEIGHT_DTYPES
from worker.model.model_config import ModelConfig

# /proc/cpuinfo flags of bf16 dot-product units: x86 ("flags") and Arm ("Features").
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
CPUINFO = Path("/proc/cpuinfo")


def cpuinfo_has_bf16(cpuinfo: str) -> bool:
    """True when a /proc/cpuinfo text lists a bf16 unit on its flags / Features lines."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features") and BF16_CPU_FLAGS & set(value.split()):
            return True
    return False


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this machine's CPU computes bfloat16 in hardware (False where /proc/cpuinfo
    cannot be read: float32 is the safe choice)."""
    try:
        return cpuinfo_has_bf16(CPUINFO.read_text())
    except OSError:
        return False


def to_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from itself or its name; ValueError naming `dtype` otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype name (e.g. 'bfloat16') or 'auto'")
    return getattr(torch, dtype)


def resolve_dtype(dtype: torch.dtype | str, mc: ModelConfig, device: torch.device | str) -> torch.dtype:
    """The dtype a model of config `mc` runs in on `device`: `dtype` itself unless "auto"
    (see the module docstring)."""
    if dtype != "auto":
        return to_dtype(dtype)
    if torch.device(device).type == "cpu":
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    return mc.torch_dtype


# GGUF types whose blocks are int4 groups of 32 (a scale and a min or none): "auto" keeps them in 4 bits.
_FOUR_BIT_GGUF = frozenset({"Q4_0", "Q4_1"})


def resolve_weight_dtype(
    weight_dtype: str, model: str | Path, device: torch.device | str, dtype: torch.dtype | None = None
) -> str:
    """How the linear layers hold their weights: "float" (the model's dtype), "int8" or "int4".

    "auto" is resolved here and only here (the loader and the block hasher both call this, with
    the activations' `dtype` as resolved): on CPU, a GGUF file whose layer weights are quantized
    keeps them quantized, in int4 when they are all 4-bit blocks (Q4_0, Q4_1: the same codes and
    scales) and in int8 otherwise (Q8_0, Q5_*), under 16-bit activations; float for float
    checkpoints, off CPU, where the quantized kernels are CPU ones, and under float32
    activations, for which torch's int4 and int8 CPU kernels have no fast path (a decode step
    several times slower than on the float weights: benchmarks/RESULTS.md, "float32
    activations")."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
    on_cpu = torch.device(device).type == "cpu"
    if weight_dtype != "auto":
        if weight_dtype != "float" and not on_cpu:
            raise ValueError(f"weight_dtype {weight_dtype!r} runs on CPU only; use 'float' on {device}")
        return weight_dtype
    from worker.model_source import is_gguf

    if not on_cpu or dtype == torch.float32 or not is_gguf(model):
        return "float"
    from worker.model.gguf_loader import layer_weight_types

    types = layer_weight_types(model)
    if not types or types <= {"F32", "F16", "BF16"}:
        return "float"
    return "int4" if types <= _FOUR_BIT_GGUF else "int8"
