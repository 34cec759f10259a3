"""The engine on the Triton kernels (through the interpreter on CPU) against transformers."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from transformers import AutoModelForCausalLM  # noqa: E402

from pagefleet.llm import LLM  # noqa: E402
from worker.model.builtin_model import make_model_dir  # noqa: E402
from worker.sampling_params import SamplingParams  # noqa: E402


def test_triton_backend_greedy_equals_transformers(tmp_path):
    model_dir = make_model_dir(tmp_path, arch="llama", seed=2, output_scale=8.0, num_key_value_heads=1)
    prompts = [[5, 9, 17, 33, 2 + i, 41, 7] for i in range(2)] + [[11, 12, 13]]
    params = SamplingParams(temperature=0.0, max_tokens=5)
    llm = LLM(str(model_dir), attention_backend="triton", num_blocks=16, block_size=16, max_model_len=64)
    ours = [o.token_ids for o in llm.generate(prompts, params)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    want = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=5,
            do_sample=False,
            pad_token_id=0,
        )
        want.append(gen[0, len(p) :].tolist())
    assert ours == want
    assert llm.stats()["blocks_free"] == llm.stats()["blocks_total"]
