"""Serving benchmark: open-loop load through either door of a running `pagefleet serve`.

    python -m benchmarks.serving --rates 0.5,1,2
    python -m benchmarks.serving --quick          # the smoke size

Starts `pagefleet serve` (the built-in model unless --model) with both doors, then replays the
research-assistant trace (benchmarks/workloads.py: documents with several questions each, and
short chats; prompts as token ids, EOS ignored so that every request generates exactly its
tokens) at each rate, through gRPC and through the OpenAI-compatible HTTP door, with Poisson
arrivals (exponential gaps, the same draw for both doors): open loop, a request is sent at its
time whether or not earlier ones have finished. Each (rate, door) run has its own cache salt,
so that each starts with none of the trace's documents cached.

One JSON line per rate and door: TTFT, TPOT (time per output token after the first) and
end-to-end p50/p99 as the client sees them, output tokens/s over the run, and the door's own
latency: the client's TTFT less the group's (the group's receipt of the request to its first
token, reported with the usage), i.e. what the door, the router and the loopback round trip add
before the first token. The HTTP lines carry `vs_grpc`: their figures over the gRPC line's of the
same rate, same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.workloads import ResearchWorkload, research_requests
from pagefleet.client import AsyncClient
from tests.redis_server import free_port
from tests.serve_process import builtin_model_flags, start_serve

DOORS = ("grpc", "http")


@dataclass
class Sample:
    """One request as the client saw it."""

    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    group_ttft: float | None = None  # the group's, from the usage
    error: str | None = None
    times: list[float] = field(default_factory=list)


async def one_grpc(client: AsyncClient, req, salt: str) -> Sample:
    s, t0 = Sample(), time.perf_counter()
    try:
        async for r in client.generate_stream(
            token_ids=list(req.prompt), max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True, cache_salt=salt
        ):
            if r.token_ids:
                s.times.append(time.perf_counter() - t0)
                s.output_tokens += len(r.token_ids)
            if r.finished:
                s.group_ttft = r.usage.ttft_seconds
    except Exception as e:  # counted, not fatal: a benchmark reports what failed
        s.error = type(e).__name__
    s.e2e = time.perf_counter() - t0
    return s


async def one_http(client: httpx.AsyncClient, model: str, req, salt: str) -> Sample:
    s, t0 = Sample(), time.perf_counter()
    body = {
        "model": model,
        "prompt": list(req.prompt),
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "cache_salt": salt,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["token_ids"]:
                    s.times.append(time.perf_counter() - t0)
                    s.output_tokens += len(chunk["choices"][0]["token_ids"])
                if "usage" in chunk and chunk.get("usage"):
                    s.group_ttft = chunk["pagefleet"]["choices"][0]["ttft_seconds"]
    except Exception as e:
        s.error = type(e).__name__
    s.e2e = time.perf_counter() - t0
    return s


async def run_load(door: str, target: dict, trace, rate: float, seed: int, salt: str) -> dict:
    """The trace at `rate` requests/s through `door`; returns its JSON line."""
    rng = random.Random(seed)
    gaps = [rng.expovariate(rate) for _ in trace]
    async with (
        AsyncClient(target["grpc"], timeout=600) as grpc_client,
        httpx.AsyncClient(
            base_url=target["http"], timeout=600, limits=httpx.Limits(max_connections=1000)
        ) as http_client,
    ):

        async def send(req, at: float) -> Sample:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            if door == "grpc":
                return await one_grpc(grpc_client, req, salt)
            return await one_http(http_client, target["model"], req, salt)

        start, at, tasks = time.perf_counter(), 0.0, []
        for req, gap in zip(trace, gaps, strict=True):
            at += gap
            tasks.append(asyncio.ensure_future(send(req, at)))
        samples = await asyncio.gather(*tasks)
        makespan = time.perf_counter() - start
    return summarize(door, rate, samples, makespan)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 2)


def summarize(door: str, rate: float, samples: list[Sample], makespan: float) -> dict:
    ok = [s for s in samples if s.error is None and s.times]
    ttft = [s.times[0] for s in ok]
    tpot = [(s.e2e - s.times[0]) / (s.output_tokens - 1) for s in ok if s.output_tokens > 1]
    e2e = [s.e2e for s in ok]
    door_ms = [s.times[0] - s.group_ttft for s in ok if s.group_ttft is not None]
    line = {"bench": "serving", "door": door, "rate": rate, "requests": len(samples), "errors": len(samples) - len(ok)}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e), ("door", door_ms)):
        line[f"{name}_ms_p50"], line[f"{name}_ms_p99"] = pct(xs, 0.5), pct(xs, 0.99)
    line["output_tok_s"] = round(sum(s.output_tokens for s in ok) / makespan, 1)
    return line


def compare(http: dict, grpc: dict) -> dict:
    """The HTTP line's figures over the gRPC line's (same rate, same run)."""
    keys = ("ttft_ms_p50", "tpot_ms_p50", "e2e_ms_p50", "door_ms_p50", "output_tok_s")
    return {k: round(http[k] / grpc[k], 3) for k in keys if http.get(k) and grpc.get(k)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", default="0.5,1,2", help="requests per second, comma-separated")
    p.add_argument("--model", help="model for the server (default: the built-in model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a small trace at one rate (smoke)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rates = [1.0] if args.quick else [float(r) for r in args.rates.split(",")]
    workload = (
        ResearchWorkload(
            num_docs=2,
            doc_len=(200, 300),
            questions_per_doc=2,
            num_chats=2,
            output_len=(4, 8),
            vocab_size=1000,
            seed=args.seed,
        )
        if args.quick
        else ResearchWorkload(
            num_docs=3,
            doc_len=(300, 500),
            questions_per_doc=4,
            num_chats=6,
            output_len=(16, 48),
            vocab_size=1000,
            seed=args.seed,
        )
    )
    trace = research_requests(workload)
    http_port = free_port()
    model = ["--model", args.model] if args.model else builtin_model_flags()
    flags = [
        *model,
        f"--http-port={http_port}",
        "--no-metrics",
        "--grace=1",
        "--num-blocks=2048",
        "--max-model-len=2048",
    ]
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        proc, client = start_serve(flags, free_port(), Path(tmp) / "serve.log", 300)
        try:
            target = {
                "grpc": client.target,
                "http": f"http://127.0.0.1:{http_port}",
                "model": client.model_info().model,
            }
            asyncio.run(run_load("grpc", target, trace[:2], 100.0, 0, "warm-up"))
            for rate in rates:
                by_door = {}
                for door in DOORS:
                    salt = f"{door}-{rate}-{time.time_ns()}"
                    by_door[door] = asyncio.run(run_load(door, target, trace, rate, args.seed, salt))
                by_door["http"]["vs_grpc"] = compare(by_door["http"], by_door["grpc"])
                for line in by_door.values():
                    print(json.dumps(line), flush=True)
                    lines.append(line)
        finally:
            client.close()
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return lines


if __name__ == "__main__":
    main(sys.argv[1:])
