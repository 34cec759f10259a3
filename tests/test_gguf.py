"""GGUF files against transformers reading the same file (float32, greedy).

The files are written here (tests/gguf_files.py) from tiny random models, in every supported
quantization type. transformers loads each with `from_pretrained(dir, gguf_file=...)`: it
dequantizes with the same `gguf` package, but maps the names, undoes llama.cpp's q/k row
permutation and builds the config on its own. Also: a TP=2 Ray group on a quantized file whose
row-parallel split falls inside quantization blocks, what each rank reads, the tokenizer and chat
template from the metadata, the capacity planner on the file, and what is refused.
"""

from __future__ import annotations

import dataclasses
import json
import random

import gguf
import pytest
import torch
from factories import transformers_greedy
from gguf_files import load_transformers, write_gguf
from test_models import Pool, run_ranks, run_step

from cluster.planner import KVShape
from pagefleet.cli import main
from pagefleet.llm import LLM
from worker.engine.llm_engine import load_tokenizer
from worker.model.builtin_model import make_model_dir, train_builtin_tokenizer
from worker.model.gguf_loader import SUPPORTED_ARCHITECTURES, SUPPORTED_TYPES, load_gguf_weights
from worker.model.model_loader import read_model_config
from worker.model.models import MODEL_REGISTRY
from worker.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
OPTIONS = dict(num_blocks=64, block_size=16, max_model_len=256, dtype="float32", weight_dtype="float")
# intermediate 160 = 5 quantization blocks of 32: at TP=2 each rank's 80 columns of down_proj
# begin or end inside a block
LLAMA = dict(arch="llama", intermediate_size=160, initializer_range=0.1)


def prompts_of(lengths, seed, vocab=256):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def hf_greedy(path, prompts, n):
    return transformers_greedy(load_transformers(path), prompts, n)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("llama"), seed=2, output_scale=8.0, **LLAMA)


def tensor_types(path) -> set[str]:
    return {gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_every_quantization_type_equals_transformers(qtype, llama_dir, tmp_path):
    path = write_gguf(llama_dir, tmp_path / f"llama-{qtype}.gguf", qtype)
    assert qtype in tensor_types(path)  # the file really holds the type under test
    prompts = prompts_of([3, 17, 40], seed=len(qtype))
    ours = [o.token_ids for o in LLM(str(path), **OPTIONS).generate(prompts, GREEDY)]
    want = hf_greedy(path, prompts, GREEDY.max_tokens)
    assert ours == want
    assert len({tuple(t) for t in want}) > 1 and any(len(set(t)) > 2 for t in want)


@pytest.mark.parametrize(
    "spec",
    [
        dict(arch="qwen2"),  # q/k/v bias
        dict(arch="qwen3", head_dim=128),  # q/k norm (transformers reads Qwen3's head_dim as 128)
        dict(arch="llama", tie_word_embeddings=True, num_key_value_heads=1),  # tied, MQA
    ],
    ids=["qwen2", "qwen3", "llama-tied-mqa"],
)
def test_architectures_equal_transformers(spec, tmp_path):
    model_dir = make_model_dir(tmp_path / "model", seed=3, output_scale=8.0, initializer_range=0.1, **spec)
    path = write_gguf(model_dir, tmp_path / "model.gguf", "Q8_0")
    prompts = prompts_of([5, 33], seed=4)
    ours = [o.token_ids for o in LLM(str(path), **OPTIONS).generate(prompts, GREEDY)]
    assert ours == hf_greedy(path, prompts, GREEDY.max_tokens)


def test_tensor_parallel_ranks_read_only_their_slices_and_match_transformers(llama_dir, tmp_path):
    """TP=2 in this process (a thread per rank, test_models.ThreadRank): each rank reads about
    half of every sharded tensor, and the ranks' logits equal transformers' on the file."""
    path = write_gguf(llama_dir, tmp_path / "llama.gguf", "Q4_0")
    config = read_model_config(path)
    reader = gguf.GGUFReader(path)
    total = sum(int(t.n_bytes) for t in reader.tensors)
    norms = sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) == 1)
    prompts = prompts_of([7, 12], seed=6)
    with torch.no_grad():
        hf = load_transformers(path)
        want = [hf(torch.tensor([p])).logits[0] for p in prompts]

    def rank_main(comm) -> tuple[int, torch.Tensor]:
        model = MODEL_REGISTRY[config.architecture](config, comm)
        read = load_gguf_weights(model, path, config)
        pool = Pool(model, block_size=4, num_blocks=16, seed=1)  # same tables on every rank
        return read, run_step(model, pool, [(s, p, 0) for s, p in enumerate(prompts)])

    for read, logits in run_ranks(2, rank_main):
        # half of each sharded tensor (down_proj: plus the block it shares with the other
        # rank), and every norm
        assert read < (total - norms) * 0.55 + norms, (read, total)
        for rows, ref in zip(logits.split([len(p) for p in prompts]), want, strict=True):
            torch.testing.assert_close(rows, ref, atol=1e-3, rtol=0)
    one = MODEL_REGISTRY[config.architecture](config)
    assert load_gguf_weights(one, path, config) == total  # one rank reads every tensor once


