"""Tensor-parallel groups on Ray: per-step control overhead and generated tokens/s.

Control overhead: for each step, the time from the scheduler's decision (rank 0 entering
TPExecutor.execute) to the last rank starting its forward, on one clock (perf_counter is
CLOCK_MONOTONIC, shared by the processes of one host). "Starting the forward" is the same point
on every rank: ModelRunner.run about to call the model, its inputs prepared (rank 0: after
encoding and sending the step and preparing its inputs; other ranks: after receiving and
decoding the step and preparing their inputs), so input preparation counts on every rank.
Measured in steady decode with 1, 32 and 256 running requests, next to the latency of one small
gloo broadcast on the step channel's group in the same run (ping-pong halved). Goal: overhead <= one
broadcast + 0.2 ms whatever the number of running requests. `cpu_ms_p50` splits the CPU part
in-process (no model, no transport): rank 0's plan, encode and prepare, the other rank's decode
and prepare.

Throughput: the same workload (256 requests) on a TP=1 and a TP=2 group, both Ray actors
streaming back through Ray. One JSON line per case.

    python benchmarks/tensor_parallel.py [--model DIR] [--max-tokens 64] [--cpu-binding "0|1"]

`--cpu-binding` binds each rank to its cores (RayGroupConfig.cpu_binding): on a host with few
cores the ranks otherwise take each other's core whenever one wakes the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.ray.group import RayGroup, RayGroupConfig  # noqa: E402
from cluster.ray.runtime import ensure_ray, shutdown_ray  # noqa: E402
from pagefleet.llm import engine_config  # noqa: E402
from worker.config import SchedulerConfig  # noqa: E402
from worker.engine.block_manager import BlockManager  # noqa: E402
from worker.engine.request import Request  # noqa: E402
from worker.engine.scheduler import Scheduler  # noqa: E402
from worker.exec.model_runner import ModelRunner  # noqa: E402
from worker.exec.step_codec import decode_step, encode_step  # noqa: E402
from worker.model.builtin_model import builtin_model_path  # noqa: E402
from worker.protocol import GenerationRequest  # noqa: E402
from worker.sampling_params import SamplingParams  # noqa: E402

RUNNING = (1, 32, 256)
PROMPT_LEN = 16
GOAL_SLACK_MS = 0.2


def make_group(model: str, tp: int, max_tokens: int, cpu_binding: str | None = None) -> RayGroup:
    max_len = PROMPT_LEN + max_tokens
    config = engine_config(
        model,
        num_blocks=max(RUNNING) * (max_len // 16 + 2),
        block_size=16,
        max_model_len=max_len,
        max_num_seqs=max(RUNNING),
        max_num_batched_tokens=8192,
    )
    binding = "|".join(cpu_binding.split("|")[:tp]) if cpu_binding else None
    return RayGroup(config, RayGroupConfig(tensor_parallel_size=tp, cpu_binding=binding))


async def run_requests(group: RayGroup, n: int, max_tokens: int, seed: int) -> int:
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one() -> int:
        prompt = [rng.randrange(3, 250) for _ in range(PROMPT_LEN)]
        last = None
        async for out in group.generate(GenerationRequest(prompt, params)):
            last = out
        return len(last.token_ids)

    return sum(await asyncio.gather(*(one() for _ in range(n))))


def step_overheads(group: RayGroup, n: int, skip: int) -> list[tuple[tuple, ...]]:
    """Per step (after the first `skip`) that scheduled exactly `n` requests: each rank's
    (seconds from the decision to its forward, its parts)."""
    for _ in range(100):  # another rank may still be finishing the last step
        per_rank = group.timings()
        if len({len(t) for t in per_rank}) == 1:
            break
        time.sleep(0.02)
    assert len({len(t) for t in per_rank}) == 1, "ranks saw different numbers of steps"
    steps = list(zip(*per_rank, strict=True))[skip:]
    return [tuple(t[1:] for t in step) for step in steps if step[0][0] == n]


def step_costs(n: int, repeat: int = 80) -> dict[str, float]:
    """Median seconds of each piece of a steady decode step of `n` running requests, here, on
    the real scheduler with two runners (no model): rank 0's plan, encode and prepare, the
    other rank's decode and prepare. Between steps both runners prepare the continuing step
    ahead and rank 0 plans it with its sampled tokens, as ModelRunner.run does."""
    bm = BlockManager(n * 8, 16, None, lambda e: None)
    sched = Scheduler(SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=8192), bm)
    for i in range(n):
        params = SamplingParams(temperature=0.0, max_tokens=repeat + 8, ignore_eos=True)
        prompt = list(range(3, 3 + PROMPT_LEN))
        sched.add_request(Request(f"r{i}", prompt, params, max_tokens=repeat + 8))
    cpu = torch.device("cpu")
    rank0, rank1 = ModelRunner(None, 16, cpu), ModelRunner(None, 16, cpu)
    times: dict[str, list[float]] = {k: [] for k in ("plan", "encode", "decode", "prep0", "prep1")}
    for step in range(repeat):
        out = sched.schedule()
        t0 = time.perf_counter()
        planned = rank0.planner.plan(out)
        t1 = time.perf_counter()
        message = encode_step(planned)
        t2 = time.perf_counter()
        received, _ = decode_step(message)
        t3 = time.perf_counter()
        kept0 = rank0.prepare(planned)
        t4 = time.perf_counter()
        kept1 = rank1.prepare(received)
        t5 = time.perf_counter()
        del kept0, kept1  # (freed after the timing, as after a forward)
        if step > 2:  # steady decode: every request running
            for key, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
                times[key].append(dt)
        tokens = {s.request.request_id: 7 for s in out.scheduled}
        sampled = np.full(len(tokens), 7, dtype=np.int32)  # every request sampled
        sched.update_from_output(out, tokens)
        # What ModelRunner.run does after each forward, off the next step's critical path.
        rank0.planner.commit(sampled)
        rank0.speculate()
        rank1.speculate()
    return {key: statistics.median(v) for key, v in times.items()}


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)


def bench_overhead(group: RayGroup, n: int, max_tokens: int, rounds: int) -> dict:
    broadcast = group.probe_broadcast(rounds)
    skip = len(group.timings()[0])
    asyncio.run(run_requests(group, n, max_tokens, seed=n))
    per_step = step_overheads(group, n, skip)
    samples = sorted(max(total for total, _ in step) for step in per_step)
    p50 = statistics.median(samples)
    ranks = list(zip(*per_step, strict=True))  # per rank: (total, parts) of each step
    parts = [[ms(statistics.median(p)) for p in zip(*(pt for _, pt in r), strict=True)] for r in ranks]
    return {
        "case": "control_overhead",
        "tp": group.tp,
        "running": n,
        "steps": len(samples),
        "overhead_ms_p50": ms(p50),
        "overhead_ms_p90": ms(samples[int(0.9 * (len(samples) - 1))]),
        "per_rank_ms_p50": [ms(statistics.median(total for total, _ in r)) for r in ranks],
        # rank 0: plan, encode, send, prepare; others: until received, decode, prepare
        "per_rank_parts_ms_p50": parts,
        "cpu_ms_p50": {k: ms(v) for k, v in step_costs(n).items()},
        "broadcast_ms": ms(broadcast),
        "goal_ms": ms(broadcast + GOAL_SLACK_MS / 1e3),
        "meets_goal": p50 <= broadcast + GOAL_SLACK_MS / 1e3,
        "transport": "step: tcp stream, broadcast: gloo, loopback",
        "load1": round(os.getloadavg()[0], 2),
    }


def bench_throughput(group: RayGroup, n: int, max_tokens: int, rounds: int) -> dict:
    broadcast = group.probe_broadcast(rounds) if group.tp > 1 else 0.0
    asyncio.run(run_requests(group, 4, 4, seed=0))  # warm up
    t0 = time.perf_counter()
    tokens = asyncio.run(run_requests(group, n, max_tokens, seed=1))
    wall = time.perf_counter() - t0
    return {
        "case": "throughput",
        "tp": group.tp,
        "requests": n,
        "generated_tokens": tokens,
        "seconds": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "broadcast_ms": ms(broadcast),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: built-in)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--probe-rounds", type=int, default=200)
    ap.add_argument("--address", default=None, help="Ray cluster address (default: local)")
    ap.add_argument("--cpu-binding", default=None, help='cores per rank, e.g. "0|1" (RayGroupConfig.cpu_binding)')
    args = ap.parse_args()
    model = str(args.model or builtin_model_path())
    ensure_ray(args.address, num_cpus=4)
    try:
        for tp in (2, 1):
            group = make_group(model, tp, args.max_tokens, args.cpu_binding)
            try:
                if tp > 1:
                    for n in RUNNING:
                        case = bench_overhead(group, n, args.max_tokens, args.probe_rounds)
                        print(json.dumps({**case, "cpu_binding": args.cpu_binding}), flush=True)
                result = bench_throughput(group, max(RUNNING), args.max_tokens, args.probe_rounds)
                print(json.dumps({**result, "cpu_binding": args.cpu_binding}), flush=True)
            finally:
                group.shutdown()
    finally:
        shutdown_ray()


if __name__ == "__main__":
    main()
