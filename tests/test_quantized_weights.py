"""Weights kept in int8 / int4 (worker/model/layers/quant.py) against the float path.

The kernels' matmuls equal a float matmul by the weight they hold; an int4 layer loaded from a
Q4_1 GGUF file holds the file's own codes and scales (it equals the file's dequantized
weight); whole models on int8 / int4 weights give logits close to the float model's on the same
file and mostly the same greedy tokens, at TP=1 and TP=2 (each rank quantizes its own shard);
`auto` picks the weight dtype from the file; the weight dtype names blocks.
"""

from __future__ import annotations

import pytest
import torch
from gguf_files import write_gguf
from test_models import Pool, make_prompts, run_ranks, run_step

from pagefleet.cli import build_parser, serve_config
from pagefleet.llm import LLM
from worker.exec.kv_pool import weights_bytes
from worker.model.builtin_model import make_model_dir
from worker.model.dtypes import resolve_weight_dtype
from worker.model.layers.quant import Int4Weight, Int8Weight, QuantizableLayer, QuantizedWeight
from worker.model.model_loader import load_model
from worker.sampling_params import SamplingParams

# hidden 64, intermediate 128: every layer's input features are whole int4 groups of 32, at
# TP=1 and TP=2
LLAMA = dict(arch="llama", intermediate_size=128, initializer_range=0.1)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("llama"), seed=2, output_scale=8.0, **LLAMA)


