"""Per-tensor scales of a float8 KV cache, calibrated once when the pool is made.

A float8 e4m3 code keeps 3 mantissa bits anywhere between 2**-6 and 448 (subnormals go on down
to 2**-9), so a per-tensor scale only has to place the range. One forward pass over
CALIBRATION_TOKENS fixed pseudo-random token ids, on a small pool in the model's own dtype,
gives each layer's absmax of K and of V on this device (its own heads); the scale maps that
absmax to 448 / HEADROOM. Values up to HEADROOM times larger than the calibration saw still
fit unclipped, and values down to 2**-6 / 448 x HEADROOM (1/1792) of the absmax stay normal.

Every rank of a tensor-parallel group runs the same pass (the same ids; its collectives meet
the other ranks') and the ranks take the largest absmax of any rank's heads, so a layer's scale
is the same on every device and at every tensor-parallel size: the 8-bit K/V, and so the output,
do not depend on how the heads are split.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kernels.kv_quant import FP8_MAX
from worker.exec.kv_pool import KVLayout, KVPool
from worker.model.attention_metadata import AttentionMetadata
from worker.model.parallel import Collectives

CALIBRATION_TOKENS = 256
CALIBRATION_SEED = 0
# Headroom over the calibration's absmax: real text may reach further than random ids do.
HEADROOM = 16.0


def calibrate_tensor_scales(
    model: torch.nn.Module,
    layout: KVLayout,
    model_dtype: torch.dtype,
    vocab_size: int,
    max_tokens: int,
    device: torch.device,
    collectives: Collectives,
) -> tuple[list[float], list[float]]:
    """(K scales, V scales), one per layer, for a float8 pool of `layout` on this device.
    Leaves the model's attention layers bound to a scratch pool: bind the real one after."""
    layers = model.attention_layers()
    n = max(1, min(CALIBRATION_TOKENS, max_tokens))
    blocks = -(-n // layout.block_size)
    KVPool(replace(layout, dtype=model_dtype), blocks, device).bind(layers)
    amax = torch.zeros(2, len(layers), device=device)  # (K/V, layer)

    def recorder(i: int):
        def record(module, args) -> None:  # PagedAttention.forward(q, k, v, meta)
            _, k, v, _ = args
            amax[0, i] = torch.maximum(amax[0, i], k.detach().abs().max().float())
            amax[1, i] = torch.maximum(amax[1, i], v.detach().abs().max().float())

        return record

    hooks = [layer.register_forward_pre_hook(recorder(i)) for i, layer in enumerate(layers)]
    try:
        ids = torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(CALIBRATION_SEED))
        with torch.inference_mode():
            model(ids.to(device), torch.arange(n, device=device), _one_sequence(n, blocks, device))
    finally:
        for hook in hooks:
            hook.remove()
    amax = collectives.all_gather(amax[None], dim=0).amax(dim=0)  # over the ranks' heads
    scales = amax.clamp_min(torch.finfo(torch.float32).tiny) * HEADROOM / FP8_MAX
    k_scales, v_scales = scales.tolist()
    return k_scales, v_scales


def _one_sequence(n: int, blocks: int, device: torch.device) -> AttentionMetadata:
    """One prefill of n tokens into blocks 0..blocks-1."""
    return AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        max_query_len=n,
        max_seq_len=n,
    )
