"""dtype "auto": bfloat16 on a CPU with bf16 units, float32 on one without; the engine, its
block hashes and a router all agree; and the default's greedy tokens follow transformers'."""

from __future__ import annotations

import platform
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagefleet.llm import LLM
from worker.config import EngineConfig
from worker.model.builtin_model import make_model_dir
from worker.model.dtypes import cpu_has_bf16, cpuinfo_has_bf16, resolve_dtype
from worker.model.model_loader import read_model_config
from worker.sampling_params import SamplingParams

ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n"
ICELAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve i8mm bf16 sve2\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd crc32 atomics asimddp\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # output scale 16: greedy choices further apart than test_engine.py's models (8), so that
    # the 16-bit comparison runs past the first few tokens before a near-tie stops it
    return make_model_dir(tmp_path_factory.mktemp("llama"), seed=1, output_scale=16.0)


@pytest.mark.parametrize(
    "cpuinfo,has",
    [(ZEN4, True), (SAPPHIRE, True), (GRAVITON3, True), (ICELAKE, False), (GRAVITON2, False)],
    ids=["avx512_bf16", "amx_bf16", "arm-bf16", "avx512-no-bf16", "arm-no-bf16"],
)
def test_bf16_units_are_read_from_cpuinfo_flags(cpuinfo, has):
    assert cpuinfo_has_bf16(cpuinfo) is has
    assert not cpuinfo_has_bf16("model name\t: bf16 avx512_bf16 in a name, not a flag\n")


def test_detection_agrees_with_torchs_own_on_x86():
    """oneDNN picks its bf16 kernels by the same CPU features; torch reports them."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        torch_says = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        assert cpu_has_bf16() is torch_says


def test_auto_resolves_to_bf16_exactly_when_the_cpu_has_bf16_units(model_dir):
    mc = read_model_config(model_dir)
    assert mc.dtype == "float32"  # the checkpoint's own dtype does not decide on CPU
    want = torch.bfloat16 if cpu_has_bf16() else torch.float32
    assert resolve_dtype("auto", mc, "cpu") == want
    assert resolve_dtype("auto", mc, torch.device("cuda")) == torch.float32  # the checkpoint's
    assert resolve_dtype("float16", mc, "cpu") == torch.float16
    with pytest.raises(ValueError, match="dtype 'bf17' is not a torch dtype name"):
        resolve_dtype("bf17", mc, "cpu")


def test_default_engine_runs_and_hashes_in_the_resolved_dtype(model_dir):
    from router.launch.local import router_side

    want = resolve_dtype("auto", read_model_config(model_dir), "cpu")
    llm = LLM(str(model_dir), num_blocks=16, max_model_len=128)
    executor = llm.engine.executor
    assert executor.worker.model_dtype == want
    assert executor.layout.dtype == want  # the KV pool ("auto": the model's dtype)
    fingerprint = llm.engine.facts().fingerprint
    assert fingerprint.dtype == str(want).removeprefix("torch.")
    hasher, _, _ = router_side(EngineConfig(str(model_dir)), "m")
    assert hasher.fingerprint == fingerprint  # a router names blocks as the engine does


def test_default_dtype_follows_transformers_up_to_a_near_tie(model_dir):
    """Greedy tokens of the default dtype equal transformers' in that dtype wherever the
    reference's top two logits are well apart. The reference reads our tokens (teacher
    forcing), so a near-tie that went the other way does not stop the comparison: it skips
    that one position (test_engine.py's 16-bit test stops at the first)."""
    dtype = resolve_dtype("auto", read_model_config(model_dir), "cpu")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (9, 30, 17, 44, 5, 23)]
    llm = LLM(str(model_dir), num_blocks=32, max_model_len=256)
    ours = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10))]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    compared = 0
    for p, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([p + got])).logits[0, len(p) - 1 : -1].float()
        top2 = logits.topk(2).values
        for i, tok in enumerate(got):
            if top2[i, 0] - top2[i, 1] < 0.5:
                continue  # a near-tie may go either way in 16-bit
            assert tok == int(logits[i].argmax()), f"token {i} of {dtype} differs"
            compared += 1
    assert compared >= 24  # the comparison covered real tokens, not only near-ties
