"""The engine against Hugging Face transformers on the same weights (float32, greedy).

Test models are tiny random-weight checkpoints written by transformers' own config classes and
`save_pretrained` (worker/model/builtin_model.make_model_dir). Random weights give flat logits,
so the checkpoints carry an output scale of 8 on the final norm (every logit x 8): greedy choices are
then separated by whole nats instead of hundredths and do not flip on rounding; tied models also
get a larger initializer range so that they do not just repeat their last input token.
"""

from __future__ import annotations

import random
from array import array

import numpy as np
import pytest
import torch
from factories import transformers_greedy
from transformers import AutoModelForCausalLM

from pagefleet.llm import LLM
from worker.model.builtin_model import make_model_dir
from worker.sampling_params import SamplingParams

ARCHS = {
    "llama": dict(arch="llama"),
    "mistral": dict(arch="mistral"),
    "qwen2": dict(arch="qwen2"),  # q/k/v bias
    "qwen3": dict(arch="qwen3", head_dim=16),  # q/k norm
    "llama-tied-mqa": dict(arch="llama", tie_word_embeddings=True, num_key_value_heads=1),
    "llama3-rope": dict(
        arch="llama",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)  # both sides stop at EOS


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for name, spec in ARCHS.items():
        spec = dict(spec)
        dirs[name] = make_model_dir(tmp_path_factory.mktemp(name), seed=1, output_scale=8.0, **spec)
    return dirs


@pytest.fixture(scope="module")
def hf_models(model_dirs):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = AutoModelForCausalLM.from_pretrained(model_dirs[name], dtype=torch.float32).eval()
        return cache[name]

    return get


def prompts_of(lengths, seed=0, vocab=256):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def make_llm(model_dir, **options):
    options.setdefault("max_model_len", 256)
    options.setdefault("dtype", "float32")  # like with like: the reference runs in float32
    return LLM(str(model_dir), **options)


def assert_no_leaks(llm):
    s = llm.stats()
    assert s["blocks_free"] == s["blocks_total"], s
    assert s["running"] == s["waiting"] == 0


@pytest.mark.parametrize("name", list(ARCHS))
def test_greedy_equals_transformers(name, model_dirs, hf_models):
    prompts = prompts_of([3, 17, 40, 64], seed=sorted(ARCHS).index(name))
    llm = make_llm(model_dirs[name], num_blocks=64, block_size=16)
    ours = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    want = transformers_greedy(hf_models(name), prompts, GREEDY.max_tokens)
    assert ours == want
    assert len({tuple(t) for t in want}) > 1 and any(len(set(t)) > 2 for t in want)  # varied, not degenerate
    assert_no_leaks(llm)


def test_repetition_penalty_in_a_batch_equals_transformers(model_dirs, hf_models):
    """Penalised rows read the output so far at every step: the batch decodes together (its
    sampling rows kept from step to step while it continues) and each request still gets what
    transformers' generate gives it alone with the same penalty. (On this model a row that saw
    only its first tokens would pick differently.)"""
    prompts = prompts_of([5, 12, 30, 47], seed=3)
    name, n = "llama-tied-mqa", 16
    llm = make_llm(model_dirs[name], num_blocks=64, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=n, repetition_penalty=1.5)
    ours = [o.token_ids for o in llm.generate(prompts, params)]
    want = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = hf_models(name).generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                do_sample=False,
                repetition_penalty=1.5,
                pad_token_id=0,
            )
        want.append(gen[0, len(p) :].tolist())
    assert ours == want
    plain = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert plain != [t[: len(q)] for t, q in zip(ours, plain, strict=True)]  # the penalty acts
    assert_no_leaks(llm)


@pytest.mark.parametrize(
    "options",
    [
        dict(block_size=1, num_blocks=512, max_model_len=128),
        dict(block_size=32, num_blocks=16, max_model_len=128),
        dict(block_size=16, num_blocks=64, max_num_batched_tokens=7),  # prefill chunks of 7
    ],
    ids=["block1", "block32", "chunk7"],
)
def test_block_sizes_and_tiny_chunks(options, model_dirs, hf_models):
    prompts = prompts_of([5, 33, 50], seed=3)
    llm = make_llm(model_dirs["llama"], **options)
    ours = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert ours == transformers_greedy(hf_models("llama"), prompts, GREEDY.max_tokens)
    assert_no_leaks(llm)


def test_prefix_hits_same_documents_asked_twice(model_dirs, hf_models):
    docs = prompts_of([48, 37], seed=5)
    questions = prompts_of([4, 6, 9], seed=6)
    prompts = [d + q for d in docs for q in questions]
    llm = make_llm(model_dirs["qwen2"], num_blocks=64, block_size=16)
    want = transformers_greedy(hf_models("qwen2"), prompts, GREEDY.max_tokens)
    first = llm.generate(prompts, GREEDY)
    second = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in first] == want
    assert [o.token_ids for o in second] == want
    # the second round is served from the cache: every full block of each prompt but the last token's
    for o, p in zip(second, prompts, strict=True):
        assert o.num_cached_tokens == (len(p) - 1) // 16 * 16 > 0
    s = llm.stats()
    assert s["prefix_cache_hits"] > 0 and s["prefix_cache_hits"] <= s["prefix_cache_queries"]
    assert_no_leaks(llm)


