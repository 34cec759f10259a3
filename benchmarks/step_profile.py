"""Where the time between two forwards goes at concurrency 1, on a real server, end to end.

    python -m benchmarks.step_profile                          # the default model, 5 x 64 tokens
    python -m benchmarks.step_profile --model builtin --requests 2 --tokens 16   # smoke

Starts `pagefleet serve` (in a child process, one in-process group, the HTTP door) with timers
put around the functions a decode token passes through, then streams `--requests` greedy
completions one after another through the OpenAI-compatible HTTP door (raw server-sent events
over httpx, from this process), EOS ignored, `--tokens` tokens each. Time stamps on both sides
are `time.perf_counter` (CLOCK_MONOTONIC, one clock for both processes).

Between two consecutive forwards of one-token (decode) steps, every millisecond is put in one
bucket, on the engine's thread:

- forward: the model's forward (`LlamaForCausalLM.forward`; with the int4/int8 matmuls);
- lm_head: `compute_logits` (the vocabulary matmul);
- sample: the sampler (greedy: an argmax), and keying its ids by request (`sampled_by_id`);
- prepare / speculate / commit: the runner's inputs for the step, the next step's made ahead,
  and keeping the sampled tokens;
- schedule: `Scheduler.schedule`; append: `append_token` (stop checks);
- detokenize: `IncrementalDetokenizer.step_one`; output: the step's `RequestOutput`s;
- deliver: `AsyncEngine._deliver` (handing the outputs to the event loop);
- step_other: the rest of `LLMEngine.step`; between_steps: the engine thread's time outside
  `step` (its loop: commands, stats, the group's step callback).

And beside it, on the event loop's thread (the door, the router, uvicorn's writes): `loop_busy`,
the time its callbacks ran in that interval (`asyncio` handles), and how much of it overlapped
the forward (`loop_busy_in_forward`): a Python callback holds the GIL that the forward's Python
also needs. The client's own inter-token time is `client_itl`.

One JSON line: the median of each bucket over the intervals (ms), the period (forward start to
forward start), each bucket's share of the period, `host_share` (the period less forward and
lm_head, over the period: the per-token path), and the buckets above 10% of the period.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.redis_server import free_port  # noqa: E402

ENGINE_BUCKETS = (
    "forward",
    "lm_head",
    "sample",
    "prepare",
    "speculate",
    "commit",
    "schedule",
    "append",
    "detokenize",
    "output",
    "deliver",
)

# ---- the child: `pagefleet serve` with timers ------------------------------------------------
EVENTS: list[tuple[str, int, float, float, int]] = []  # name, thread id, start, end, tokens


def _timed(name: str, fn, tokens_arg: int | None = None):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            n = len(args[tokens_arg]) if tokens_arg is not None else 0
            EVENTS.append((name, threading.get_ident(), t0, time.perf_counter(), n))

    wrapper.__wrapped__ = fn
    return wrapper


def install_timers() -> None:
    """Timers around the functions a decode token passes through (class attributes, so every
    instance the server makes has them)."""
    import asyncio.events

    import worker.engine.llm_engine as llm_engine
    import worker.exec.model_runner as model_runner
    from worker.engine.async_engine import AsyncEngine
    from worker.engine.detokenizer import IncrementalDetokenizer
    from worker.engine.scheduler import Scheduler
    from worker.exec.sampler import Sampler
    from worker.model.models.llama import LlamaForCausalLM

    patches = [
        (LlamaForCausalLM, "forward", "forward", 1),
        (LlamaForCausalLM, "compute_logits", "lm_head", None),
        (Sampler, "__call__", "sample", None),
        (model_runner, "sampled_by_id", "sample", None),
        (model_runner.ModelRunner, "prepare", "prepare", None),
        (model_runner.ModelRunner, "speculate", "speculate", None),
        (model_runner.ModelRunner, "commit", "commit", None),
        (Scheduler, "schedule", "schedule", None),
        (Scheduler, "append_token", "append", None),
        (IncrementalDetokenizer, "step_one", "detokenize", None),
        (llm_engine, "_output", "output", None),
        (AsyncEngine, "_deliver", "deliver", None),
        (llm_engine.LLMEngine, "step", "step", None),
        (asyncio.events.Handle, "_run", "loop", None),
    ]
    for owner, attr, name, tokens_arg in patches:
        setattr(owner, attr, _timed(name, getattr(owner, attr), tokens_arg))


def child(trace: str, serve_args: list[str]) -> int:
    """Serve with timers; on exit, write the events and the loop's thread id to `trace`."""
    install_timers()
    from pagefleet.cli import main

    loop_thread = threading.get_ident()  # `serve` runs its event loop on this thread
    try:
        return main(["serve", *serve_args])
    finally:
        Path(trace).write_text(json.dumps({"loop_thread": loop_thread, "events": EVENTS}))


