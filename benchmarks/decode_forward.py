"""Where a concurrency-1 decode forward's time goes, op by op, against the bandwidth limit.

    python -m benchmarks.decode_forward --threads 2                 # the default model, 3 formats
    python -m benchmarks.decode_forward --model builtin --tokens 8  # quick

benchmarks/step_profile.py showed that at concurrency 1 nearly all of a token's time is the
model's forward; this takes the forward apart. For each `--weight-dtype` (float, int8, int4) it
loads the model through `LLM`, streams one greedy completion (the prompt cached by a warm-up, so
every forward after the first is one token), and times each one-token forward
(`LlamaForCausalLM.forward`) and the LM head (`compute_logits`) apart. Then it runs the same
completion under torch.profiler and counts, per one-token forward (the step's LM head and
sampling included), the top-level aten ops (those the model's Python calls), the ops per layer,
the time per op type, and the time outside any op (`python_ms`: the forward's Python, the
dispatcher, the profiler's own cost) as the step's wall time less its ops' time.

One JSON line for the machine's bandwidth (a read and a copy of a buffer larger than the caches,
this run), then one per format: weight bytes, the bound on a token (bytes / read bandwidth),
forward and LM-head medians, achieved / bound, and the profile's figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_bound import PROMPT, bandwidth  # noqa: E402
from pagefleet import LLM, SamplingParams  # noqa: E402
from worker.exec.kv_pool import weights_bytes  # noqa: E402


def timed_decode(llm: LLM, tokens: int) -> tuple[list[float], list[float]]:
    """Seconds of each one-token forward and each LM head of one greedy completion."""
    model = llm.engine.executor.worker.model
    forwards: list[float] = []
    heads: list[float] = []
    forward, logits = model.forward, model.compute_logits

    def timed_forward(ids, positions, meta):
        t = time.perf_counter()
        hidden = forward(ids, positions, meta)
        if ids.shape[0] == 1:
            forwards.append(time.perf_counter() - t)
        return hidden

    def timed_logits(hidden):
        t = time.perf_counter()
        out = logits(hidden)
        if hidden.shape[0] == 1:
            heads.append(time.perf_counter() - t)
        return out

    model.forward, model.compute_logits = timed_forward, timed_logits
    try:
        llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    finally:
        del model.forward, model.compute_logits
    return forwards, heads


def op_profile(llm: LLM, tokens: int, num_layers: int, top: int) -> dict:
    """Top-level aten ops of a greedy completion of `tokens` tokens, per token."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate([PROMPT], params)
    wall = time.perf_counter() - t
    ms: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.cpu_parent is None and event.name.startswith("aten::"):
            ms[event.name] += event.cpu_time_total / 1e3
            calls[event.name] += 1
    n_ops = sum(calls.values())
    ops_ms = sum(ms.values())
    ranked = sorted(ms, key=ms.get, reverse=True)[:top]
    return {
        "ops_per_token": round(n_ops / tokens),
        "ops_per_layer": round(n_ops / tokens / num_layers, 1),
        "profiled_ms_per_token": round(wall * 1e3 / tokens, 2),
        "ops_ms_per_token": round(ops_ms / tokens, 2),
        "python_ms_per_token": round((wall * 1e3 - ops_ms) / tokens, 2),
        "top_ops": {name: [round(ms[name] / tokens, 3), round(calls[name] / tokens, 1)] for name in ranked},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a model directory or .gguf, builtin, or the default")
    p.add_argument("--formats", default="float,int8,int4")
    p.add_argument("--tokens", type=int, default=32, help="output tokens of the timed completion")
    p.add_argument("--profile-tokens", type=int, default=8)
    p.add_argument("--top", type=int, default=8, help="op types listed per format")
    p.add_argument("--buffer-mib", type=int, default=512)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bw = bandwidth(args.buffer_mib, 5)
    print(json.dumps({"case": "bandwidth", "buffer_mib": args.buffer_mib, **{k: round(v, 2) for k, v in bw.items()}}))
    for fmt in args.formats.split(","):
        llm = LLM(args.model, weight_dtype=fmt, max_num_seqs=4)
        try:
            model = llm.engine.executor.worker.model
            nbytes = weights_bytes(model)
            layers = len(model.attention_layers())
            llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4))  # warm, caches the prompt
            forwards, heads = timed_decode(llm, args.tokens)
            prof = op_profile(llm, args.profile_tokens, layers, args.top)
        finally:
            llm.shutdown()
            gc.collect()
        bound_ms = nbytes / (bw["read_gb_s"] * 1e9) * 1e3
        forward_ms, head_ms = statistics.median(forwards) * 1e3, statistics.median(heads) * 1e3
        line = {
            "case": "decode_forward",
            "weight_dtype": fmt,
            "threads": torch.get_num_threads(),
            "weight_mb": round(nbytes / 1e6, 1),
            "bound_ms": round(bound_ms, 3),
            "forward_ms_p50": round(forward_ms, 3),
            "forward_ms_min": round(min(forwards) * 1e3, 3),
            "lm_head_ms_p50": round(head_ms, 3),
            "achieved_over_bound": round(bound_ms / (forward_ms + head_ms), 3),
            **prof,
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
