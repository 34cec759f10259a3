"""Floor 1: the Triton kernels against the torch reference, and the reference against torch SDPA.

Without CUDA the Triton kernels run in Triton's interpreter (numpy), which is slow: the CPU
cases stay tiny. Cases marked `cuda` run compiled kernels on larger, model-sized shapes.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Must precede the first import of the kernel modules: @triton.jit picks interpreted or
    # compiled functions when the module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.registry import TorchBackend, get_backend  # noqa: E402
from kernels.torch_ref import paged_attention_torch, write_kv_torch  # noqa: E402
from kernels.triton_attention import (  # noqa: E402
    TritonBackend,
    choose_num_splits,
    paged_attention_triton,
    write_kv_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Output error bound per dtype: the reference computes in float32 from the same inputs, so the
# kernel differs by the output rounding plus P rounded to the input dtype before P @ V.
ATOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_batch(
    q_lens,
    seq_lens,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    page=16,
    dtype=torch.float32,
    seed=0,
    device=DEVICE,
):
    """A flat batch over a random pool whose sequences own shuffled, non-contiguous blocks.

    Returns (query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale).
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + page - 1) // page for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 1  # one padding column, filled with a valid id
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks that nobody may read
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        table[s, :n] = perm[used : used + n]
        used += n
    pool_shape = (num_blocks, page, num_kv_heads, head_dim)
    key_cache = torch.randn(pool_shape, generator=g).to(dtype)
    value_cache = torch.randn(pool_shape, generator=g).to(dtype)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    tensors = (query, key_cache, value_cache, table, starts, lens)
    return (*(t.to(device) for t in tensors), head_dim**-0.5)


# name: (q_lens, seq_lens, num_heads, num_kv_heads, head_dim, page, dtype, num_splits)
CASES = {
    "decode": ([1, 1, 1], [5, 70, 17], 4, 2, 64, 16, torch.float32, 1),
    "prefill": ([7, 20], [7, 20], 4, 2, 64, 16, torch.float32, 1),
    "mixed_gqa4": ([1, 9, 1, 24], [33, 30, 70, 24], 8, 2, 64, 16, torch.float32, 1),
    "mqa_page32": ([2, 1, 5], [40, 70, 5], 4, 1, 64, 32, torch.float32, 1),
    "page1": ([1, 3], [6, 9], 2, 2, 64, 1, torch.float32, 1),
    "head_dim80": ([1, 6], [19, 10], 4, 2, 80, 16, torch.float32, 1),
    "fp16_mixed": ([1, 9, 1], [33, 30, 70], 8, 2, 64, 16, torch.float16, 1),
    "bf16_mixed": ([1, 9, 1], [33, 30, 70], 8, 2, 64, 16, torch.bfloat16, 1),
    "split_decode": ([1, 1, 1], [150, 70, 9], 8, 2, 64, 16, torch.float32, 3),
    "split_mixed_bf16": ([1, 9], [140, 30], 4, 1, 80, 16, torch.bfloat16, 2),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_paged_attention_matches_reference(case):
    q_lens, seq_lens, heads, kv_heads, head_dim, page, dtype, num_splits = case
    args = make_batch(q_lens, seq_lens, heads, kv_heads, head_dim, page, dtype)
    expected = paged_attention_torch(*args)
    got = paged_attention_triton(*args, num_splits=num_splits)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=ATOL[dtype], rtol=0)


def test_paged_attention_writes_into_out():
    args = make_batch([1, 4], [12, 4])
    out = torch.full_like(args[0], float("nan"))
    got = paged_attention_triton(*args, out=out)
    assert got is out
    torch.testing.assert_close(out, paged_attention_torch(*args), atol=ATOL[torch.float32], rtol=0)


