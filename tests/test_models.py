"""Llama-family models, parallel layers and loader against Hugging Face transformers.

The reference is transformers' own implementation on the same random-weight checkpoint; our
model runs every prompt of a batch as one flat batch over a paged pool with scrambled block
tables, and under tensor parallelism with one thread per rank.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kernels.registry import get_backend
from worker.model.attention_metadata import AttentionMetadata
from worker.model.builtin_model import builtin_model_path, make_model_dir
from worker.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from worker.model.model_loader import load_model
from worker.model.parallel import Collectives

TOL = 1e-3
PROMPT_LENS = (5, 17, 33)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # small, so our prompt positions are scaled
}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}
CASES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2-qkv-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {"head_dim": 16}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-mqa": ("llama", {"num_key_value_heads": 1}),
    "llama-llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "qwen2-yarn-rope": ("qwen2", {"rope_parameters": YARN_ROPE}),
    "llama-all-biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
}


# ---------------------------------------------------------------- paged pool and steps


class Pool:
    """A small per-layer paged KV pool with block tables drawn from a shuffled free list."""

    def __init__(self, model, block_size: int, num_blocks: int = 96, seed: int = 0):
        self.block_size = block_size
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=g).tolist()  # not identity-mapped
        self.tables: dict[int, list[int]] = {}
        for layer in model.attention_layers():
            shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
            layer.bind_kv_cache(torch.full(shape, float("nan")), torch.full(shape, float("nan")))

    def table(self, seq: int, num_tokens: int) -> list[int]:
        blocks = self.tables.setdefault(seq, [])
        while len(blocks) * self.block_size < num_tokens:
            blocks.append(self.free.pop())
        return blocks


def run_step(model, pool: Pool, chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
    """chunks: (seq id, new tokens, number already cached) -> logits (T, vocab)."""
    ids, positions, slots, tables, starts, seq_lens = [], [], [], [], [0], []
    for seq, tokens, cached in chunks:
        table = pool.table(seq, cached + len(tokens))
        pos = list(range(cached, cached + len(tokens)))
        ids += tokens
        positions += pos
        slots += [table[p // pool.block_size] * pool.block_size + p % pool.block_size for p in pos]
        tables.append(table)
        starts.append(starts[-1] + len(tokens))
        seq_lens.append(cached + len(tokens))
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        max_query_len=max(len(c[1]) for c in chunks),
        max_seq_len=max(seq_lens),
    )
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.tensor(positions), meta)
        return model.compute_logits(hidden)


def make_prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def reference_logits(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return [ref(torch.tensor([p])).logits[0] for p in prompts]


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"max |ours - transformers| = {diff:.2e}"


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    model_dir = make_model_dir(tmp_path_factory.mktemp(request.param), arch=arch, seed=3, **overrides)
    prompts = make_prompts(256)
    return model_dir, prompts, reference_logits(model_dir, prompts)


# ---------------------------------------------------------------- model vs transformers


@pytest.mark.parametrize("block_size", [16, 1])
def test_flat_batch_matches_transformers(case, block_size):
    model_dir, prompts, ref = case
    model, _ = load_model(model_dir, dtype=torch.float32, attention_backend=get_backend("torch"))
    pool = Pool(model, block_size, num_blocks=96 if block_size == 1 else 12)
    logits = run_step(model, pool, [(s, p, 0) for s, p in enumerate(prompts)])
    for s, rows in enumerate(logits.split(PROMPT_LENS)):
        assert_close(rows, ref[s])


def test_chunked_prefill_reuses_the_pool(case):
    model_dir, prompts, ref = case
    model, _ = load_model(model_dir, dtype=torch.float32)
    pool = Pool(model, block_size=4, num_blocks=32)
    prompt = prompts[2]
    first = run_step(model, pool, [(0, prompt[:10], 0)])
    rest = run_step(model, pool, [(0, prompt[10:], 10)])  # reads the first chunk's KV
    assert_close(torch.cat([first, rest]), ref[2])


def test_decode_steps_mixed_with_prefill(tmp_path):
    model_dir = make_model_dir(tmp_path, arch="llama", seed=5)
    prompts = make_prompts(256, lens=(6, 9))
    ref = reference_logits(model_dir, prompts)
    model, _ = load_model(model_dir, dtype=torch.float32)
    pool = Pool(model, block_size=4, num_blocks=16)
    first = run_step(model, pool, [(0, prompts[0][:5], 0)])
    # seq 0 decodes its 6th token while seq 1 prefills whole, in one step
    mixed = run_step(model, pool, [(0, prompts[0][5:], 5), (1, prompts[1], 0)])
    assert_close(torch.cat([first, mixed[:1]]), ref[0])
    assert_close(mixed[1:], ref[1])


# ---------------------------------------------------------------- tensor parallelism


class Partial(Collectives):
    """One rank's view with no communication: the test combines partial results itself."""

    def __init__(self, rank: int, world_size: int):
        self._rank, self._world = rank, world_size

    rank = property(lambda self: self._rank)
    world_size = property(lambda self: self._world)

    def all_reduce(self, t):
        return t

    def all_gather(self, t, dim):
        return t

    def broadcast(self, t, src):
        return t


