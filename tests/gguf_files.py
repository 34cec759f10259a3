"""GGUF files written from tiny random models, the way llama.cpp's converter writes them.

`write_gguf` takes a model directory from `worker.model.builtin_model.make_model_dir` and writes its
config, (optionally) a tokenizer, and its tensors with the `gguf` package's writer: names from
gguf's own table, 2-D weights in the chosen quantization type (`gguf.quants`), norms in F32, and
Llama's q/k rows interleaved per head as llama.cpp stores them. transformers, reading the same
file, is the reference for everything the engine loads from it.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file


def write_gguf(
    model_dir: Path,
    path: Path,
    qtype: str = "F32",
    tokenizer=None,
    arch: str | None = None,
    types: dict[str, str] | None = None,
) -> Path:
    """Write `model_dir`'s model to `path`; `types` overrides the type of single tensors by
    GGUF name (e.g. {"output_norm.weight": "F64"}); `arch` overrides the architecture name."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    file_arch = arch or config["model_type"]
    writer = gguf.GGUFWriter(str(path), file_arch)
    writer.add_name(Path(model_dir).name)
    _add_config(writer, config, file_arch)
    if tokenizer is not None:
        _add_tokenizer(writer, tokenizer)
    layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(_arch_enum(config["model_type"]), layers)
    state = load_file(Path(model_dir) / "model.safetensors")
    for hf_name, tensor in state.items():
        base, _, suffix = hf_name.rpartition(".")
        name = f"{names.get_name(base)}.{suffix}"
        data = _permuted(hf_name, tensor.astype(np.float32), config, file_arch)
        kind = (types or {}).get(name, qtype if data.ndim == 2 else "F32")
        _add_tensor(writer, name, data, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_config(writer: gguf.GGUFWriter, c: dict, arch: str) -> None:
    heads = c["num_attention_heads"]
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(c.get("num_key_value_heads") or heads)
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_freq_base(c.get("rope_parameters", {}).get("rope_theta", 10000.0))
    writer.add_rope_dimension_count(c.get("head_dim") or c["hidden_size"] // heads)
    writer.add_vocab_size(c["vocab_size"])


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer) -> None:
    """A byte-level BPE tokenizer as llama.cpp's "gpt2" tokenizer model."""
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in special else 1 for t, _ in vocab])  # control / normal
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)


def _permuted(hf_name: str, data: np.ndarray, c: dict, arch: str) -> np.ndarray:
    """llama.cpp's converter interleaves Llama's q/k rows per head: (2, d/2) -> (d/2, 2)."""
    if arch != "llama" or not (".q_proj." in hf_name or ".k_proj." in hf_name):
        return data
    heads = c["num_attention_heads"]
    if ".k_proj." in hf_name:
        heads = c.get("num_key_value_heads") or heads
    rows = data.shape[0]
    return data.reshape(heads, 2, rows // heads // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)


def _add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, kind: str) -> None:
    if kind == "F64":
        writer.add_tensor(name, data.astype(np.float64))
        return
    qtype = gguf.GGMLQuantizationType[kind]
    packed = gguf.quants.quantize(data, qtype)
    if kind in ("F32", "F16"):
        writer.add_tensor(name, packed)
    else:
        writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)


def _arch_enum(model_type: str) -> gguf.MODEL_ARCH:
    return next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == model_type)


def load_transformers(path: Path):
    """transformers' own reading of the GGUF file: the model in float32, for reference."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()
