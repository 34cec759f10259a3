"""Attention backends behind one small interface, chosen by name."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kernels import cpu_decode
from kernels.torch_ref import write_kv_torch
from kernels.torch_sdpa import Workspace, paged_attention_sdpa


class AttentionBackend(ABC):
    """Paged attention and KV writes for one device. Shapes: see kernels/torch_ref.py;
    k_scale / v_scale go with 8-bit caches only (kernels/kv_quant.py)."""

    name: str

    @abstractmethod
    def write_kv(self, key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
        """Write this step's K/V into the pool at `slot_mapping` (quantized into an 8-bit
        cache, whose per-token scales it writes beside the codes)."""

    @abstractmethod
    def attention(
        self,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        out=None,
        k_scale=None,
        v_scale=None,
    ) -> torch.Tensor:
        """Causal paged attention over a flat variable-length batch (an 8-bit cache is
        read as code x scale)."""


class TorchBackend(AttentionBackend):
    """The CPU path: plain torch (fused SDPA and batched decode), tested against the reference."""

    name = "torch"

    def __init__(self) -> None:
        self.workspace = Workspace()  # one model's layers share it: they run one at a time
        cpu_decode.library()  # (built now, with the model, rather than at the first decode)

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
        if k_scale is None and cpu_decode.write_kv(key, value, key_cache, value_cache, slot_mapping):
            return
        write_kv_torch(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)

    def attention(
        self,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        out=None,
        k_scale=None,
        v_scale=None,
    ) -> torch.Tensor:
        return paged_attention_sdpa(
            query,
            key_cache,
            value_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            scale,
            out,
            k_scale,
            v_scale,
            self.workspace,
        )


_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchBackend}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _BACKENDS[cls.name] = cls
    return cls


def _triton_available() -> bool:
    """Import (and so register) the Triton backend; False when Triton is not importable."""
    if "triton" not in _BACKENDS:
        try:
            import kernels.triton_attention  # noqa: F401  (registers itself)
        except ImportError:
            return False
    return True


def get_backend(name: str | None, device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend called `name`; None picks Triton on CUDA and torch elsewhere."""
    if name is None:
        name = "triton" if torch.device(device).type == "cuda" and _triton_available() else "torch"
    if name == "triton" and name not in _BACKENDS:
        import kernels.triton_attention  # noqa: F401  (registers itself)
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend {name!r} is unknown; choose one of {sorted(_BACKENDS)}")
    return _BACKENDS[name]()
