"""Weights kept in 8 or 4 bits: each linear layer multiplies by its quantized weight directly.

A decode step reads every weight once, so at small batches its time is the weights' bytes over
the memory bandwidth; holding them in 8 or 4 bits instead of 16 reads 2x or ~3.5x fewer bytes.
The matmuls are torch's own CPU kernels, which take the quantized weight and unpack it in
registers (nothing is dequantized to 16 bits in memory):

- int8 (`Int8Weight`): symmetric, one scale per output row, `aten._weight_int8pack_mm`.
- int4 (`Int4Weight`): asymmetric groups of 32 input features, w = (q - 8) * scale + zero with
  q in 0..15, `aten._weight_int4pack_mm_for_cpu`. A group of 32 is a GGUF block: a Q4_1 block
  (w = d * q + m, q in 0..15, the block's min at q = 0 and max at q = 15) is one group with
  scale d and zero m + 8 d, so a Q4_1 file's
  weights come back with their own codes and scales (rounded to the model's dtype; Q4_0 blocks are
  re-quantized to min and max). The kernel
  needs the output features a multiple of 16 and the input features of 32; a layer (or a
  tensor-parallel shard) that is not falls back to int8.

Those kernels unpack the weight again for every block of rows, so their time grows with the
rows as a dense GEMM's does not (benchmarks/RESULTS.md, "Prefill steps on quantized weights").
A matmul of at least DENSE_ROWS rows on CPU therefore
dequantizes the weight, once for the call, into a per-thread scratch buffer in the activations'
dtype and runs a dense GEMM over it (`QuantizedWeight.dense`). A prefill step costs one more
pass over the weights, and the weights stay small between steps.

Q8_0 blocks carry one scale per 32 weights, but the int8 kernel takes one per row, so an int8
layer re-quantizes them per row (benchmarks/RESULTS.md reports what that costs in perplexity).

A layer is switched over before loading (`quantize_model`): its weight becomes a float32
staging tensor that the checkpoint loader fills shard by shard as before (each tensor-parallel
rank only its own shard), and it is quantized, and the staging tensor freed, once its last shard
has arrived (`shard_loaded`), so at most one layer is held in float32 at a time.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_decode

INT4_GROUP = 32  # input features per int4 scale and zero: one GGUF block
_INT4_OUT_MULTIPLE = 16  # the int4 kernel's packing of output rows
# Rows from which a CPU matmul dequantizes the weight for the call and runs a dense GEMM: from
# about here the dequantization and the GEMM together beat the kernel (benchmarks/RESULTS.md).
DENSE_ROWS = 256
_scratch = threading.local()  # a rank's thread reuses its buffer; two ranks in threads do not share


def _scratch_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's grow-only scratch of `dtype`, `numel` long: the dequantized weight of one
    matmul (a fresh tensor of megabytes per call costs page faults on CPU)."""
    bufs = _scratch.__dict__.setdefault("bufs", {})
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # (a normal tensor: written in and out of inference mode)
            buf = bufs[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


class QuantizedWeight(nn.Module, ABC):
    """An (out, in) weight held in fewer bits; `matmul(x)` is x @ W^T in x's dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype  # the activations' dtype: scales are kept in it, as the kernels want

    @abstractmethod
    def quantize(self, w: torch.Tensor) -> None:
        """Take w (out, in), float32, and keep its quantized form."""

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, in) -> (T, out) in x's dtype: the quantized kernel, or from DENSE_ROWS rows on
        CPU a dense GEMM over the weight dequantized for the call."""
        if x.shape[0] >= DENSE_ROWS and x.device.type == "cpu":
            w = self.dense(x.dtype)
            if w is not None:
                return F.linear(x, w)
        return self.kernel(x)

    @abstractmethod
    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, in) -> (T, out) in x's dtype, through the quantized kernel."""

    def dense(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The weight (out, in) in `dtype`, in this thread's scratch buffer (valid until the
        next call), or None where it cannot be unpacked here (the kernel is used instead)."""
        return None

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The weight the matmul applies, (out, in) float32 (for tests and accuracy reports)."""