def test_tensor_parallel_ray_group_equals_transformers(ray_runtime, llama_dir, tmp_path):
    path = write_gguf(llama_dir, tmp_path / "llama-tp.gguf", "Q4_1")
    prompts = prompts_of([6, 21, 37], seed=9)
    llm = LLM(str(path), tensor_parallel_size=2, **OPTIONS)
    try:
        ours = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.shutdown()
    assert ours == hf_greedy(path, prompts, GREEDY.max_tokens)


def test_tokenizer_and_chat_template_come_from_the_metadata(tmp_path):
    tokenizer = train_builtin_tokenizer()
    model_dir = make_model_dir(
        tmp_path / "model",
        seed=5,
        output_scale=8.0,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    path = write_gguf(model_dir, tmp_path / "chat.gguf", "Q8_0", tokenizer=tokenizer)
    loaded = load_tokenizer(str(path))
    assert loaded is not load_tokenizer(str(path))  # a copy per caller: never shared
    text = "The river runs past the old mill, under the stone bridge."
    assert loaded.encode(text) == tokenizer.encode(text)
    messages = [{"role": "user", "content": "Who built the bridge?"}]
    render = dict(add_generation_prompt=True, tokenize=False)
    assert loaded.apply_chat_template(messages, **render) == tokenizer.apply_chat_template(messages, **render)
    assert read_model_config(path).eos_token_ids == (tokenizer.eos_token_id,)
    out = LLM(str(path), **OPTIONS).chat(messages, SamplingParams(temperature=0, max_tokens=4))
    assert out[0].prompt_token_ids == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_identity_and_plan_read_the_file(llama_dir, tmp_path, capsys):
    q8 = write_gguf(llama_dir, tmp_path / "llama-Q8_0.gguf", "Q8_0")
    q4 = write_gguf(llama_dir, tmp_path / "llama-Q4_0.gguf", "Q4_0")
    a, b = read_model_config(q8), read_model_config(q4)
    assert a.model_id == "llama-Q8_0.gguf" and a.revision != b.revision  # blocks never mix
    assert main(["plan", "--model", str(q8), "--lengths", "64", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    shape = KVShape.from_hf_config(llama_dir, "float32")  # the engine runs GGUF in float32
    assert planned["shape"] == dataclasses.asdict(shape)
    assert planned["bytes_per_token"] == LLM(str(q8), **OPTIONS).stats()["kv_bytes_per_token"]


def test_unsupported_types_and_architectures_are_refused_by_name(llama_dir, tmp_path, capsys):
    f64 = write_gguf(llama_dir, tmp_path / "f64.gguf", "Q8_0", types={"output_norm.weight": "F64"})
    with pytest.raises(ValueError) as err:
        LLM(str(f64), **OPTIONS)
    assert "F64 (output_norm.weight)" in str(err.value)
    assert f"supported: {', '.join(SUPPORTED_TYPES)}" in str(err.value)
    gemma = write_gguf(llama_dir, tmp_path / "gemma.gguf", "Q8_0", arch="gemma2")
    assert main(["plan", "--model", str(gemma), "--lengths", "64"]) == 2
    message = capsys.readouterr().err
    assert "GGUF architecture 'gemma2'" in message and "Traceback" not in message
    assert f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}" in message
    with pytest.raises(ValueError, match=r"neither a directory .* nor a \.gguf file"):
        LLM(str(tmp_path / "missing.gguf"))
