"""Soak: does a long-running `pagefleet serve` hold its memory under a steady load?

    python -m benchmarks.soak --duration 600            # ten minutes, as in RESULTS.md
    python -m benchmarks.soak --duration 60 --window 5  # a quick look

Starts `pagefleet serve` on loopback (the built-in model unless --model; a small pool, so that
the prefix cache fills within the first minute and stays full), then keeps --concurrency
requests in flight, each a new prompt, rotating over both doors and their forms: gRPC
streamed (token ids) and unary (text), HTTP completions streamed and chat completions unary;
the metrics endpoint is scraped once a window, as Prometheus would. Bounded by --duration
and --max-requests.

One JSON line per window: seconds since the load began, requests done and failed, the
server's RSS and that of its child processes (MB), and the RSS slope since the first window
(MB per 1,000 requests), so that a steady growth and a level-off read off the last lines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from itertools import cycle
from pathlib import Path

import httpx
import psutil

from pagefleet.client import AsyncClient
from tests.redis_server import free_port
from tests.serve_process import builtin_model_flags, start_serve

FORMS = ("grpc_stream", "http_stream", "grpc_unary", "http_chat")
VOCAB = 256  # token ids of the built-in model's prompts stay below its vocabulary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The soak's flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--max-requests", type=int, default=100_000, help="stop after this many")
    p.add_argument("--window", type=float, default=10.0, help="seconds per sample line")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--prompt-tokens", type=int, default=48, help="tokens per prompt")
    p.add_argument("--num-blocks", type=int, default=256, help="the server's pool, in blocks")
    p.add_argument("--model", help="model directory (default: the built-in model)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def tree_rss_mb(pid: int) -> tuple[float, float]:
    """(RSS of `pid`, summed RSS of its descendants), in MB."""
    proc = psutil.Process(pid)
    children = 0
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # (gone since the listing)
            children += child.memory_info().rss
    return proc.memory_info().rss / 2**20, children / 2**20


class Load:
    """Requests of every form, each on a prompt of its own, counted as they finish."""

    def __init__(self, grpc_client: AsyncClient, http: httpx.AsyncClient, model: str, args) -> None:
        self.grpc, self.http, self.model, self.args = grpc_client, http, model, args
        self.rng = random.Random(args.seed)
        self.forms = cycle(FORMS)
        self.started = self.done = self.errors = 0

    def prompt(self) -> list[int]:
        return [self.rng.randrange(3, VOCAB) for _ in range(self.args.prompt_tokens)]

    async def one(self) -> None:
        form, ids, n = next(self.forms), self.prompt(), self.args.max_tokens
        text = " ".join(f"w{i}" for i in ids[: self.args.prompt_tokens // 2])
        try:
            if form == "grpc_stream":
                async for _ in self.grpc.generate_stream(token_ids=ids, max_tokens=n, ignore_eos=True):
                    pass
            elif form == "grpc_unary":
                await self.grpc.generate(text, max_tokens=n, ignore_eos=True)
            elif form == "http_stream":
                body = {
                    "model": self.model,
                    "prompt": ids,
                    "max_tokens": n,
                    "stream": True,
                    "ignore_eos": True,
                    "stream_options": {"include_usage": True},
                }
                async with self.http.stream("POST", "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    async for _ in r.aiter_lines():
                        pass
            else:
                body = {
                    "model": self.model,
                    "max_tokens": n,
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": text}],
                }
                (await self.http.post("/v1/chat/completions", json=body)).raise_for_status()
        except Exception as e:  # counted, not fatal: the soak reports what failed
            self.errors += 1
            if self.errors <= 5:
                print(f"{form}: {type(e).__name__}: {e}", file=sys.stderr)
        self.done += 1

    async def worker(self, until: float) -> None:
        while time.monotonic() < until and self.started < self.args.max_requests:
            self.started += 1  # (counted when started: the workers stop at the bound exactly)
            await self.one()


async def soak(args, pid: int, grpc_target: str, http_base: str, metrics_url: str) -> None:
    """Run the load, printing one line per window."""
    async with (
        AsyncClient(grpc_target, timeout=120) as grpc_client,
        httpx.AsyncClient(base_url=http_base, timeout=120) as http,
    ):
        model = (await grpc_client.model_info()).model
        load = Load(grpc_client, http, model, args)
        start = time.monotonic()
        until = start + args.duration
        workers = [asyncio.ensure_future(load.worker(until)) for _ in range(args.concurrency)]
        first = None
        while not all(w.done() for w in workers):
            await asyncio.wait(workers, timeout=args.window)
            (await http.get(metrics_url)).raise_for_status()
            rss, children = tree_rss_mb(pid)
            first = first or (load.done, rss)
            slope = (rss - first[1]) / max(load.done - first[0], 1) * 1000
            line = {
                "bench": "soak",
                "t_s": round(time.monotonic() - start, 1),
                "requests": load.done,
                "errors": load.errors,
                "rss_mb": round(rss, 1),
                "children_rss_mb": round(children, 1),
                "mb_per_1k_requests": round(slope, 2),
                "model": model,
            }
            print(json.dumps(line), flush=True)
        for w in workers:
            w.result()


def main(argv: list[str] | None = None) -> None:
    """Start the server, soak it, stop it."""
    args = parse_args(argv)
    port, http_port, metrics_port = free_port(), free_port(), free_port()
    model = ["--model", args.model] if args.model else builtin_model_flags()
    flags = [
        *model,
        "--http-port",
        str(http_port),
        "--metrics-port",
        str(metrics_port),
        "--num-blocks",
        str(args.num_blocks),
        "--grace",
        "2",
    ]
    log = Path(tempfile.mkdtemp(prefix="soak-")) / "serve.log"
    proc, client = start_serve(flags, port, log, 300)
    client.close()
    try:
        asyncio.run(
            soak(
                args,
                proc.pid,
                f"127.0.0.1:{port}",
                f"http://127.0.0.1:{http_port}",
                f"http://127.0.0.1:{metrics_port}/metrics",
            )
        )
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"server log: {log}", file=sys.stderr)


if __name__ == "__main__":
    main()