def test_preemption_in_a_tiny_pool_gives_the_same_answers(model_dirs, hf_models):
    prompts = prompts_of([30, 25, 20, 28, 33], seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    # 10 blocks of 8 tokens: one request fits whole (<= 57 tokens), five at once cannot
    llm = LLM(
        str(model_dirs["mistral"]),
        num_blocks=10,
        block_size=8,
        max_model_len=80,
        watermark=0.0,
        dtype="float32",
    )
    ours = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.stats()["preemptions"] > 0
    assert ours == transformers_greedy(hf_models("mistral"), prompts, params.max_tokens)
    assert_no_leaks(llm)


def test_seeded_sampling_is_reproducible_whatever_the_batch(model_dirs):
    llm = make_llm(model_dirs["llama"], num_blocks=64)
    p = prompts_of([12], seed=8)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([p], seeded)[0].token_ids
    others = prompts_of([5, 9, 20], seed=9)
    mixed = llm.generate([*others, p], [SamplingParams(temperature=1.0, max_tokens=16)] * 3 + [seeded])[-1].token_ids
    assert alone == mixed
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True)
    assert llm.generate([p], other_seed)[0].token_ids != alone
    assert_no_leaks(llm)


def test_finish_reasons_stop_tokens_and_logprobs(model_dirs, hf_models):
    p = prompts_of([10], seed=10)[0]
    want = transformers_greedy(hf_models("llama"), [p], 10)[0]
    llm = make_llm(model_dirs["llama"], num_blocks=64)
    stop_at = want[4]
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at], logprobs=3))[0]
    k = want.index(stop_at)
    assert out.token_ids == want[: k + 1] and out.finish_reason == "stop" and out.stop_reason == stop_at
    assert len(out.logprobs) == len(out.token_ids) and len(out.logprobs[0].top) == 3
    assert out.logprobs[0].top[0][0] == out.token_ids[0]  # greedy: the chosen token is the top one
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.metrics.ttft is not None and out.metrics.ttft >= 0
    assert len(out.metrics.inter_token_latencies) == 2


def test_bad_input_raises_value_error_naming_the_field(model_dirs):
    llm = make_llm(model_dirs["llama"], num_blocks=64)
    for kwargs, field in [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_k=-5), "top_k"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 256]], GREEDY)
    with pytest.raises(ValueError, match="token id 256 is outside the vocabulary"):
        llm.generate([np.array([1, 2, 256])], GREEDY)
    with pytest.raises(ValueError, match="token id 256 is outside the vocabulary"):
        llm.generate([array("I", [1, 2, 256])], GREEDY)
    prompts = [[5, 6, 7, 8], np.array([5, 6, 7, 8], np.int32), array("I", [5, 6, 7, 8])]
    as_list, *as_arrays = llm.generate(prompts, GREEDY)
    for out in as_arrays:  # arrays are taken as the same ids, as plain ints
        assert out.prompt_token_ids == [5, 6, 7, 8] and type(out.prompt_token_ids[0]) is int
        assert out.token_ids == as_list.token_ids
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text prompt", GREEDY)
    with pytest.raises(ValueError, match="unknown engine option"):
        make_llm(model_dirs["llama"], num_blokcs=3)
    assert_no_leaks(llm)


def test_pool_that_cannot_hold_one_sequence_is_refused_with_numbers(model_dirs):
    with pytest.raises(ValueError, match=r"has 3 blocks of 16 tokens .* max_model_len=4096 tokens needs 256 blocks"):
        LLM(str(model_dirs["llama"]), num_blocks=3)


def test_pool_agrees_with_the_planner(model_dirs):
    from cluster.planner import KVShape

    budget = 3 << 20
    for name in ("llama", "qwen3", "llama-tied-mqa"):
        llm = LLM(str(model_dirs[name]), kv_cache_memory=budget, max_model_len=1024, dtype="float32")
        shape = KVShape.from_hf_config(model_dirs[name], kv_dtype="float32", block_size=16)
        assert llm.engine.layout.bytes_per_token == shape.bytes_per_token()
        assert llm.stats()["blocks_total"] == shape.num_blocks(budget)
        assert llm.engine.executor.pool_bytes == shape.num_blocks(budget) * shape.block_bytes()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_follows_transformers(dtype, model_dirs):
    """In 16-bit both sides round differently, so we compare greedy tokens only while the
    reference's top two logits are well apart (a near-tie may flip either way)."""
    prompts = prompts_of([9, 30], seed=11)
    llm = make_llm(model_dirs["llama"], num_blocks=32, dtype=dtype)
    ours = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    hf = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=getattr(torch, dtype)).eval()
    for p, got in zip(prompts, ours, strict=True):
        ids = torch.tensor([p + got])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(p) - 1 : -1].float()  # the logits that chose `got`
        top2 = logits.topk(2).values
        for i, tok in enumerate(got):
            if top2[i, 0] - top2[i, 1] < 0.5:
                break  # past a near-tie the sequences may legitimately part
            assert tok == int(logits[i].argmax()), f"token {i} of {dtype} differs"
    assert llm.stats()["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2  # 2 layers, 2 KV heads, dim 16, 2 bytes
    assert_no_leaks(llm)


def test_pool_sized_from_memory_budget(model_dirs):
    from worker.exec.kv_pool import CPU_DEFAULT_KV_MEMORY, device_memory, weights_bytes

    llm = make_llm(model_dirs["llama"], memory_utilization=0.5)
    engine = llm.engine
    budget = min(
        int(device_memory(torch.device("cpu")) * 0.5) - weights_bytes(engine.executor.worker.model),
        CPU_DEFAULT_KV_MEMORY,
    )
    assert llm.stats()["blocks_total"] == budget // engine.layout.block_bytes
    assert engine.executor.pool_bytes == llm.stats()["blocks_total"] * engine.layout.block_bytes


def test_the_cluster_secret_stays_out_of_the_configs_repr():
    from pagefleet.llm import engine_config

    config = engine_config("builtin", cluster_secret="do-not-print-me")
    assert "do-not-print-me" not in repr(config) and config.cluster_secret == "do-not-print-me"
