"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache.

Reads like single-device code: tensor parallelism lives in the layers (each shards itself
from the Collectives it is given), so shapes below say "heads" for this rank's heads.
Switches from ModelConfig: q/k/v bias (Qwen2), o_proj bias, per-head q/k RMSNorm (Qwen3),
MLP bias, GQA/MQA, tied embeddings, every RoPE variant transformers implements.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.registry import AttentionBackend
from worker.model.attention_metadata import AttentionMetadata
from worker.model.layers.attention import PagedAttention
from worker.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from worker.model.layers.norm import RMSNorm
from worker.model.layers.rotary import RotaryEmbedding, apply_rotary
from worker.model.model_config import ModelConfig
from worker.model.parallel import Collectives, SingleRank


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Collectives, backend: AttentionBackend | None):
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, comm)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, cfg.o_bias, comm)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        heads, kv_heads = self.qkv_proj.num_heads_local, self.qkv_proj.num_kv_heads_local
        self.attn = PagedAttention(heads, kv_heads, d, d**-0.5, backend)

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = self.qkv_proj.split(qkv)  # (T, heads, d), (T, kv_heads, d) x2
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        else:  # q and k lie side by side in qkv: one rotation for both
            heads, kv_heads = q.shape[1], k.shape[1]
            qk = qkv[:, : (heads + kv_heads) * q.shape[2]].view(-1, heads + kv_heads, q.shape[2])
            qk = apply_rotary(qk, cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        o = self.attn(q, k, v, meta)  # (T, heads, d)
        return self.o_proj(o.flatten(1))  # (T, hidden)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Collectives):
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [size, size], cfg.mlp_bias, comm)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, cfg.mlp_bias, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (T, intermediate / tp) each
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Collectives, backend: AttentionBackend | None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, comm, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, comm)

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        """x (T, hidden) -> the next layer's input; the residual adds go into x itself."""
        x += self.self_attn(self.input_layernorm(x), cos, sin, meta)
        x += self.mlp(self.post_attention_layernorm(x))
        return x


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Collectives, backend: AttentionBackend | None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, comm)
        self.rotary_emb = RotaryEmbedding(cfg.hf_config, cfg.head_dim)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, comm, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.rotary_emb.rotation(positions, x.dtype)  # (T, 1, head_dim) each, for all layers
        for layer in self.layers:
            x = layer(x, cos, sin, meta)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """Decoder-only Llama-family model; parameter names follow the HF checkpoint's, with
    q/k/v merged into `qkv_proj` and gate/up into `gate_up_proj`."""

    def __init__(
        self,
        config: ModelConfig,
        collectives: Collectives | None = None,
        attention_backend: AttentionBackend | None = None,
    ):
        super().__init__()
        if config.hf_config is None:
            raise ValueError("config.hf_config is required (use ModelConfig.from_hf)")
        comm = collectives or SingleRank()
        self.config = config
        self.model = LlamaModel(config, comm, attention_backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, comm)
        if config.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,) int64: one flat batch
        positions: torch.Tensor,  # (T,) int64: each token's position in its sequence
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, hidden)
        """Hidden states after the final norm; K/V of these tokens land in the paged pool."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (n, hidden) -> logits (n, vocab_size) float32 over the full vocabulary."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        """Every layer's PagedAttention, in layer order, for the KV pool to bind caches to."""
        return [layer.self_attn.attn for layer in self.model.layers]
