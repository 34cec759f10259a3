"""The model's shape, read once from a Hugging Face config: the only adapter from HF configs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# architecture -> (q/k/v bias, o_proj bias, per-head q/k RMSNorm), given the HF config
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class ModelConfig:
    """Everything the Llama-family model and the engine need to know about one checkpoint.

    `max_position_embeddings` is the context length we serve: the checkpoint's, capped at the
    sliding window where the architecture uses one (within the window, sliding and full causal
    attention agree, so the paged kernels stay exact). `hf_config` is kept for transformers'
    RoPE initialisation functions, which take the HF config object.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama/Qwen3 attention_bias)
    o_bias: bool = False  # bias on o_proj (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False  # bias on gate/up/down (Llama mlp_bias)
    qk_norm: bool = False  # RMSNorm over each q/k head before RoPE (Qwen3)
    max_position_embeddings: int = 4096
    rope_parameters: dict[str, Any] = field(default_factory=dict, hash=False)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: str = "float32"  # the checkpoint's dtype ("auto" resolves to it)
    model_id: str = ""
    revision: str = ""
    hf_config: Any = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if not hasattr(torch, self.dtype):
            raise ValueError(f"dtype {self.dtype!r} is not a torch dtype name")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def rope_type(self) -> str:
        return self.rope_parameters.get("rope_type", "default")

    @classmethod
    def from_hf(cls, hf_config: Any, model_id: str = "", revision: str = "") -> ModelConfig:
        """Adapt a transformers config (Llama, Mistral, Qwen2, Qwen3) to ours."""
        archs = getattr(hf_config, "architectures", None) or []
        arch = archs[0] if archs else type(hf_config).__name__.replace("Config", "ForCausalLM")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        c = hf_config
        attention_bias = bool(getattr(c, "attention_bias", False))
        num_heads = c.num_attention_heads
        return cls(
            architecture=arch,
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            num_layers=c.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // num_heads,
            intermediate_size=c.intermediate_size,
            rms_norm_eps=c.rms_norm_eps,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and attention_bias,
            mlp_bias=arch == "LlamaForCausalLM" and bool(getattr(c, "mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            max_position_embeddings=_context_length(c),
            rope_parameters=dict(getattr(c, "rope_parameters", None) or {}),
            eos_token_ids=_as_tuple(getattr(c, "eos_token_id", None)),
            bos_token_id=getattr(c, "bos_token_id", None),
            dtype=_dtype_name(getattr(c, "dtype", None)),
            model_id=model_id,
            revision=revision,
            hf_config=c,
        )


def _context_length(c: Any) -> int:
    """max_position_embeddings, capped at the sliding window where any layer slides."""
    length = c.max_position_embeddings
    window = getattr(c, "sliding_window", None)
    layer_types = getattr(c, "layer_types", None)
    slides = window is not None and (layer_types is None or "sliding_attention" in layer_types)
    return min(length, window) if slides else length


def _as_tuple(ids: int | list[int] | None) -> tuple[int, ...]:
    if ids is None:
        return ()
    return (ids,) if isinstance(ids, int) else tuple(ids)


def _dtype_name(dtype: Any) -> str:
    if dtype is None:
        return "float32"
    return str(dtype).removeprefix("torch.")