def _ranks(cls, *args, tp=2, **kwargs):
    return [cls(*args, comm=Partial(r, tp), **kwargs) for r in range(tp)]


def test_column_and_merged_linear_shards_concatenate_to_the_full_layer():
    x, w, b = torch.randn(3, 8), torch.randn(6, 8), torch.randn(6)
    parts = []
    for layer in _ranks(ColumnParallelLinear, 8, 6, bias=True):
        layer.weight_loader(layer.weight, w)
        layer.weight_loader(layer.bias, b)
        parts.append(layer(x))
    torch.testing.assert_close(torch.cat(parts, -1), x @ w.T + b)

    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    outs = []
    for layer in _ranks(MergedColumnParallelLinear, 8, [4, 4]):
        layer.weight_loader(layer.weight, gate, 0)
        layer.weight_loader(layer.weight, up, 1)
        outs.append(layer(x).chunk(2, -1))  # this rank's (gate part, up part)
    torch.testing.assert_close(torch.cat([g for g, _ in outs], -1), x @ gate.T)
    torch.testing.assert_close(torch.cat([u for _, u in outs], -1), x @ up.T)


def test_row_linear_partial_sums_add_up_to_the_full_layer():
    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    total = torch.zeros(3, 5)
    for r, layer in enumerate(_ranks(RowParallelLinear, 8, 5, bias=True)):
        layer.weight_loader(layer.weight, w)
        layer.weight_loader(layer.bias, b)
        total += layer(x[:, r * 4 : (r + 1) * 4]) - b  # each rank adds the bias after its sum
    torch.testing.assert_close(total + b, x @ w.T + b)


