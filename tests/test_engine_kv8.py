"""The engine on 8-bit KV caches: int8 (a scale per token and KV head) and float8 e4m3 (a
calibrated scale per tensor).

The reference is transformers on the same weights, its attention reading K and V quantized and
dequantized as kernels/kv_quant.py defines (benchmarks/kv_accuracy.py `fake_quant`); the pool
against the planner byte for byte; 8k-token sequences admitted at once against the 16-bit
cache's at the same bytes; KV dtypes kept apart by the prefix cache and the routing index.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import time
from types import SimpleNamespace

import pytest
import torch
from factories import transformers_greedy
from transformers import AutoModelForCausalLM

from benchmarks.kv_accuracy import (
    absmax_per_head,
    engine_chunk_logits,
    fake_quant,
    per_token,
    static,
)
from benchmarks.kv_cache import CAPACITY_MODEL, capacity_case
from cluster.index import InMemoryPrefixIndex
from cluster.local_group import LocalGroup
from cluster.planner import KVShape
from kernels.kv_quant import FP8_E4M3, FP8_MAX
from pagefleet.llm import LLM, engine_config
from worker.config import CacheConfig
from worker.exec.kv_calibration import CALIBRATION_SEED, CALIBRATION_TOKENS, HEADROOM
from worker.model.builtin_model import make_model_dir
from worker.protocol import GenerationRequest
from worker.sampling_params import SamplingParams

DTYPES = ["int8", "fp8"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
# Every engine here runs in float32 (dtype="float32"): the references do, and "auto" is
# bfloat16 on a CPU with bf16 units.
# a pool of 20 blocks of 8 tokens: the workload's six ~50-token requests cannot run at once
TIGHT = dict(block_size=8, num_blocks=20, max_model_len=128, watermark=0.0, max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(
        tmp_path_factory.mktemp("kv8"),
        arch="llama",
        seed=7,
        output_scale=8.0,
        head_dim=32,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def prompts_of(lengths, seed, vocab=256):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def quantized_reference(model_dir, llm):
    """transformers attending to K/V as `llm`'s 8-bit pool holds them (its scales)."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pool = llm.engine.executor.worker.pool
    if pool.layout.token_scales:
        fake_quant(hf, per_token(pool.layout.dtype))
    else:
        scales = {
            (i, kind): s[i].cpu() for kind, s in (("k", pool.k_scales), ("v", pool.v_scales)) for i in range(len(s))
        }
        fake_quant(hf, static(pool.layout.dtype, scales))
    return hf


@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_equal_transformers_on_the_same_quantized_kv(dtype, model_dir):
    """Teacher-forced, through the engine's own model, pool and attention, in two chunks (the
    second reads the first from the 8-bit cache): equal to the quantized reference to float32
    rounding, and a hundred times further from the float one, so the cache holds 8 bits."""
    llm = LLM(str(model_dir), dtype="float32", kv_cache_dtype=dtype, num_blocks=16, max_model_len=128)
    ids = prompts_of([70], seed=1)[0]
    ours = torch.cat([engine_chunk_logits(llm, ids, 0, 40), engine_chunk_logits(llm, ids, 40, 30)])
    hf = quantized_reference(model_dir, llm)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
        fake_quant(hf, None)
        full = hf(torch.tensor([ids])).logits[0]
    err, quant_effect = (ours - want).abs().max(), (want - full).abs().max()
    assert err < 1e-4, err
    assert quant_effect > 1e-2, quant_effect


def test_fp8_scales_place_the_calibration_absmax_at_448_over_the_headroom(model_dir):
    """Each layer's K and V scale: transformers' absmax of K and V over the calibration ids
    (the model's own forward pass, the same ids), x HEADROOM / 448."""
    llm = LLM(str(model_dir), dtype="float32", kv_cache_dtype="fp8", num_blocks=16, max_model_len=128)
    pool = llm.engine.executor.worker.pool
    vocab = llm.engine.model_config.vocab_size
    ids = torch.randint(0, vocab, (CALIBRATION_TOKENS,), generator=torch.Generator().manual_seed(CALIBRATION_SEED))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    amax = absmax_per_head(hf, ids.tolist())
    for i, (ks, vs) in enumerate(zip(pool.k_scales, pool.v_scales, strict=True)):
        for kind, got in (("k", ks), ("v", vs)):
            want = float(amax[(i, kind)].max()) * HEADROOM / FP8_MAX
            assert float(got) == pytest.approx(want, rel=1e-5), (i, kind)


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_equals_transformers_with_prefix_hits_preemption_and_chunks(dtype, model_dir):
    docs, questions = prompts_of([30, 25], seed=2), prompts_of([9, 14, 17], seed=3)
    prompts = [d + q for d in docs for q in questions]
    llm = LLM(str(model_dir), dtype="float32", kv_cache_dtype=dtype, **TIGHT)
    rounds = [[o.token_ids for o in llm.generate(prompts, GREEDY)] for _ in range(2)]
    want = transformers_greedy(quantized_reference(model_dir, llm), prompts, GREEDY.max_tokens)
    assert rounds[0] == rounds[1] == want
    s = llm.stats()
    assert s["preemptions"] > 0 and s["prefix_cache_hits"] > 0, s
    assert s["blocks_free"] == s["blocks_total"] and s["running"] == s["waiting"] == 0


