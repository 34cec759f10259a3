"""Load a Llama-family model from a Hugging Face model directory (config.json + safetensors)
or from a GGUF file (worker/model/gguf_loader.py).

Each rank opens the safetensors files lazily and reads only its slices of each tensor
(`safe_open(...).get_slice`), so a tensor-parallel rank never materialises other ranks'
weights. HF names map onto ours: q/k/v_proj -> qkv_proj shards "q"/"k"/"v", gate/up_proj ->
gate_up_proj shards 0/1; a tied lm_head is skipped. Missing or unexpected weights fail loudly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig

from kernels.registry import AttentionBackend, get_backend
from worker.model.dtypes import resolve_dtype, resolve_weight_dtype
from worker.model.layers.linear import default_weight_loader
from worker.model.layers.quant import finish_quantizing, quantize_model
from worker.model.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from worker.model.models import MODEL_REGISTRY
from worker.model.parallel import Collectives
from worker.model_source import is_gguf

# HF suffix -> (our suffix, shard id)
_MERGED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}
# Checkpoint entries that are not weights (old checkpoints saved RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
    collectives: Collectives | None = None,
    attention_backend: AttentionBackend | None = None,
    weight_dtype: str = "float",
) -> tuple[nn.Module, ModelConfig]:
    """Build the model for `model_dir`'s config and load this rank's share of its weights.

    `model_dir` is a model directory or a .gguf file. dtype "auto": bfloat16 on a CPU with bf16
    units, else float32 on CPU, else the checkpoint's (worker/model/dtypes.py). Without an
    attention backend, the registry picks one for `device` (Triton on CUDA, torch elsewhere).
    `weight_dtype` (float, int8, int4, auto: `resolve_weight_dtype`) is how the linear and
    vocabulary layers hold their weights (worker/model/layers/quant.py); activations stay in dtype.
    """
    model_dir = Path(model_dir)
    config = read_model_config(model_dir)
    torch_dtype = resolve_dtype(dtype, config, device)
    weight_dtype = resolve_weight_dtype(weight_dtype, model_dir, device, torch_dtype)
    attention_backend = attention_backend or get_backend(None, device)
    # Parameters start as torch.empty on CPU (untouched pages cost nothing), then move once.
    model = MODEL_REGISTRY[config.architecture](config, collectives, attention_backend)
    model = model.to(device=device, dtype=torch_dtype).eval()
    quantize_model(model, weight_dtype)
    if is_gguf(model_dir):
        from worker.model.gguf_loader import load_gguf_weights

        load_gguf_weights(model, model_dir, config)
    else:
        load_weights(model, model_dir, config.tie_word_embeddings)
    finish_quantizing(model)
    return model, config


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """config.json (and generation_config.json's eos ids), or a GGUF file's metadata ->
    ModelConfig with id and revision."""
    if is_gguf(model_dir):
        from worker.model.gguf_loader import read_gguf_config

        return read_gguf_config(model_dir)
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    archs = raw.get("architectures") or []
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture {archs[0] if archs else None!r} in {model_dir} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    hf_config = AutoConfig.from_pretrained(model_dir)
    model_id = raw.get("_name_or_path") or model_dir.name
    config = ModelConfig.from_hf(hf_config, model_id=model_id, revision=model_revision(model_dir))
    extra_eos = _generation_eos(model_dir)
    if extra_eos:
        merged = config.eos_token_ids + tuple(i for i in extra_eos if i not in config.eos_token_ids)
        config = dataclasses.replace(config, eos_token_ids=merged)
    return config


def model_revision(model_dir: str | Path) -> str:
    """Short hash of config.json, the safetensors index and every safetensors header.

    Headers hold each tensor's name, dtype, shape and byte offsets; reading them costs a few
    KB per file, not the weights. Changing any weight's layout changes the revision.
    """
    model_dir = Path(model_dir)
    h = hashlib.blake2b(digest_size=8)
    h.update((model_dir / "config.json").read_bytes())
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        h.update(index.read_bytes())
    for path in _safetensors_files(model_dir):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            h.update(path.name.encode() + f.read(n))
    return h.hexdigest()


def load_weights(model: nn.Module, model_dir: Path, tied: bool) -> None:
    """Copy this rank's slice of every checkpoint tensor into `model`, checking coverage."""
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {key for name in params for key in _expected_keys(name)}
    if tied:
        expected.discard(("lm_head.weight", None))
    loaded: set[tuple[str, Any]] = set()
    unexpected: list[str] = []
    for path in _safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for hf_name in f.keys():  # noqa: SIM118  (safe_open is not a Mapping)
                if hf_name.endswith(_IGNORED_SUFFIXES) or (tied and hf_name == "lm_head.weight"):
                    continue
                name, shard_id = map_hf_name(hf_name)
                if name not in params:
                    unexpected.append(hf_name)
                    continue
                load_one(model, name, params[name], f.get_slice(hf_name), shard_id)
                loaded.add((name, shard_id))
    check_coverage(model_dir, expected, loaded, unexpected)


def check_coverage(checkpoint: Path, expected: set[tuple[str, Any]], loaded: set[tuple[str, Any]], unexpected) -> None:
    """Fail naming the weights the checkpoint lacks and those the model has no place for."""
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
    if unexpected or missing:
        raise ValueError(
            f"checkpoint {checkpoint} does not match the model: "
            f"missing weights {missing[:10]}{' ...' if len(missing) > 10 else ''}, "
            f"unexpected weights {sorted(unexpected)[:10]}"
        )


def map_hf_name(hf_name: str) -> tuple[str, Any]:
    """HF parameter name -> (our parameter name, shard id or None)."""
    for hf_part, (ours, shard_id) in _MERGED.items():
        if hf_part in hf_name:
            return hf_name.replace(hf_part, ours), shard_id
    return hf_name, None


def _expected_keys(name: str) -> list[tuple[str, Any]]:
    """(parameter, shard id) pairs that the checkpoint must provide for our parameter."""
    shard_ids = [sid for hf_part, (ours, sid) in _MERGED.items() if ours in name]
    return [(name, sid) for sid in shard_ids] or [(name, None)]


def checkpoint_names(name: str, tied: bool) -> list[tuple[str, Any]]:
    """(HF checkpoint name, shard id) of each checkpoint tensor our parameter `name` loads
    (none for a tied lm_head): the inverse of `map_hf_name`."""
    if tied and name == "lm_head.weight":
        return []
    merged = [(name.replace(ours, hf), sid) for hf, (ours, sid) in _MERGED.items() if ours in name]
    return merged or [(name, None)]


def load_one(model: nn.Module, name: str, param: nn.Parameter, loaded: Any, shard_id) -> None:
    """Hand one checkpoint tensor (or lazy slice) to the loader of the module owning `name`."""
    module = model.get_submodule(name.rpartition(".")[0])
    loader = getattr(module, "weight_loader", default_weight_loader)
    loader(param, loaded, shard_id)
    if hasattr(module, "shard_loaded"):  # a quantized layer quantizes once its weight is whole
        module.shard_loaded(param, shard_id)


def _safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {model_dir}")
    return files


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if not path.exists():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(eos)
