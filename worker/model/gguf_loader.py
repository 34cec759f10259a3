"""Llama-family models from a GGUF file (llama.cpp's one-file format): config, tokenizer, weights.

The config and the tokenizer (its chat template included) come from the file's metadata through
transformers' GGUF support (`from_pretrained(dir, gguf_file=...)`), so they are what transformers
builds from the same file. The tensors are read through the `gguf` package's reader (a memory
map) and dequantized with its `gguf.quants`, one slice at a time: a tensor-parallel rank
dequantizes only the rows it holds or, for row-parallel layers, only the quantization blocks
that cover its columns, and never materialises the other ranks' weights. Tensor names map
through gguf's own table (`get_tensor_name_map`); llama.cpp stores Llama's q/k projection rows
interleaved per head for its RoPE layout, which is undone per head, as transformers does.

Architectures and quantization types outside ours are refused when the file is opened, naming
what the file has and what is supported.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from torch import nn

from worker.model.model_config import ModelConfig
from worker.model.model_loader import check_coverage, checkpoint_names, load_one

# GGUF's `general.architecture` values that our Llama-family model covers.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Every type here is dequantized by `gguf.quants` and is written and checked by the tests.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# llama.cpp's converter interleaves the rows of each q/k head for these architectures only.
_PERMUTED_ARCHITECTURES = ("llama",)
# Tensors we cannot apply and must not silently drop: outputs would differ from llama.cpp's.
_REFUSED_TENSORS = {"rope_freqs.weight": "per-dimension RoPE scaling factors (Llama 3.1 and later)"}


def read_gguf_config(path: str | Path) -> ModelConfig:
    """The model's config from the file's metadata, with the file's name and revision."""
    path = Path(path)
    return _config(str(path.resolve()), _stamp(path))


def gguf_tokenizer(path: str | Path) -> Any:
    """The tokenizer stored in the file (with its chat template), or None when it has none.

    Each call returns its own copy (a router and an engine in one process must not share a
    tokenizer across threads), copied from one built per process: building it parses the
    file's metadata again (seconds), a copy takes a fraction of a second."""
    path = Path(path)
    tokenizer = _tokenizer(str(path.resolve()), _stamp(path))
    return copy.deepcopy(tokenizer) if tokenizer is not None else None


def load_gguf_weights(model: nn.Module, path: str | Path, config: ModelConfig) -> int:
    """Copy this rank's slice of every tensor in the file into `model`, checking coverage.

    Returns the bytes of tensor data read from the file (a rank of a tensor-parallel group
    reads about 1/tp of the sharded tensors, plus the replicated norms)."""
    path = Path(path)
    reader = _reader(str(path.resolve()), _stamp(path))
    arch = _architecture(reader, path)
    names = gguf.get_tensor_name_map(_arch_enum(arch), config.num_layers)
    params = dict(model.named_parameters(remove_duplicate=False))
    wanted: dict[str, tuple[str, Any]] = {}  # GGUF name -> (our parameter, shard id)
    for name in params:
        for hf_name, shard_id in checkpoint_names(name, config.tie_word_embeddings):
            base, _, suffix = hf_name.rpartition(".")
            wanted[f"{names.get_name(base)}.{suffix}"] = (name, shard_id)
    permuted = {".attn_q.": config.num_heads, ".attn_k.": config.num_kv_heads}
    if arch not in _PERMUTED_ARCHITECTURES:
        permuted = {}
    loaded, unexpected, bytes_read = set(), [], 0
    for tensor in reader.tensors:
        if tensor.name not in wanted:
            unexpected.append(tensor.name)
            continue
        name, shard_id = wanted[tensor.name]
        n_heads = next((n for part, n in permuted.items() if part in tensor.name), None)
        view = GGUFTensorSlice(tensor, n_heads)
        load_one(model, name, params[name], view, shard_id)
        loaded.add((name, shard_id))
        bytes_read += view.bytes_read
    expected = {(n, s) for n, s in wanted.values()}
    check_coverage(path, expected, loaded, unexpected)
    return bytes_read


def layer_weight_types(path: str | Path) -> set[str]:
    """The GGUF types of the file's layer weights (the 2-d `blk.*` tensors: what the linear
    layers hold), e.g. {"Q4_1"}."""
    path = Path(path)
    reader = _reader(str(path.resolve()), _stamp(path))
    return {
        gguf.GGMLQuantizationType(t.tensor_type).name
        for t in reader.tensors
        if t.name.startswith("blk.") and len(t.shape) == 2
    }


