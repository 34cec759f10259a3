"""Model FLOPs of the engine benchmark's work, and this machine's matmul peak to hold them to.

What is counted (the model's arithmetic, not any system's waste):
- Linear layers: 2 x the decoder layers' linear parameters (q/k/v, o, gate/up, down) per token
  computed. Embedding lookups and norms are not counted.
- Attention: per layer, per token at position p (0-based), QK^T and PV over the p + 1 keys it
  attends to: 2 x 2 x heads x head_dim x (p + 1). Causal: keys after a token are not counted.
- LM head: 2 x vocab x hidden per row of logits, one per generated token.
- Tokens computed by a system: each request's prompt minus what that system served from its
  prefix cache (at least the last prompt token is computed), then each generated token but the
  last (it is sampled, never fed back). Padding of static batches, tokens past a request's own
  length and recomputation after preemption are not counted: they are a system's waste, and
  count against its FLOP/s.

The peak is `torch.mm` on the model's own linear shapes, (tokens x in) @ (in x out) at a
prefill step's token count, in the run's dtype, device and torch threads: the rate a perfect
engine's linear layers would run at on this machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from worker.model.model_config import ModelConfig


@dataclass(frozen=True)
class ModelFlops:
    """FLOP counts of one model's forward pass, per token and per attended key."""

    linear_params: int  # decoder layers' linear weights (this rank's whole model, TP 1)
    attention_per_key: int  # 4 x heads x head_dim x layers: QK^T and PV for one (query, key)
    lm_head: int  # 2 x vocab x hidden: one row of logits
    linear_shapes: tuple[tuple[int, int], ...]  # (in, out) of each linear layer of a layer

    @classmethod
    def of(cls, mc: ModelConfig) -> ModelFlops:
        h, d, kv, inter = mc.hidden_size, mc.head_dim, mc.num_kv_heads, mc.intermediate_size
        shapes = (
            (h, (mc.num_heads + 2 * kv) * d),  # qkv_proj
            (mc.num_heads * d, h),  # o_proj
            (h, 2 * inter),  # gate_up_proj
            (inter, h),  # down_proj
        )
        return cls(
            linear_params=mc.num_layers * sum(i * o for i, o in shapes),
            attention_per_key=4 * mc.num_heads * d * mc.num_layers,
            lm_head=2 * mc.vocab_size * h,
            linear_shapes=shapes,
        )

    def positions(self, start: int, end: int) -> int:
        """FLOPs of computing positions start..end-1 of one sequence (no logits)."""
        keys = (end * (end + 1) - start * (start + 1)) // 2  # sum of (p + 1)
        return 2 * self.linear_params * (end - start) + self.attention_per_key * keys

    def request(self, prompt_len: int, max_tokens: int, cached: int) -> int:
        """FLOPs one request needs when `cached` prompt tokens come from a prefix cache."""
        start = min(max(cached, 0), prompt_len - 1)
        return self.positions(start, prompt_len + max_tokens - 1) + self.lm_head * max_tokens


def matmul_peak(flops: ModelFlops, tokens: int, dtype: torch.dtype, device: str, seconds: float = 1.0) -> dict:
    """GFLOP/s of torch.mm over the model's linear shapes at `tokens` rows, in a layer's
    proportions (each shape once per round); the best of several rounds."""
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    pairs = [
        (torch.randn(tokens, i, generator=g).to(dev, dtype), torch.randn(i, o, generator=g).to(dev, dtype))
        for i, o in flops.linear_shapes
    ]
    work = 2 * tokens * sum(i * o for i, o in flops.linear_shapes)

    def one_round() -> float:
        _sync(dev)
        t0 = time.perf_counter()
        for x, w in pairs:
            torch.mm(x, w)
        _sync(dev)
        return time.perf_counter() - t0

    one_round()  # warm-up: first-call packing and allocation
    best, spent, rounds = float("inf"), 0.0, 0
    while spent < seconds or rounds < 3:
        t = one_round()
        best, spent, rounds = min(best, t), spent + t, rounds + 1
    return {"gflop_s": round(work / best / 1e9, 1), "tokens": tokens, "rounds": rounds}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Times each step of a pagefleet engine's executor and counts its FLOPs, so that the
    steps that are mostly prefill can be held to the peak on their own."""

    def __init__(self, flops: ModelFlops, prefill_share: float = 0.9) -> None:
        self.flops, self.prefill_share = flops, prefill_share
        self.steps: list[tuple[float, int, float]] = []  # (seconds, FLOPs, prefill token share)

    def wrap(self, executor) -> None:
        """Time `executor.execute` (it returns sampled tokens, so the step has finished)."""
        inner = executor.execute

        def timed(out, *args, **kwargs):
            t0 = time.perf_counter()
            result = inner(out, *args, **kwargs)
            self.record(out, time.perf_counter() - t0)
            return result

        executor.execute = timed

    def record(self, out, seconds: float) -> None:
        work, prefill, tokens = 0, 0, 0
        for s in out.scheduled:
            work += self.flops.positions(s.start, s.end) + self.flops.lm_head * s.samples
            prefill += max(0, min(s.end, s.request.num_prompt_tokens) - s.start)
            tokens += s.num_tokens
        self.steps.append((seconds, work, prefill / tokens if tokens else 0.0))

    def prefill_figures(self) -> dict:
        """Time and GFLOP/s of the steps whose tokens are at least `prefill_share` prompt
        tokens."""
        mine = [(t, w) for t, w, share in self.steps if share >= self.prefill_share]
        secs, work = sum(t for t, _ in mine), sum(w for _, w in mine)
        return {
            "prefill_steps": len(mine),
            "prefill_s": round(secs, 3),
            # three significant figures: a tiny model on a loaded machine is well under 0.1 GFLOP/s
            "prefill_gflop_s": float(f"{work / secs / 1e9:.3g}") if secs else None,
        }