@pytest.fixture(scope="module")
def files(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {q: write_gguf(llama_dir, root / f"llama-{q}.gguf", q) for q in ("F32", "Q8_0", "Q4_0", "Q4_1")}


def logits_of(path, weight_dtype: str, prompts, comm=None) -> torch.Tensor:
    model, _ = load_model(path, dtype=torch.float32, collectives=comm, weight_dtype=weight_dtype)
    pool = Pool(model, block_size=4, num_blocks=32, seed=1)
    return run_step(model, pool, [(s, p, 0) for s, p in enumerate(prompts)])


def test_the_lm_head_takes_the_cpu_int8_kernel_and_the_other_layers_do_not(files):
    """The vocabulary layers' int8 weight (the LM head's, tied or not) goes through the C++
    kernel on CPU (kernels/cpu_decode.py int8_rows), to float32's rounding of torch's kernel."""
    model, _ = load_model(files["Q8_0"], dtype=torch.float32, weight_dtype="int4")
    head = model.lm_head.quant
    assert isinstance(head, Int8Weight) and head.cpu_rows
    others = [m.quant for m in model.modules() if isinstance(m, QuantizableLayer) and not m.vocab_rows and m.quant]
    assert others and not any(getattr(q, "cpu_rows", False) for q in others)
    x = torch.randn(3, head.qweight.shape[1])
    want = torch.ops.aten._weight_int8pack_mm(x, head.qweight, head.scales)
    torch.testing.assert_close(head.matmul(x), want, atol=1e-5, rtol=1e-5)


def test_kernels_multiply_by_the_weight_they_hold():
    torch.manual_seed(0)
    w, x = torch.randn(48, 96), torch.randn(5, 96)
    for quant in (Int8Weight(torch.float32), Int4Weight(torch.float32)):
        quant.quantize(w)
        held = quant.dequantize()
        torch.testing.assert_close(quant.matmul(x), x @ held.T, atol=1e-4, rtol=1e-4)
        step = (w.abs().amax(1, keepdim=True) / 127) if isinstance(quant, Int8Weight) else None
        if step is not None:  # int8: within half a step of the row's scale
            assert ((held - w).abs() <= step / 2 + 1e-6).all()
        else:  # int4: within half a step of each group's range / 15
            groups = w.reshape(48, 3, 32)
            half = ((groups.amax(-1) - groups.amin(-1)) / 30)[..., None]
            assert ((held - w).reshape(48, 3, 32).abs() <= half + 1e-5).all()
    rows = torch.tensor([0, 7, 7, 47])
    int8 = Int8Weight(torch.float32)
    int8.quantize(w)
    torch.testing.assert_close(int8.rows(rows), int8.dequantize()[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", [Int8Weight, Int4Weight])
def test_a_matmul_of_many_rows_runs_a_dense_gemm_over_the_weight_dequantized(kind, dtype, monkeypatch):
    """From DENSE_ROWS rows (a prefill step) the weight is dequantized for the call and a dense
    GEMM runs, not the quantized kernel; its output is the same product (within the dtype's
    rounding of the weight); fewer rows (decodes) go through the kernel."""
    from worker.model.layers import quant as quant_module

    torch.manual_seed(1)
    w = torch.randn(192, 128) * 0.05
    quant = kind(dtype)
    quant.quantize(w)
    held = quant.dequantize()
    many = torch.randn(quant_module.DENSE_ROWS, 128, dtype=dtype)
    few = many[:7]
    kernel = quant.kernel
    calls = []
    monkeypatch.setattr(quant, "kernel", lambda x: calls.append(x.shape[0]) or kernel(x))
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    with torch.inference_mode():
        torch.testing.assert_close(quant.matmul(many).float(), many.float() @ held.T, **tol)
        assert calls == []  # the dense GEMM
        torch.testing.assert_close(quant.matmul(few).float(), few.float() @ held.T, **tol)
        assert calls == [7]  # the kernel
    dense = quant.dense(dtype).float()
    assert (dense - held).abs().max() <= (1e-6 if dtype == torch.float32 else held.abs().max() / 128)


def test_int4_codes_unpack_from_the_kernels_packing():
    """`unpack_int4` reads this torch's packing back to the codes it was given; a shape whose
    packing it does not know (rows not a multiple of 64) keeps the kernel."""
    from worker.model.layers.quant import _int4_layout_is_tiled, unpack_int4

    codes = torch.randint(0, 16, (320, 96), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(unpack_int4(packed).to(torch.int32), codes)
    assert _int4_layout_is_tiled(320, 96) and not _int4_layout_is_tiled(48, 96)
    small = Int4Weight(torch.float32)
    small.quantize(torch.randn(48, 96))
    assert small.dense(torch.float32) is None


@pytest.mark.parametrize("qtype", ["Q4_1"])
def test_int4_holds_a_q4_files_own_codes_and_scales(files, qtype):
    """Loaded from a 4-bit file, every int4 layer holds exactly the file's weights."""
    ref, _ = load_model(files[qtype], dtype=torch.float32, weight_dtype="float")
    ours, _ = load_model(files[qtype], dtype=torch.float32, weight_dtype="int4")
    float_layers = dict(ref.named_modules())
    checked = 0
    for name, module in ours.named_modules():
        if isinstance(getattr(module, "quant", None), Int4Weight):
            want = float_layers[name].weight
            torch.testing.assert_close(module.quant.dequantize(), want, atol=1e-6 * want.abs().max().item(), rtol=0)
            checked += 1
    assert checked == 2 * 4  # qkv, o, gate_up and down of both layers
    assert "weight" not in dict(ours.named_parameters())  # no float weight is kept


@pytest.mark.parametrize(("qtype", "weight_dtype"), [("Q8_0", "int8"), ("Q4_1", "int4"), ("F32", "int8")])
def test_quantized_model_logits_and_greedy_follow_the_float_model(files, qtype, weight_dtype):
    prompts = make_prompts(256, lens=(9, 30))
    want = logits_of(files[qtype], "float", prompts)
    got = logits_of(files[qtype], weight_dtype, prompts)
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err < 0.05, err  # close, relative to the logits' range
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree
    options = dict(num_blocks=64, max_model_len=256, dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    ref = LLM(str(files[qtype]), weight_dtype="float", **options).generate(prompts, greedy)
    ours = LLM(str(files[qtype]), weight_dtype=weight_dtype, **options).generate(prompts, greedy)
    same = [a == b for o, r in zip(ours, ref, strict=True) for a, b in zip(o.token_ids, r.token_ids, strict=True)]
    assert sum(same) / len(same) >= 0.75, same


def test_tensor_parallel_ranks_quantize_their_own_shards(files):
    """TP=2: each rank quantizes the shard it loaded; with int4 groups inside each shard and
    per-row int8 on vocabulary rows the ranks hold what one rank holds, so logits agree."""
    prompts = make_prompts(256, lens=(7, 12))
    one = logits_of(files["Q4_1"], "int4", prompts)

    def rank_main(comm):
        model, _ = load_model(files["Q4_1"], dtype=torch.float32, collectives=comm, weight_dtype="int4")
        mlp = model.model.layers[0].mlp
        assert isinstance(mlp.down_proj.quant, Int4Weight) and mlp.down_proj.quant.scales_and_zeros.shape[0] == 2
        pool = Pool(model, block_size=4, num_blocks=32, seed=1)
        return run_step(model, pool, [(s, p, 0) for s, p in enumerate(prompts)])

    for logits in run_ranks(2, rank_main):
        torch.testing.assert_close(logits, one, atol=1e-4, rtol=1e-4)


def test_a_shard_the_int4_kernel_cannot_take_falls_back_to_int8(tmp_path):
    """intermediate 160 = 5 groups: at TP=2 each rank's 80 columns of down_proj are not whole
    groups, so that layer is int8 on each rank; the logits still follow the float model."""
    model_dir = make_model_dir(tmp_path / "m", seed=2, output_scale=8.0, **{**LLAMA, "intermediate_size": 160})
    path = write_gguf(model_dir, tmp_path / "m.gguf", "Q4_1")
    prompts = make_prompts(256, lens=(7,))
    want = logits_of(path, "float", prompts)

    def rank_main(comm):
        model, _ = load_model(path, dtype=torch.float32, collectives=comm, weight_dtype="int4")
        assert isinstance(model.model.layers[0].mlp.down_proj.quant, Int8Weight)
        assert isinstance(model.model.layers[0].mlp.gate_up_proj.quant, Int4Weight)
        pool = Pool(model, block_size=4, num_blocks=32, seed=1)
        return run_step(model, pool, [(0, prompts[0], 0)])

    for logits in run_ranks(2, rank_main):
        assert (logits - want).abs().max() < 0.05 * want.abs().max()


def test_auto_follows_the_file_and_the_weight_dtype_names_blocks(files, llama_dir):
    assert resolve_weight_dtype("auto", files["Q4_1"], "cpu") == "int4"
    assert resolve_weight_dtype("auto", files["Q4_0"], "cpu") == "int4"
    assert resolve_weight_dtype("auto", files["Q8_0"], "cpu") == "int8"
    assert resolve_weight_dtype("auto", files["F32"], "cpu") == "float"
    assert resolve_weight_dtype("auto", llama_dir, "cpu") == "float"
    assert resolve_weight_dtype("auto", files["Q4_1"], "cuda") == "float"  # the kernels are CPU ones
    # under float32 activations torch's quantized CPU kernels have no fast path: float weights
    assert resolve_weight_dtype("auto", files["Q4_1"], "cpu", torch.float32) == "float"
    assert resolve_weight_dtype("auto", files["Q8_0"], "cpu", torch.float32) == "float"
    assert resolve_weight_dtype("auto", files["Q4_1"], "cpu", torch.bfloat16) == "int4"
    assert resolve_weight_dtype("int4", files["Q4_1"], "cpu", torch.float32) == "int4"  # (asked for)
    with pytest.raises(ValueError, match="weight_dtype"):
        resolve_weight_dtype("int3", files["Q4_1"], "cpu")
    with pytest.raises(ValueError, match="weight_dtype"):
        LLM(str(files["Q4_1"]), weight_dtype="int3")
    options = dict(num_blocks=16, max_model_len=128, dtype="bfloat16", cluster_secret="s")
    auto = LLM(str(files["Q4_1"]), **options).engine
    flt = LLM(str(files["Q4_1"]), weight_dtype="float", **options).engine
    assert auto.facts().fingerprint.weight_dtype == "int4"
    assert flt.facts().fingerprint.weight_dtype == "float"
    full = LLM(str(files["Q4_1"]), **{**options, "dtype": "float32"}).engine
    assert full.facts().fingerprint.weight_dtype == "float"
    assert not any(isinstance(m, QuantizedWeight) for m in full.executor.worker.model.modules())
    tokens = list(range(3, 40))
    assert auto.hasher.hash_prompt(tokens)[0] != flt.hasher.hash_prompt(tokens)[0]
    int4 = weights_bytes(auto.executor.worker.model)
    assert int4 < 0.45 * weights_bytes(flt.executor.worker.model)  # bfloat16 -> ~4.5 bits + int8 vocab
    assert int4 < 0.3 * weights_bytes(full.executor.worker.model)  # float32 -> the same


def test_serve_takes_weight_dtype_from_the_flag_and_the_config(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("engine:\n  weight_dtype: int8\n")
    parser = build_parser()
    assert serve_config(parser.parse_args(["serve", "--config", str(config)])).engine.options["weight_dtype"] == "int8"
    args = parser.parse_args(["serve", "--config", str(config), "--weight-dtype", "int4"])
    assert serve_config(args).engine.options["weight_dtype"] == "int4"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--weight-dtype", "int3"])
