"""benchmarks/flops.py: the model FLOPs the engine benchmark holds each system to."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from benchmarks.flops import ModelFlops, StepClock, matmul_peak
from pagefleet.llm import LLM
from worker.model.builtin_model import make_model_dir
from worker.model.model_loader import read_model_config
from worker.sampling_params import SamplingParams


def test_counts_equal_torchs_flop_counter_on_transformers(tmp_path):
    """torch's FlopCounterMode over transformers' eager forward (which computes every query
    against every key, masked after) counts the linear layers, the LM head of the last row
    and n x n attention; ours counts the causal n (n + 1) / 2 and agrees on the rest."""
    model_dir = make_model_dir(tmp_path, seed=1, num_key_value_heads=2)
    flops = ModelFlops.of(read_model_config(model_dir))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    n = 40
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        hf(torch.arange(3, 3 + n)[None], logits_to_keep=1)
    masked_keys = n * n - n * (n + 1) // 2  # computed by eager attention, then masked
    assert counter.get_total_flops() == (flops.positions(0, n) + flops.lm_head + flops.attention_per_key * masked_keys)


def test_engine_steps_add_up_to_the_requests_flops(tmp_path):
    """The step clock counts what each step computed; over a run without preemption that is
    each request's count, cached prefix excluded; the first, all-prompt step is a prefill."""
    model_dir = make_model_dir(tmp_path, seed=1)
    flops = ModelFlops.of(read_model_config(model_dir))
    llm = LLM(str(model_dir), num_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    prompts = [list(range(3, 73)), list(range(3, 53)) + [9, 9]]  # shares 3 blocks of 16
    clock = StepClock(flops)
    clock.wrap(llm.engine.executor)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = [llm.generate([p], params)[0] for p in prompts]  # one after the other: a prefix hit
    assert [o.num_cached_tokens for o in outs] == [0, 48]
    want = sum(flops.request(len(p), 6, o.num_cached_tokens) for p, o in zip(prompts, outs, strict=True))
    assert sum(work for _, work, _ in clock.steps) == want
    prefill = clock.prefill_figures()
    # 32 + 32 + 6 tokens of the first prompt, then the second's 4 uncached ones
    assert prefill["prefill_steps"] == 4 and prefill["prefill_gflop_s"] > 0


def test_matmul_peak_measures_the_models_shapes():
    flops = ModelFlops(linear_params=0, attention_per_key=0, lm_head=0, linear_shapes=((64, 96),))
    peak = matmul_peak(flops, 128, torch.float32, "cpu", seconds=0.05)
    assert peak["tokens"] == 128 and peak["rounds"] >= 3 and peak["gflop_s"] > 0