# ---- bytes ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kv_cache_dtype", "planner_dtype"),
    [
        ("auto", "float32"),
        ("float16", "fp16"),
        ("bfloat16", "bfloat16"),
        ("int8", "int8"),
        ("fp8", "fp8"),
        ("fp8_e4m3", "fp8_e4m3"),
    ],
)
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_pool_agrees_with_the_planner_byte_for_byte(kv_cache_dtype, planner_dtype, kv_heads, tmp_path):
    model = make_model_dir(tmp_path, seed=1, head_dim=32, num_attention_heads=4, num_key_value_heads=kv_heads)
    budget = (3 << 20) + 12345
    llm = LLM(str(model), dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory=budget, max_model_len=256)
    shape = KVShape.from_hf_config(model, kv_dtype=planner_dtype, block_size=16)
    pool = llm.engine.executor.worker.pool
    held = [t for t in (*pool.k_caches, *pool.v_caches, *pool.k_scales, *pool.v_scales) if t is not None]
    allocated = sum(t.numel() * t.element_size() for t in held)
    assert llm.stats()["kv_bytes_per_token"] == shape.bytes_per_token()
    assert llm.stats()["blocks_total"] == shape.num_blocks(budget)
    assert allocated == llm.stats()["kv_pool_bytes"]
    assert allocated == shape.num_blocks(budget) * shape.block_bytes() + shape.pool_scale_bytes()
    assert allocated <= budget


def test_twice_the_8k_sequences_at_once_in_the_engine_and_the_planner(tmp_path):
    """At the bytes of three 8k-token sequences in a bfloat16 cache, the running engine holds
    as many whole sequences at once as the planner says fit: six with either 8-bit cache."""
    model = make_model_dir(tmp_path, seed=0, vocab_size=512, **CAPACITY_MODEL)
    args = SimpleNamespace(capacity_len=8192, capacity_out=8, block_size=16, dtype="float32")
    sequence = KVShape.from_hf_config(model, "bfloat16", 16).block_bytes() * (8192 // 16)
    budget = 3 * sequence + sequence // 2
    got = {d: capacity_case(str(model), d, budget, args) for d in ("bfloat16", "int8", "fp8_e4m3")}
    for case in got.values():
        assert case["admitted_at_once"] == case["planned_sequences"], case
    assert got["bfloat16"]["admitted_at_once"] == 3
    assert got["int8"]["admitted_at_once"] >= 1.9 * 3 and got["fp8_e4m3"]["admitted_at_once"] >= 1.9 * 3


# ---- hashes, routing, configuration ---------------------------------------------------------
def test_kv_dtypes_never_share_blocks_or_predictions(model_dir):
    """One document served by an int8 group and an auto group over one index: each group's
    blocks are found by its own hashes only, and fp8 is fp8_e4m3 under either name."""
    index = InMemoryPrefixIndex()
    opts = dict(num_blocks=32, max_model_len=128, cluster_secret="s")
    groups = {
        d: LocalGroup(engine_config(str(model_dir), kv_cache_dtype=d, **opts), index, group_id=d)
        for d in ("auto", "int8")
    }
    doc = prompts_of([48], seed=4)[0]
    try:
        for g in groups.values():
            asyncio.run(_finish(g, doc))
        chains = {d: g.hasher.hash_prompt(doc) for d, g in groups.items()}
        assert set(chains["auto"]).isdisjoint(chains["int8"])
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(index.match(c)[d].blocks for d, c in chains.items()):
            time.sleep(0.02)
        for d, chain in chains.items():
            held = {g: m.blocks for g, m in index.match(chain).items()}
            assert held == {d: len(chain), ({"auto", "int8"} - {d}).pop(): 0}, held
    finally:
        for g in groups.values():
            g.shutdown()
    roots = {
        d: LLM(str(model_dir), dtype="float32", kv_cache_dtype=d, **opts).engine.hasher.root()
        for d in ("fp8", "fp8_e4m3", "int8")
    }
    assert roots["fp8"] == roots["fp8_e4m3"] != roots["int8"]


async def _finish(group, prompt):
    async for out in group.generate(GenerationRequest(prompt, SamplingParams(max_tokens=2))):
        last = out
    return last


def test_unsupported_kv_cache_dtype_is_refused_naming_the_field(model_dir):
    for bad in ("fp8_e5m2", "int4", ""):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
            LLM(str(model_dir), dtype="float32", kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="float8")
    assert (
        LLM(str(model_dir), dtype="float32", kv_cache_dtype="fp8", num_blocks=16, max_model_len=64).engine.layout.dtype
        == FP8_E4M3
    )


def test_tensor_parallel_8bit_caches_equal_tp1(ray_runtime, model_dir):
    """int8's scales shard with their heads and float8's are the group's, so TP=2 gives the
    TP=1 engine's tokens (and transformers' over the same 8-bit K/V), with each device holding
    half the KV bytes per token, as the planner says."""
    prompts = [d + q for d in prompts_of([30, 25], seed=5) for q in prompts_of([9, 14], seed=6)]
    with concurrent.futures.ThreadPoolExecutor(len(DTYPES)) as pool:
        starting = {
            d: pool.submit(LLM, str(model_dir), tensor_parallel_size=2, dtype="float32", kv_cache_dtype=d, **TIGHT)
            for d in DTYPES
        }
        want = {}
        for d in DTYPES:  # meanwhile, TP=1 here
            tp1 = LLM(str(model_dir), dtype="float32", kv_cache_dtype=d, **TIGHT)
            want[d] = [o.token_ids for o in tp1.generate(prompts, GREEDY)]
            assert want[d] == transformers_greedy(quantized_reference(model_dir, tp1), prompts, 12)
        groups = {d: f.result() for d, f in starting.items()}
    try:
        for d, llm in groups.items():
            assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want[d], d
            shape = KVShape.from_hf_config(model_dir, kv_dtype=d, block_size=TIGHT["block_size"])
            assert [r["kv_bytes_per_token"] for r in llm.group.ranks] == [shape.bytes_per_token(2)] * 2
    finally:
        for llm in groups.values():
            llm.shutdown()
