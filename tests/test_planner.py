"""The capacity planner against seed 000's worked numbers, torch's dtype sizes and the K/V
tensors that transformers' own Llama puts in its cache."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from cluster.planner import (
    KVShape,
    block_bytes,
    blocks_for_tokens,
    bytes_per_token,
    kv_dtype_bytes,
    local_kv_heads,
    parse_size,
    plan,
)

KiB, MiB, GiB = 2**10, 2**20, 2**30
# Seed 000, section 02: the teaching model.
SEED = KVShape(layers=32, kv_heads=8, head_dim=128, kv_dtype="bfloat16", block_size=16)


def test_seed_bytes_per_token_is_128_kib():
    assert bytes_per_token(32, 8, 128, "bfloat16") == 131_072 == 128 * KiB
    assert SEED.bytes_per_token() == 128 * KiB


def test_seed_requests_and_contiguous_reservation():
    p = plan(SEED, [8192, 4096, 2048])
    assert [r.bytes for r in p.requests] == [1 * GiB, GiB // 2, GiB // 4]
    assert p.total_tokens == 14_336
    assert p.total_bytes == 1.75 * GiB
    assert p.contiguous_reserved_bytes == 3 * GiB  # all three reserved at 8,192 tokens


def test_seed_blocks_of_16_tokens():
    assert block_bytes(32, 8, 128, "bfloat16", 16) == 2 * MiB
    assert blocks_for_tokens(37, 16) == 3 == math.ceil(37 / 16)
    (r,) = plan(SEED, [37]).requests
    assert (r.blocks, r.allocated_bytes, r.tail_slots) == (3, 6 * MiB, 11)
    assert r.tail_waste_bytes == 1.375 * MiB


def test_seed_shared_prefix_2_gib_to_1_5_gib():
    p = plan(SEED, [8192, 8192], shared_prefix=4096)
    assert p.total_bytes == 2 * GiB
    assert p.shared_prefix_savings_bytes == GiB // 2
    assert p.total_with_shared_prefix_bytes == 1.5 * GiB


def test_shared_prefix_counts_only_requests_that_reach_it():
    # The 2,048-token request is shorter than the prefix: 8192 and 4096 share it once.
    p = plan(SEED, [8192, 4096, 2048], shared_prefix=4096)
    assert p.shared_prefix_savings_bytes == 4096 * 128 * KiB


def test_seed_pool_fits_seven_8192_token_sequences():
    p = plan(SEED, [8192], device_memory="24GiB", reserved="17GiB")
    assert p.pool_bytes == 7 * GiB
    assert p.max_sequences == 7
    assert p.pool_blocks == 7 * GiB // (2 * MiB)


def test_max_len_sets_reservation_and_sequences():
    p = plan(SEED, [37, 100], max_len=1024, device_memory=8 * GiB, reserved=0)
    assert p.contiguous_reserved_bytes == 2 * 1024 * 128 * KiB
    assert p.max_sequences == 8 * GiB // (1024 * 128 * KiB)
    with pytest.raises(ValueError, match="max_len"):
        plan(SEED, [8192], max_len=4096)
    with pytest.raises(ValueError, match="reserved"):
        plan(SEED, [8192], device_memory="16GiB", reserved="17GiB")


def test_tp_shards_kv_heads():
    assert local_kv_heads(8, 2) == 4
    assert bytes_per_token(32, 8, 128, "bfloat16", tp=2) == 64 * KiB
    p = plan(SEED, [8192], device_memory="24GiB", reserved="17GiB", tp=2)
    assert (p.per_device_bytes_per_token, p.per_device_block_bytes) == (64 * KiB, MiB)
    assert p.bytes_per_token == 128 * KiB  # whole-model figure is unchanged
    assert p.max_sequences == 14  # each device holds half of each block


def test_tp_replicates_when_fewer_kv_heads_than_devices():
    assert local_kv_heads(2, 4) == 1
    one_head = bytes_per_token(32, 1, 128, "bfloat16")
    assert bytes_per_token(32, 2, 128, "bfloat16", tp=4) == one_head


@pytest.mark.parametrize(("kv_heads", "tp", "problem"), [(3, 2, "divisible"), (2, 3, "multiple")])
def test_tp_rejects_uneven_heads(kv_heads, tp, problem):
    with pytest.raises(ValueError, match=problem):
        local_kv_heads(kv_heads, tp)
    with pytest.raises(ValueError, match=problem):
        plan(KVShape(4, kv_heads, 64), [16], tp=tp)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp8", torch.float8_e4m3fn),
        ("fp8_e5m2", torch.float8_e5m2),
        ("int8", torch.int8),
    ],
)
def test_kv_dtype_bytes_match_torch(name, dtype):
    assert kv_dtype_bytes(name) == dtype.itemsize
    assert kv_dtype_bytes(str(dtype)) == dtype.itemsize  # "torch.float16" from a config


def test_int8_counts_a_float16_scale_per_token_and_head():
    layers, heads, dim, tokens = 3, 2, 64, 5
    # Per layer: K and V values (tokens, heads, dim) int8 and scales (tokens, heads) float16.
    values = torch.empty(tokens, heads, dim, dtype=torch.int8)
    scales = torch.empty(tokens, heads, dtype=torch.float16)
    stored = 2 * layers * (values.nbytes + scales.nbytes)
    assert bytes_per_token(layers, heads, dim, "int8") * tokens == stored
    assert bytes_per_token(layers, heads, dim, "int8") == 2 * layers * heads * (dim + 2)


def test_fp8_scales_come_out_of_the_pool_not_the_token():
    shape = KVShape(layers=4, kv_heads=2, head_dim=64, kv_dtype="fp8", block_size=16)
    assert shape.bytes_per_token() == 2 * 4 * 2 * 64
    scale = torch.empty((), dtype=torch.float32)  # one per layer for K, one for V
    assert shape.pool_scale_bytes() == 2 * 4 * scale.nbytes
    exact = 10 * shape.block_bytes()
    assert shape.num_blocks(exact) == 9  # the scales take part of the tenth block
    assert shape.num_blocks(exact + shape.pool_scale_bytes()) == 10


def _llama_cache_bytes_per_token(cfg: LlamaConfig, tokens: int = 7) -> int:
    model = LlamaForCausalLM(cfg).to(cfg.dtype).eval()
    with torch.no_grad():
        cache = model(torch.arange(tokens)[None], use_cache=True).past_key_values
    stored = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return stored // tokens  # batch 1: (1, kv_heads, tokens, head_dim) per tensor


@pytest.mark.parametrize(
    ("kv_heads", "head_dim", "dtype"),
    [(2, None, "bfloat16"), (1, 16, "float32"), (4, None, "float16")],
)
def test_from_hf_config_matches_transformers_cache(tmp_path, kv_heads, head_dim, dtype):
    extra = {} if head_dim is None else {"head_dim": head_dim}
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        dtype=dtype,
        **extra,
    )
    cfg.save_pretrained(tmp_path)
    shape = KVShape.from_hf_config(tmp_path)
    assert shape.kv_dtype == dtype
    assert shape.bytes_per_token() == _llama_cache_bytes_per_token(cfg)
    assert KVShape.from_hf_config(tmp_path / "config.json") == shape
    assert KVShape.from_hf_config(cfg.to_dict(), kv_dtype="fp8").kv_dtype == "fp8"


def test_from_hf_config_defaults():
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 6, "hidden_size": 384}
    shape = KVShape.from_hf_config(cfg, block_size=32)
    assert (shape.kv_heads, shape.head_dim, shape.kv_dtype) == (6, 64, "float32")
    assert KVShape.from_hf_config({**cfg, "torch_dtype": "float16"}).kv_dtype == "float16"
    with pytest.raises(ValueError, match="num_hidden_layers"):
        KVShape.from_hf_config({"num_attention_heads": 4, "hidden_size": 64})


@pytest.mark.parametrize(
    ("field", "value"),
    [("layers", 0), ("kv_heads", -1), ("head_dim", 1.5), ("block_size", 0), ("kv_dtype", "fp4")],
)
def test_kv_shape_rejects_bad_fields(field, value):
    fields = {"layers": 2, "kv_heads": 2, "head_dim": 8, "kv_dtype": "bf16", "block_size": 16}
    with pytest.raises(ValueError, match=field):
        KVShape(**{**fields, field: value})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * GiB),
        ("17 gib", 17 * GiB),
        ("1.5MiB", 3 * MiB // 2),
        ("512MB", 512 * 10**6),
        ("2KB", 2000),
        ("64KiB", 64 * KiB),
        ("4096", 4096),
        ("10B", 10),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "24XB", "-1GiB", "0.1B", "1e3", "24 Gi B"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


@given(
    n=st.integers(0, 100_000),
    block_size=st.integers(1, 512),
)
def test_blocks_cover_tokens_with_less_than_one_block_to_spare(n, block_size):
    blocks = blocks_for_tokens(n, block_size)
    assert blocks == math.ceil(n / block_size)
    assert 0 <= blocks * block_size - n < block_size


@given(
    layers=st.integers(1, 80),
    kv_heads=st.integers(1, 64),
    head_dim=st.sampled_from([64, 80, 128, 256]),
    tp=st.sampled_from([1, 2, 4, 8]),
    dtype=st.sampled_from(["float32", "bfloat16", "float16", "fp8", "int8"]),
)
def test_tp_devices_together_hold_every_kv_head(layers, kv_heads, head_dim, tp, dtype):
    try:
        per_device = bytes_per_token(layers, kv_heads, head_dim, dtype, tp)
    except ValueError:
        assert kv_heads % tp if kv_heads >= tp else tp % kv_heads
        return
    whole = bytes_per_token(layers, kv_heads, head_dim, dtype)
    # Sharded heads add up exactly; replicated ones are stored tp / kv_heads times.
    assert per_device * tp == whole * max(1, tp // kv_heads)