@pytest.mark.parametrize(
    ("kv_dtype", "cache_dtype", "page"),
    [(torch.float32, torch.float32, 16), (torch.float32, torch.float16, 1), (torch.bfloat16, torch.bfloat16, 32)],
)
def test_write_kv_matches_reference(kv_dtype, cache_dtype, page):
    g = torch.Generator().manual_seed(1)
    num_tokens, kv_heads, head_dim, num_blocks = 7, 3, 80, 8
    key = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(kv_dtype)
    value = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(kv_dtype)
    cache = torch.randn(num_blocks, page, kv_heads, head_dim, generator=g).to(cache_dtype)
    slots = torch.randperm(num_blocks * page, generator=g)[:num_tokens].to(torch.int32)
    slots[[1, 4]] = -1  # padding tokens: must leave the pool untouched
    key, value, cache, slots = (t.to(DEVICE) for t in (key, value, cache, slots))
    want_k, want_v, got_k, got_v = (cache.clone() for _ in range(4))
    write_kv_torch(key, value, want_k, want_v, slots)
    write_kv_triton(key, value, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert not torch.equal(want_k, cache)  # the valid slots did change


def dense_case(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim=32, page=16, seed=0):
    """Per-sequence dense K/V (the truth), written into a paged pool by the backend's
    write_kv. Returns (dense [(q, k, v)], paged args)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens, strict=True)]
    args = list(make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, page, seed=seed))
    query, key_cache, value_cache, table = args[:4]
    dense, slots, keys, values = [], [], [], []
    starts = args[4].tolist()
    for s, n in enumerate(seq_lens):
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(DEVICE)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(DEVICE)
        pos = torch.arange(n, device=DEVICE)
        slots.append(table[s, pos // page].long() * page + pos % page)
        keys.append(k)
        values.append(v)
        dense.append((query[starts[s] : starts[s + 1]], k, v))
    kv = (torch.cat(keys), torch.cat(values), key_cache, value_cache, torch.cat(slots))
    return dense, args, kv


def sdpa_reference(dense, scale):
    """torch SDPA per sequence: (q_len, H, D) queries at the end of (T, Hkv, D) keys."""
    outs = []
    for q, k, v in dense:
        q_len, seq_len = q.shape[0], k.shape[0]
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, heads, tokens, D)
        if q_len == seq_len:  # plain causal prefill: SDPA's own causal mask
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:  # chunk after cached context (or a decode): query i sees keys <= ctx + i
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("backend", [TorchBackend(), TritonBackend()], ids=["torch", "triton"])
@pytest.mark.parametrize(
    ("q_lens", "ctx_lens", "num_heads", "num_kv_heads"),
    [
        ([1, 1], [20, 3], 4, 4),  # decode only, MHA
        ([5, 12], [0, 0], 4, 1),  # prefill only, MQA
        ([6, 1, 1], [21, 40, 0], 8, 2),
    ],  # chunk with cached context + decodes, GQA 4
)
def test_backend_matches_sdpa(backend, q_lens, ctx_lens, num_heads, num_kv_heads):
    dense, args, kv = dense_case(q_lens, ctx_lens, num_heads, num_kv_heads)
    backend.write_kv(*kv)
    got = backend.attention(*args)
    torch.testing.assert_close(got, sdpa_reference(dense, args[-1]), atol=2e-5, rtol=1e-5)


def test_registry():
    assert isinstance(get_backend("triton"), TritonBackend)
    assert isinstance(get_backend(None, "cpu"), TorchBackend)
    assert isinstance(get_backend(None, "cuda"), TritonBackend)  # the default on CUDA
    with pytest.raises(ValueError, match="attention_backend"):
        get_backend("nope")


def test_split_rule_stays_direct_off_cuda_and_for_prefill():
    assert choose_num_splits(4, 4, 8, torch.device("cpu")) == 1
    if torch.cuda.is_available():
        assert choose_num_splits(9, 4, 8, torch.device("cuda")) == 1


BAD_INPUTS = {
    "query": lambda a: {**a, "query": a["query"][..., :32]},
    "value_cache": lambda a: {**a, "value_cache": a["value_cache"][:-1]},
    "block_tables": lambda a: {**a, "block_tables": a["block_tables"].float()},
    "query_start_loc": lambda a: {**a, "query_start_loc": a["query_start_loc"][:-1]},
    "out": lambda a: {**a, "out": torch.empty_like(a["query"], dtype=torch.float16)},
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_paged_attention_rejects_bad_input_naming_it(name):
    keys = ("query", "key_cache", "value_cache", "block_tables", "query_start_loc", "seq_lens")
    args = dict(zip(keys, make_batch([1, 2], [5, 2]), strict=False))
    with pytest.raises(ValueError, match=name):
        paged_attention_triton(**BAD_INPUTS[name](args), scale=0.1)


def test_write_kv_rejects_bad_slot_mapping():
    kv = torch.zeros(3, 2, 16)
    cache = torch.zeros(2, 4, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_triton(kv, kv, cache, cache.clone(), torch.zeros(3, dtype=torch.float32))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_cuda_model_sized_mixed_batch(dtype, head_dim):
    q_lens = [1] * 12 + [300, 77, 1024]
    seq_lens = [i * 97 + 5 for i in range(12)] + [1500, 77, 3000]
    args = make_batch(q_lens, seq_lens, 32, 8, head_dim, 16, dtype, seed=3)
    expected = paged_attention_torch(*args).float()
    got = paged_attention_triton(*args).float()
    torch.testing.assert_close(got, expected, atol=ATOL[dtype], rtol=0)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("page", [1, 16, 32])
@pytest.mark.parametrize("num_kv_heads", [1, 8])
def test_cuda_long_decode_takes_split_path(page, num_kv_heads):
    seq_lens = [8192, 3000]
    assert choose_num_splits(2, 2, num_kv_heads, torch.device("cuda")) > 1
    args = make_batch([1, 1], seq_lens, 32, num_kv_heads, 128, page, torch.bfloat16, seed=4)
    expected = paged_attention_torch(*args)
    got = paged_attention_triton(*args)  # split count from the rule
    torch.testing.assert_close(got.float(), expected.float(), atol=ATOL[torch.bfloat16], rtol=0)


AOT_CASES = {
    "attention_bf16_decode_split": (
        "triton_paged_attention",
        "_paged_attention_kernel",
        "*bf16",
        dict(
            GROUP=4,
            GROUP_PAD=4,
            BLOCK_Q=4,
            BLOCK_M=16,
            BLOCK_N=64,
            HEAD_DIM=128,
            HEAD_PAD=128,
            PAGE=16,
            SPLIT=True,
            UPCAST=False,
            PRECISION="tf32",
            SCALES=0,
        ),
    ),
    "attention_fp32_prefill_hd80_page1": (
        "triton_paged_attention",
        "_paged_attention_kernel",
        "*fp32",
        dict(
            GROUP=1,
            GROUP_PAD=1,
            BLOCK_Q=64,
            BLOCK_M=64,
            BLOCK_N=32,
            HEAD_DIM=80,
            HEAD_PAD=128,
            PAGE=1,
            SPLIT=False,
            UPCAST=False,
            PRECISION="ieee",
            SCALES=0,
        ),
    ),
    "attention_bf16_int8_cache_decode_split": (
        "triton_paged_attention",
        "_paged_attention_kernel",
        "*bf16",
        dict(
            GROUP=4,
            GROUP_PAD=4,
            BLOCK_Q=4,
            BLOCK_M=16,
            BLOCK_N=64,
            HEAD_DIM=128,
            HEAD_PAD=128,
            PAGE=16,
            SPLIT=True,
            UPCAST=False,
            PRECISION="tf32",
            SCALES=1,
        ),
        {"key_cache": "*i8", "value_cache": "*i8", "k_scale": "*fp16", "v_scale": "*fp16"},
    ),
    "attention_fp16_fp8_cache_prefill": (
        "triton_paged_attention",
        "_paged_attention_kernel",
        "*fp16",
        dict(
            GROUP=3,
            GROUP_PAD=4,
            BLOCK_Q=16,
            BLOCK_M=64,
            BLOCK_N=64,
            HEAD_DIM=64,
            HEAD_PAD=64,
            PAGE=32,
            SPLIT=False,
            UPCAST=False,
            PRECISION="tf32",
            SCALES=2,
        ),
        {"key_cache": "*fp8e4nv", "value_cache": "*fp8e4nv", "k_scale": "*fp32", "v_scale": "*fp32"},
    ),
    "merge_splits": (
        "triton_paged_attention",
        "_merge_splits_kernel",
        "*bf16",
        dict(SPLITS_PAD=32, HEAD_DIM=80, HEAD_PAD=128),
    ),
    "write_kv": (
        "triton_write_kv",
        "_write_kv_kernel",
        "*fp16",
        dict(
            NUM_KV_HEADS=3,
            HEADS_PAD=4,
            HEAD_DIM=80,
            HEAD_PAD=128,
            PAGE=16,
            SCALES=0,
            QMAX=0.0,
            IS_INT=False,
            MIN_SCALE=6.1e-5,
        ),
    ),
    "write_kv_int8_token_scales": (
        "triton_write_kv",
        "_write_kv_kernel",
        "*bf16",
        dict(
            NUM_KV_HEADS=3,
            HEADS_PAD=4,
            HEAD_DIM=64,
            HEAD_PAD=64,
            PAGE=16,
            SCALES=1,
            QMAX=127.0,
            IS_INT=True,
            MIN_SCALE=6.1e-5,
        ),
        {"key_cache": "*i8", "value_cache": "*i8", "k_scale": "*fp16", "v_scale": "*fp16"},
    ),
    "write_kv_fp8_tensor_scale": (
        "triton_write_kv",
        "_write_kv_kernel",
        "*bf16",
        dict(
            NUM_KV_HEADS=8,
            HEADS_PAD=8,
            HEAD_DIM=128,
            HEAD_PAD=128,
            PAGE=16,
            SCALES=2,
            QMAX=448.0,
            IS_INT=False,
            MIN_SCALE=6.1e-5,
        ),
        {"key_cache": "*fp8e4nv", "value_cache": "*fp8e4nv", "k_scale": "*fp32", "v_scale": "*fp32"},
    ),
}

# Runs in a child process without TRITON_INTERPRET: Triton's own jit helpers (tl.cdiv,
# tl.max, ...) are interpreted functions in this process and cannot be compiled here.
_AOT_SCRIPT = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

results = {}
for case, (module, name, data, constexprs, *cache) in json.loads(sys.argv[1]).items():
    kernel = getattr(importlib.import_module("kernels." + module), name)
    pointers = {n: data for n in ("query", "key_cache", "value_cache", "out", "key", "value",
                                  "k_scale", "v_scale")}
    pointers |= {n: "*i32" for n in ("block_tables", "query_start_loc", "seq_lens", "slot_mapping")}
    pointers |= {n: "*fp32" for n in ("partial_out", "partial_lse")}
    pointers |= cache[0] if cache else {}  # an 8-bit cache and its scales
    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in kernel.arg_names}
    if "scale_log2" in sig:
        sig["scale_log2"] = "fp32"
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    results[case] = {"cubin_bytes": len(compiled.asm["cubin"]), "shared": compiled.metadata.shared}
print(json.dumps(results))
"""


def test_kernels_compile_for_hopper():
    """The interpreter does not check what the compiler does (tl.dot minimum sizes, loop-carried
    types, shared memory): build each kernel for sm_90 with Triton's compiler and ptxas."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", _AOT_SCRIPT, json.dumps(AOT_CASES)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results.keys() == AOT_CASES.keys()
    for case, result in results.items():
        assert result["cubin_bytes"] > 0, case
        assert result["shared"] <= 228 * 1024, case  # H100/H200 shared memory per block