class GGUFTensorSlice:
    """One GGUF tensor as a lazy (out, in) torch tensor: `[rows]`, `[:, cols]` and `[:]` read
    and dequantize only what they cover, to float32. This is the interface of a safetensors
    slice, which the parallel layers' weight loaders take (worker/model/layers/linear.py).

    `heads`: the tensor is a Llama q or k projection (weight or bias) stored with each head's
    rows interleaved, as (head_dim / 2, 2), by llama.cpp; they come back as (2, head_dim / 2).
    """

    def __init__(self, tensor: Any, heads: int | None = None) -> None:
        self._tensor = tensor
        self._heads = heads
        self._type = gguf.GGMLQuantizationType(tensor.tensor_type)
        self._shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims inner first
        self.bytes_read = 0

    def get_shape(self) -> tuple[int, ...]:
        return self._shape

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        r0, r1 = _bounds(index[0], self._shape[0])
        if len(self._shape) == 1:  # norms and biases: small, read whole
            values = self._unpermute(self._dequantize(0, 1, 0, self._shape[0])[0], 0)[r0:r1]
            return torch.from_numpy(values)
        c0, c1 = _bounds(index[1], self._shape[1]) if len(index) > 1 else (0, self._shape[1])
        if self._heads is None:
            return torch.from_numpy(self._dequantize(r0, r1, c0, c1))
        size = self._shape[0] // self._heads  # rows of one head
        h0, h1 = r0 // size * size, -(-r1 // size) * size  # whole heads around the rows
        values = self._unpermute(self._dequantize(h0, h1, c0, c1), h0)
        return torch.from_numpy(np.ascontiguousarray(values[r0 - h0 : r1 - h0]))

    def _dequantize(self, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        """Rows [r0, r1), columns [c0, c1) as float32: the quantization blocks covering the
        columns are read and dequantized, then trimmed to them."""
        block, block_bytes = gguf.GGML_QUANT_SIZES[self._type]
        b0, b1 = c0 // block, -(-c1 // block)
        rows = self._tensor.data.reshape(-1, self._tensor.data.shape[-1]).view(np.uint8)
        raw = rows[r0:r1, b0 * block_bytes : b1 * block_bytes].copy()  # writable, contiguous
        self.bytes_read += raw.nbytes
        values = gguf.quants.dequantize(raw, self._type).reshape(r1 - r0, -1)
        return values[:, c0 - b0 * block : c1 - b0 * block]

    def _unpermute(self, values: np.ndarray, first_row: int) -> np.ndarray:
        """Rows of whole heads from (head_dim / 2, 2) order back to (2, head_dim / 2)."""
        if self._heads is None:
            return values
        size = self._shape[0] // self._heads
        assert first_row % size == 0 and len(values) % size == 0, "not whole heads"
        rest = values.shape[1:]
        heads = values.reshape(len(values) // size, size // 2, 2, *rest)
        return heads.swapaxes(1, 2).reshape(values.shape)


def _bounds(index: Any, size: int) -> tuple[int, int]:
    if not isinstance(index, slice) or index.step not in (None, 1):
        raise ValueError(f"a GGUF tensor is read by contiguous slices, got {index!r}")
    start, stop, _ = index.indices(size)
    return start, max(start, stop)


# ---- opening and checking a file (cached per process: a file is read by the router and by
# every in-process engine, and parsing its metadata takes seconds for a 49k-token vocabulary)


def _stamp(path: Path) -> tuple[int, int]:
    """(size, mtime) of the file: a cached read is reused only for the same file."""
    if not path.is_file():
        raise ValueError(f"model {str(path)!r} is not a file (a .gguf model is one file)")
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=4)
def _reader(path: str, stamp: tuple[int, int]) -> gguf.GGUFReader:
    """The file's reader, after checking its architecture and every tensor's type."""
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"model {path!r} is not a readable GGUF file: {e}") from None
    _architecture(reader, Path(path))
    unsupported: dict[str, list[str]] = {}
    for t in reader.tensors:
        if t.name in _REFUSED_TENSORS:
            raise ValueError(f"{path}: tensor {t.name!r} ({_REFUSED_TENSORS[t.name]}) is not supported")
        kind = gguf.GGMLQuantizationType(t.tensor_type).name
        if kind not in SUPPORTED_TYPES:
            unsupported.setdefault(kind, []).append(t.name)
    if unsupported:
        found = "; ".join(
            f"{kind} ({names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''})"
            for kind, names in unsupported.items()
        )
        raise ValueError(f"{path}: quantization type {found} is not supported; supported: {', '.join(SUPPORTED_TYPES)}")
    return reader


@functools.lru_cache(maxsize=4)
def _config(path: str, stamp: tuple[int, int]) -> ModelConfig:
    reader = _reader(path, stamp)
    from transformers import AutoConfig

    p = Path(path)
    hf_config = AutoConfig.from_pretrained(p.parent, gguf_file=p.name)
    return ModelConfig.from_hf(hf_config, model_id=p.name, revision=_revision(p, reader))


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str, stamp: tuple[int, int]) -> Any:
    if "tokenizer.ggml.model" not in _reader(path, stamp).fields:
        return None
    from transformers import AutoTokenizer

    p = Path(path)
    return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)


def _revision(path: Path, reader: gguf.GGUFReader) -> str:
    """Short hash of everything before the tensor data: the metadata (config, tokenizer) and
    each tensor's name, type, shape and offset. Like a safetensors header's hash, it changes
    with the layout and the quantization of any weight."""
    h = hashlib.blake2b(digest_size=8)
    with open(path, "rb") as f:
        h.update(f.read(reader.data_offset))
    return h.hexdigest()


def _architecture(reader: gguf.GGUFReader, path: Path) -> str:
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} in {path} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _arch_enum(arch: str) -> gguf.MODEL_ARCH:
    return next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