class Int8Weight(QuantizedWeight):
    """Symmetric int8, one scale per output row: w[o, i] = qweight[o, i] * scales[o].

    `cpu_rows` (a vocabulary layer's: the LM head): on CPU every row goes through the C++
    kernel (kernels/cpu_decode.py `int8_rows`), faster than torch's int8 kernel on a decode's
    few rows (benchmarks/RESULTS.md), and a row's logits the same however many rows the step
    has."""

    cpu_rows = False

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_rows and cpu_decode.int8_supports(x, self.qweight, self.scales):
            xf = _scratch_buffer(x.shape[0] * x.shape[1] + 16, torch.float32)
            return cpu_decode.int8_rows(x, self.qweight, self.scales, xf)
        return super().matmul(x)

    def quantize(self, w: torch.Tensor) -> None:
        scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127  # (out,)
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)  # (out, in)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales.to(self.dtype))

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        out = _scratch_buffer(self.qweight.numel(), dtype).view(self.qweight.shape)
        return torch.mul(self.qweight, self.scales[:, None], out=out)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (T,) of the weight, (T, in) in the model's dtype: an embedding lookup."""
        return self.qweight[ids].to(self.dtype) * self.scales[ids, None]

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]


class Int4Weight(QuantizedWeight):
    """Asymmetric int4 in groups of INT4_GROUP input features, in the int4 kernel's packing.

    qweight: (out, in / 2) uint8 as `_convert_weight_to_int4pack_for_cpu` lays it out;
    scales_and_zeros: (in / group, out, 2), w = (q - 8) * scale + zero.
    """

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        """Whether the kernel takes a weight of this shape."""
        return out_features % _INT4_OUT_MULTIPLE == 0 and in_features % INT4_GROUP == 0

    def quantize(self, w: torch.Tensor) -> None:
        out, k = w.shape
        groups = w.reshape(out, k // INT4_GROUP, INT4_GROUP)  # (out, groups, 32)
        lo, hi = groups.amin(-1), groups.amax(-1)  # (out, groups)
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp_(0, 15)
        zero = lo + 8 * scale  # the value of code 8
        codes = q.to(torch.int32).reshape(out, k)
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # (groups, out, 2)
        self.register_buffer("scales_and_zeros", sz.to(self.dtype))

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, INT4_GROUP, self.scales_and_zeros)

    def dense(self, dtype: torch.dtype) -> torch.Tensor | None:
        out, k = self.qweight.shape[0], self.qweight.shape[1] * 2
        if self.qweight.device.type != "cpu" or not _int4_layout_is_tiled(out, k):
            return None
        groups = k // INT4_GROUP
        codes = unpack_int4(self.qweight).view(out, groups, INT4_GROUP)
        sz = self.scales_and_zeros.transpose(0, 1)  # (out, groups, 2)
        w = _scratch_buffer(out * k, dtype).view(out, groups, INT4_GROUP)
        w.copy_(codes).sub_(8)  # (exact in any float dtype: integers in -8..7)
        w.mul_(sz[..., :1]).add_(sz[..., 1:])  # (q - 8) * scale + zero, in the scales' dtype
        return w.view(out, k)

    def dequantize(self) -> torch.Tensor:
        k = self.scales_and_zeros.shape[0] * INT4_GROUP
        eye = torch.eye(k, dtype=self.dtype)  # x = I gives W^T, (in, out)
        return self.kernel(eye).float().T.contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The (out, in) uint8 codes of `_convert_weight_to_int4pack_for_cpu`'s (out, in / 2) packing:
    per tile of 64 output rows, byte (i, j) of the tile's (in, 32) block holds row j's code for
    input i in its low nibble and row j + 32's in its high one (`_int4_layout_is_tiled` checks
    that this torch packs so)."""
    out, k = packed.shape[0], packed.shape[1] * 2
    tiles = packed.view(out // 64, k, 32)
    codes = torch.empty(out // 64, 64, k, dtype=torch.uint8, device=packed.device)
    codes[:, :32].copy_(torch.bitwise_and(tiles, 15).transpose(1, 2))
    codes[:, 32:].copy_(torch.bitwise_right_shift(tiles, 4).transpose(1, 2))
    return codes.view(out, k)


@cache
def _int4_layout_is_tiled(out: int, k: int) -> bool:
    """Whether this torch packs an (out, k) int4 weight as `unpack_int4` reads it: checked once
    per shape on random codes, since the packing is the kernel's own and may change."""
    if out % 64:
        return False
    codes = torch.randint(0, 16, (out, k), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return packed.shape == (out, k // 2) and torch.equal(unpack_int4(packed).to(torch.int32), codes)


def make_quantized(weight_dtype: str, out_features: int, in_features: int, dtype: torch.dtype) -> QuantizedWeight:
    """The quantized form of an (out, in) weight for `weight_dtype` ("int8" or "int4"); int4
    falls back to int8 for shapes its kernel does not take."""
    if weight_dtype == "int4" and Int4Weight.fits(out_features, in_features):
        return Int4Weight(dtype)
    if weight_dtype in ("int4", "int8"):
        return Int8Weight(dtype)
    raise ValueError(f"weight_dtype must be 'int8' or 'int4' here, got {weight_dtype!r}")


class QuantizableLayer(nn.Module):
    """A layer with one (out, in) `weight` that it can hold quantized: the base of the linear
    and vocabulary layers. `self.quant` is None for a float weight.

    `weight_shard_ids` are the shard ids its weight is loaded in (q/k/v, gate/up parts); the
    layer is quantized when the last of them has been loaded. `vocab_rows`: the weight's rows
    are looked up as well as multiplied (an embedding), so it takes int8 in both modes."""

    weight_shard_ids: tuple = (None,)
    vocab_rows = False

    def __init__(self) -> None:
        super().__init__()
        self.quant: QuantizedWeight | None = None
        self._pending: set = set()

    def use_quantized(self, quant: QuantizedWeight) -> None:
        """Hold the weight as `quant` from now on: loading fills a float32 staging weight.
        A vocabulary layer's staging starts at zero (its padding rows are never loaded); a
        linear's is left untouched until loaded, so that unloaded layers cost no memory."""
        shape, device = self.weight.shape, self.weight.device
        make = torch.zeros if self.vocab_rows else torch.empty
        self.weight = nn.Parameter(make(shape, dtype=torch.float32, device=device), requires_grad=False)
        self.quant = quant
        self._pending = set(self.weight_shard_ids)

    def shard_loaded(self, param: torch.Tensor, shard_id) -> None:
        """Called by the loader after each tensor: quantize once the weight is complete."""
        if self.quant is None or param is not getattr(self, "weight", None):
            return
        self._pending.discard(shard_id)
        if not self._pending:
            self.finish_quantizing()

    def finish_quantizing(self) -> None:
        """Quantize the staged weight and free it (no-op when already done)."""
        if self.quant is None or "weight" not in self._parameters:
            return
        with torch.no_grad():
            self.quant.quantize(self.weight.data)
        del self.weight  # the float32 staging tensor goes; `quant` holds the weight now
        self._pending = set()


def quantize_model(model: nn.Module, weight_dtype: str) -> None:
    """Switch every quantizable layer of `model` to `weight_dtype` ("int8"/"int4") before its
    weights are loaded. The vocabulary layers (embedding, LM head) take int8 in both modes: an
    embedding reads rows, which the int4 packing does not give; a tied LM head shares the
    embedding's quantized weight."""
    if weight_dtype == "float":
        return
    dtype = _model_dtype(model)
    shared: dict[int, QuantizedWeight] = {}  # id of a float weight -> its quantized form
    for module in model.modules():
        if not isinstance(module, QuantizableLayer):
            continue
        weight = getattr(module, "weight", None)
        if weight is None:
            continue
        if id(weight) in shared:  # tied: the same parameter is loaded once, through its owner
            del module.weight
            module.quant = shared[id(weight)]
            continue
        kind = "int8" if module.vocab_rows else weight_dtype
        quant = make_quantized(kind, weight.shape[0], weight.shape[1], dtype)
        if module.vocab_rows and isinstance(quant, Int8Weight):
            quant.cpu_rows = True
        shared[id(weight)] = quant
        module.use_quantized(quant)


def finish_quantizing(model: nn.Module) -> None:
    """Quantize any layer whose weight was filled without the loader's per-shard calls."""
    for module in model.modules():
        if isinstance(module, QuantizableLayer):
            module.finish_quantizing()


def _model_dtype(model: nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())
