"""Decode attention on CPU: the kernel (kernels/cpu_decode.cpp) against the torch path
(kernels/torch_sdpa.py) on the same paged K/V. One JSON line per dtype, context and batch, with
the same-run ratio against the torch path.

    python -m benchmarks.decode_attention                    # SmolLM2-135M's heads, 2 threads
    python -m benchmarks.decode_attention --contexts 1300 --batches 1

Each call is one layer's decodes of one step. `cold`: before each call a 64 MiB buffer is
written, as a step's weights stream through the caches between two layers' attention, so the
K/V comes from DRAM; `warm`: the same call again, the K/V in cache. The two paths alternate
call by call, so the machine's noise falls on both.
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

from benchmarks.cpu_attention import paged  # noqa: E402
from kernels import cpu_decode  # noqa: E402
from kernels.torch_sdpa import Workspace, paged_attention_sdpa  # noqa: E402

SWEEP_BYTES = 64 << 20


def measure(paths: dict, repeat: int, cold: bool) -> dict[str, float]:
    """Median microseconds of each path, the calls interleaved."""
    sweep = torch.empty(SWEEP_BYTES, dtype=torch.uint8)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for fn in paths.values():
        fn()  # warm-up
    for _ in range(repeat):
        for name, fn in paths.items():
            if cold:
                sweep.add_(1)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def case(dtype_name: str, context: int, batch: int, args) -> dict:
    """One JSON line: `batch` decodes of `context` positions each, cold and warm."""
    dtype = getattr(torch, dtype_name)
    query, k, v, tables, qsl, lens = paged(
        [1] * batch, [context] * batch, args.heads, args.kv_heads, args.head_dim, dtype
    )
    scale = args.head_dim**-0.5
    out = torch.empty_like(query)
    workspace = Workspace()
    scratch = torch.empty(cpu_decode.scratch_size(args.heads, context, args.head_dim, args.threads))
    rows, contexts = list(range(batch)), [context] * batch

    def kernel():
        cpu_decode.decode(query, k, v, tables, rows, contexts, scale, out, scratch)

    def torch_path():
        paged_attention_sdpa(query, k, v, tables, qsl, lens, scale, workspace=workspace)

    line = {"bench": "decode_attention", "dtype": dtype_name, "context": context, "batch": batch}
    for cold in (True, False):
        us = measure({"kernel": kernel, "torch": torch_path}, args.repeat, cold)
        state = "cold" if cold else "warm"
        line[f"kernel_us_{state}"] = round(us["kernel"], 1)
        line[f"torch_us_{state}"] = round(us["torch"], 1)
        line[f"kernel_vs_torch_{state}"] = round(us["kernel"] / us["torch"], 3)
    line["threads"] = args.threads
    return line


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--contexts", default="20,300,1300,4000", help="cached positions per decode")
    p.add_argument("--batches", default="1,8", help="decodes per step")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--repeat", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if cpu_decode.library() is None:
        raise SystemExit("the CPU decode kernel could not be built here (see the log)")
    lines = []
    for dtype_name in args.dtypes.split(","):
        for context in map(int, args.contexts.split(",")):
            for batch in map(int, args.batches.split(",")):
                lines.append(case(dtype_name, context, batch, args))
                print(json.dumps(lines[-1]), flush=True)
    return lines


if __name__ == "__main__":
    main()