@pytest.mark.parametrize("num_kv_heads,tp", [(2, 2), (1, 2), (2, 4)])
def test_qkv_shards_keep_each_query_head_with_its_kv_head(num_kv_heads, tp):
    heads, d, hidden = 4, 3, 8
    x = torch.randn(2, hidden)
    wq, wk, wv = (torch.randn(n * d, hidden) for n in (heads, num_kv_heads, num_kv_heads))
    q_full = (x @ wq.T).view(2, heads, d)
    k_full, v_full = (x @ wk.T).view(2, num_kv_heads, d), (x @ wv.T).view(2, num_kv_heads, d)
    group = heads // num_kv_heads
    for r, layer in enumerate(_ranks(QKVParallelLinear, hidden, d, heads, num_kv_heads, tp=tp)):
        for shard, w in (("q", wq), ("k", wk), ("v", wv)):
            layer.weight_loader(layer.weight, w, shard)
        q, k, v = layer.split(layer(x))
        local_heads = range(r * heads // tp, (r + 1) * heads // tp)
        torch.testing.assert_close(q, q_full[:, list(local_heads)])
        for i, h in enumerate(local_heads):  # GQA: local head i reads local kv i // local group
            kv = i // (layer.num_heads_local // layer.num_kv_heads_local)
            torch.testing.assert_close(k[:, kv], k_full[:, h // group])
            torch.testing.assert_close(v[:, kv], v_full[:, h // group])


def test_qkv_rejects_tp_that_is_not_a_multiple_of_kv_heads():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        QKVParallelLinear(8, 4, 6, 2, comm=Partial(0, 3))


def test_vocab_parallel_embedding_and_lm_head_with_padded_vocab():
    vocab, hidden, tp = 11, 4, 3  # 11 rows over 3 ranks: 4 + 4 + 3 real rows, one padding row
    w, ids, h = torch.randn(vocab, hidden), torch.randint(0, vocab, (7,)), torch.randn(2, hidden)
    emb, logits = torch.zeros(7, hidden), []
    for emb_r, head_r in zip(
        _ranks(VocabParallelEmbedding, vocab, hidden, tp=tp),
        _ranks(ParallelLMHead, vocab, hidden, tp=tp),
        strict=True,
    ):
        emb_r.weight_loader(emb_r.weight, w)
        head_r.weight_loader(head_r.weight, w)
        emb += emb_r(ids)  # the all-reduce, by hand
        logits.append(torch.nn.functional.linear(h, head_r.weight))
    torch.testing.assert_close(emb, w[ids])
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], h @ w.T)


class ThreadRank(Collectives):
    """In-process group: one thread per rank, collectives through shared slots and a barrier."""

    def __init__(self, rank: int, shared: dict):
        self._rank, self.shared = rank, shared

    rank = property(lambda self: self._rank)
    world_size = property(lambda self: len(self.shared["slots"]))

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.shared["slots"][self._rank] = t
        self.shared["barrier"].wait()
        values = list(self.shared["slots"])
        self.shared["barrier"].wait()  # nobody overwrites a slot before everyone has read it
        return values

    def all_reduce(self, t):
        return torch.stack(self._exchange(t)).sum(0)

    def all_gather(self, t, dim):
        return torch.cat(self._exchange(t), dim)

    def broadcast(self, t, src):
        return self._exchange(t)[src]


def run_ranks(tp: int, rank_main) -> list:
    """`rank_main(collectives)` on `tp` threads, one per rank of a ThreadRank group; their
    results in rank order. A rank that fails aborts the others' collectives and fails the test."""
    shared = {"slots": [None] * tp, "barrier": threading.Barrier(tp, timeout=60)}
    results, errors = [None] * tp, []

    def run(r: int) -> None:
        try:
            results[r] = rank_main(ThreadRank(r, shared))
        except BaseException as e:  # surfaced below
            errors.append(e)
            shared["barrier"].abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


@pytest.mark.parametrize("tp,kv_heads", [(2, 2), (4, 2)])  # split KV heads; replicated KV heads
def test_tensor_parallel_model_matches_transformers(tmp_path, tp, kv_heads):
    # vocab 250 does not divide by tp: the vocab layers pad
    model_dir = make_model_dir(tmp_path, "qwen2", seed=7, vocab_size=250, num_key_value_heads=kv_heads)
    prompts = make_prompts(250, lens=(7, 12))
    ref = reference_logits(model_dir, prompts)

    def rank_main(comm: ThreadRank) -> torch.Tensor:
        model, _ = load_model(model_dir, dtype=torch.float32, collectives=comm)
        pool = Pool(model, block_size=4, num_blocks=16, seed=1)  # same tables on every rank
        return run_step(model, pool, [(s, p, 0) for s, p in enumerate(prompts)])

    for logits in run_ranks(tp, rank_main):
        for s, rows in enumerate(logits.split((7, 12))):
            assert_close(rows, ref[s])


# ---------------------------------------------------------------- loader and config


def test_unsupported_architecture_is_named(tmp_path):
    model_dir = make_model_dir(tmp_path, "llama")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*Qwen3ForCausalLM"):
        load_model(model_dir)


def test_missing_weights_fail_loudly(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = make_model_dir(tmp_path, "llama")
    weights = load_file(model_dir / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    weights["model.layers.0.extra.weight"] = torch.zeros(1)
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"qkv_proj.weight\[k\].*extra.weight"):
        load_model(model_dir)


def test_config_reads_the_checkpoint(tmp_path):
    model_dir = make_model_dir(tmp_path / "m", "mistral", sliding_window=512, eos_token_id=[2, 7])
    _, cfg = load_model(model_dir, dtype="bfloat16")
    assert cfg.architecture == "MistralForCausalLM"
    assert cfg.max_position_embeddings == 512  # capped at the sliding window
    assert cfg.eos_token_ids == (2, 7) and cfg.model_id and len(cfg.revision) == 16
    other = make_model_dir(tmp_path / "n", "mistral", seed=1, sliding_window=512, eos_token_id=[2, 7])
    assert load_model(other)[1].revision == cfg.revision  # same layout, same revision
    with pytest.raises(AttributeError):
        cfg.vocab_size = 1  # frozen


def test_attention_without_a_bound_cache_is_a_clear_error(tmp_path):
    model, _ = load_model(make_model_dir(tmp_path, "llama"))
    with pytest.raises(RuntimeError, match="bind_kv_cache"):
        run_step(model, type("NoPool", (), {"block_size": 4, "table": lambda *_: [0]})(), [(0, [1], 0)])


# ---------------------------------------------------------------- built-in model


def _weights_hash(model_dir: Path) -> str:
    return hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()


def test_make_model_dir_is_deterministic(tmp_path):
    a = make_model_dir(tmp_path / "a", "qwen3", seed=11, head_dim=16)
    b = make_model_dir(tmp_path / "b", "qwen3", seed=11, head_dim=16)
    c = make_model_dir(tmp_path / "c", "qwen3", seed=12, head_dim=16)
    assert _weights_hash(a) == _weights_hash(b) != _weights_hash(c)


def test_builtin_model_tokenizer_and_greedy_choices(tmp_path):
    path = builtin_model_path(cache_dir=tmp_path)
    assert builtin_model_path(cache_dir=tmp_path) == path  # built once
    tok = AutoTokenizer.from_pretrained(path)
    text = "The library opens at nine. Zebras? 42 — café"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<s>user\nhi</s>\n<s>assistant\n"
    model, cfg = load_model(path)
    assert cfg.vocab_size == len(tok) and cfg.eos_token_ids == (tok.eos_token_id,)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok.encode("Please summarise the document", return_tensors="pt")
    with torch.no_grad():
        out = ref.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
        top2 = ref(out).logits[0].topk(2).values
    new = out[0, ids.shape[1] :].tolist()
    assert len(set(new)) >= 12, f"greedy output is repetitive: {new}"
    gaps = top2[:, 0] - top2[:, 1]  # margin of each greedy choice
    assert gaps.median() > 0.5 and gaps.min() > 1e-3, f"greedy choices are nearly tied: {gaps}"
    assert model.config == cfg


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_norm_and_rotary_round_as_transformers_bit_for_bit(dtype):
    """The decoder's RMSNorm and rotary embedding, each a few fused ops, give transformers'
    own results exactly in every dtype (the same roundings, not merely close ones)."""
    from transformers.models.llama.modeling_llama import (
        LlamaConfig,
        LlamaRMSNorm,
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    from worker.model.layers.norm import RMSNorm
    from worker.model.layers.rotary import RotaryEmbedding, apply_rotary

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 96, generator=g) * 3).to(dtype)
    ours, theirs = RMSNorm(96, 1e-5), LlamaRMSNorm(96, eps=1e-5)
    ours.weight.data = theirs.weight.data = torch.randn(96, generator=g)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    assert torch.equal(ours(x), theirs(x))

    hf = LlamaConfig(hidden_size=96, num_attention_heads=3, num_key_value_heads=1, rope_theta=10000.0)
    positions = torch.tensor([0, 3, 4, 100, 1000, 5, 9])
    q = torch.randn(7, 3, 32, generator=g).to(dtype)  # (T, heads, d)
    k = torch.randn(7, 1, 32, generator=g).to(dtype)
    cos, sin = RotaryEmbedding(hf, 32).rotation(positions, dtype)
    ref_cos, ref_sin = (t.to(dtype) for t in LlamaRotaryEmbedding(hf)(q, positions[None]))
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], ref_cos, ref_sin)
    assert torch.equal(apply_rotary(q, cos, sin), want_q[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, cos, sin), want_k[0].transpose(0, 1))