# ---- the parent: a client at concurrency 1, and the accounting --------------------------------
async def stream(client: httpx.AsyncClient, prompt: list[int], tokens: int) -> list[float]:
    """One streamed completion; the arrival time of each chunk that carries tokens."""
    body = {
        "model": (await client.get("/v1/models")).json()["data"][0]["id"],
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    times = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("token_ids"):
                times.append(time.perf_counter())
    return times


async def drive(base: str, requests: int, tokens: int) -> list[list[float]]:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        await stream(client, [5, 6, 7, 8], 4)  # warm
        out = []
        for i in range(requests):
            prompt = [(31 * i + 7 * j) % 900 + 20 for j in range(40 + 8 * i)]  # none shares a block
            out.append(await stream(client, prompt, tokens))
        return out


def clipped(spans: list[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(e, b) - max(s, a)) for s, e in spans)


def account(trace: dict) -> list[dict]:
    """Per interval between two consecutive decode forwards: ms in each bucket."""
    loop_tid = trace["loop_thread"]
    events = trace["events"]
    forwards = sorted((e for e in events if e[0] == "forward"), key=lambda e: e[2])
    engine_tid = forwards[-1][1]
    by_name: dict[str, list[tuple[float, float]]] = {}
    for name, tid, s, e, _ in events:
        if (tid == engine_tid and name != "loop") or (name == "loop" and tid == loop_tid):
            by_name.setdefault(name, []).append((s, e))
    rows = []
    for f0, f1 in zip(forwards, forwards[1:], strict=False):
        if f0[4] != 1 or f1[4] != 1:  # (both decode steps of one token)
            continue
        a, b = f0[2], f1[2]
        if b - a > 1.0:  # (the gap between two requests, not a step)
            continue
        row = {"period": b - a}
        for name in ENGINE_BUCKETS:
            row[name] = clipped(by_name.get(name, []), a, b)
        step = clipped(by_name.get("step", []), a, b)
        row["step_other"] = max(0.0, step - sum(row[n] for n in ENGINE_BUCKETS))
        row["between_steps"] = max(0.0, row["period"] - step)
        row["loop_busy"] = clipped(by_name.get("loop", []), a, b)
        fwd = [(f0[2], f0[3])]
        row["loop_busy_in_forward"] = sum(clipped(fwd, s, e) for s, e in by_name.get("loop", []) if e > a and s < b)
        rows.append(row)
    return rows


def summarize(rows: list[dict], client: list[list[float]], model: str) -> dict:
    med = {k: statistics.median(r[k] for r in rows) * 1e3 for k in rows[0]}
    period = med["period"]
    itl = [b - a for times in client for a, b in zip(times[1:], times[2:], strict=False)]
    line = {"bench": "step_profile", "model": model, "intervals": len(rows)}
    line.update({f"{k}_ms": round(v, 3) for k, v in med.items()})
    line["client_itl_ms_p50"] = round(statistics.median(itl) * 1e3, 3) if itl else None
    shares = {k: v / period for k, v in med.items() if k not in ("period", "loop_busy_in_forward")}
    line["shares"] = {k: round(v, 3) for k, v in shares.items()}
    host = [1 - (r["forward"] + r["lm_head"]) / r["period"] for r in rows]  # (per interval: medians do not add)
    line["host_share"] = round(statistics.median(host), 3)
    line["over_10pct"] = sorted(k for k, v in shares.items() if v > 0.10 and k not in ("forward", "lm_head"))
    return line


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a model directory or .gguf, builtin, or the default model")
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    p.add_argument("--serve-arg", action="append", default=[], help="one more `serve` flag (repeatable)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # (the server's side: where to write its events)
    argv = sys.argv[1:] if argv is None else argv
    rest = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = p.parse_args(argv[: len(argv) - len(rest) - (1 if rest else 0)])
    if args.child:  # (the server's side: its `serve` flags follow "--")
        sys.exit(child(args.child, rest))
    http_port = free_port()
    serve = [f"--port={free_port()}", f"--http-port={http_port}", "--no-metrics", "--grace=1", *args.serve_arg]
    if args.model:
        serve.append(f"--model={args.model}")
    with tempfile.TemporaryDirectory() as tmp:
        trace, log = Path(tmp) / "events.json", Path(tmp) / "serve.log"
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        cmd = [sys.executable, "-m", "benchmarks.step_profile", f"--child={trace}", "--", *serve]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], env=env, stdout=out, stderr=out)
        base = f"http://127.0.0.1:{http_port}"
        try:
            wait_ready(proc, base, log)
            client = asyncio.run(drive(base, args.requests, args.tokens))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        line = summarize(account(json.loads(trace.read_text())), client, args.model or "default")
    print(json.dumps(line), flush=True)
    return line


def wait_ready(proc: subprocess.Popen, base: str, log: Path) -> None:
    deadline = time.monotonic() + 900  # (a loaded machine imports slowly)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server is not ready after 900 s")


if __name__ == "__main__":
    main(sys.argv[1:])
