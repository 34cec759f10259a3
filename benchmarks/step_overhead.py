"""The engine's own time per decode step: what a GPU would wait on between two forwards.

    python -m benchmarks.step_overhead
    python -m benchmarks.step_overhead --quick      # fewer steps (smoke)

The built-in model's forward is replaced by an emulated device that does no work (`null`:
zeros for the hidden states and the logits) or that takes a fixed time (`fixed_5ms`, as a
GPU's forward of a small model would), so that what remains of a step is the engine's:
scheduling, block tables, input preparation, sampling and its bookkeeping, detokenizing,
output processing. The emulated device behaves as a GPU does: the forward's launch returns at
once, and the host waits when it first reads a result (the logits), until the device's time
since the launch has passed; host work between the two runs while the device computes. The LM
head and the sampler's argmax are device work on a GPU: the device's time runs from the
launch to the sampled ids. With 1, 64 and 256 requests decoding, after their prefill, each
without and with overlap (worker/exec/overlap.py: the next decode step's forward runs while the
engine processes the last one's tokens):

- step_ms: the wall time of one `engine.step()`, p50 and p99;
- overhead_ms: a step's wall time less the device's own work (the fixed time, and making the
  logits): without overlap, the engine's own time per step, the argmax included; with overlap,
  what of it the forward did not hide; p50 and p99;
- gap_ms: from the sampled ids of one step to the launch of the next forward, p50 and p99 (what
  a device would idle between two forwards);
- gap_after_logits_ms: the same from the logits, as if the argmax were the host's work (on
  this CPU the first torch call after the device's wait is slow: the caches are cold);
- ahead_confirmed / ahead_discarded: forwards run ahead and adopted, or not (overlap only);
- gap_vs_serial: this case's gap p50 over the same case's without overlap, same run.

One JSON line per (forward, running, overlap) case. The goals: overhead <= 0.5 ms at 256
running; gap <= 0.1 ms p50 at 256 with a 5 ms forward, with overlap. Those requests' prompts
are one block each (`prompts: aligned`): every 16 steps all their positions enter new blocks at
once. Then the 5 ms forward at the largest count again with prompts of 16 to 31 tokens
(`prompts: staggered`): positions enter new blocks in every step, as a server's requests do.

Then the served path at the largest running count (`path: served`): the engine behind
`AsyncEngine` as a group's rank 0 runs it (cluster/ray/rank_actor.py), its outputs relayed on an
asyncio loop in the same process (one `OutputDelta` per output, added to an outbox that a task
takes a batch at a time and pickles, as Ray carries it). `relay` is rank 0's form (`submit`: a
step's outputs reach the loop in one wake-up, a callback each); `streams` is a task per request
streaming `generate`, the form rank 0 had before; each without and with overlap (on by default
on CUDA). Both threads share the GIL, so the loop's work per output lengthens the engine's steps
unless it runs while the device computes: `period_ms` is the time from one forward's launch to
the next, `overhead_ms` that less the device's time; `relay_vs_streams`: the same run's ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import sys
import time

import torch

from cluster.ray.output_delta import OutputDelta
from cluster.ray.rank_actor import ENGINE_SWITCH_INTERVAL_S
from pagefleet.llm import engine_config
from worker.engine.async_engine import AsyncEngine
from worker.engine.llm_engine import LLMEngine
from worker.heap import settle_heap
from worker.protocol import GenerationRequest
from worker.sampling_params import SamplingParams

PROMPT = 16  # tokens: one block


LOGITS = 32  # the emulated device's logits per row (see TimedForward)


class TimedForward:
    """Stands for the model in the runner: an emulated device, timed.

    The forward's launch returns at once (as a GPU's does); `compute_logits`, the host's first
    read of a result, waits until `wait_s` has passed since the launch. The argmax over the
    model's 1,024 logits per row would cost ~0.3 ms of CPU per step at 256 rows where a GPU
    takes microseconds, so the emulated device hands back LOGITS logits per row (valid token
    ids all the same). Their largest value moves from row to row and step to step over tokens
    of text, so that the detokenizer sees output as a model's (a run of one special token,
    which decodes to nothing, would be another workload). Per sampling step it records the
    launch, the logits, the sampled ids (`TimedSampler`) and the device's own time."""

    def __init__(self, hidden_size: int, vocab_size: int, wait_s: float) -> None:
        self.hidden_size, self.vocab, self.wait_s = hidden_size, min(vocab_size, LOGITS), wait_s
        self.steps: list[tuple[float, float, float, float]] = []  # launch, logits, ids, device s
        self.calls = 0
        self._launched = self._logits_at = self._made_s = 0.0

    def __call__(self, input_ids, positions, meta):
        self._launched = time.perf_counter()
        return torch.zeros(len(input_ids), self.hidden_size)

    def compute_logits(self, hidden):
        """(n, LOGITS) logits whose argmax is a token of text (not one of the 3 special ids
        the built-in tokenizer skips), a different one per row and step."""
        if self.wait_s:
            time.sleep(max(0.0, self._launched + self.wait_s - time.perf_counter()))
        start = time.perf_counter()
        n = hidden.shape[0]
        logits = torch.zeros(n, self.vocab)
        self.calls += 1
        logits[torch.arange(n), 3 + (torch.arange(n) + self.calls) % (self.vocab - 3)] = 1.0
        self._logits_at = time.perf_counter()
        self._made_s = self._logits_at - start
        return logits

    def sampled(self) -> None:
        now = time.perf_counter()
        self.steps.append((self._launched, self._logits_at, now, self.wait_s + self._made_s))


class TimedSampler:
    """The runner's sampler, telling the emulated device when the ids are sampled."""

    def __init__(self, sampler, timed: TimedForward) -> None:
        self.sampler, self.timed = sampler, timed

    def __call__(self, logits, rows, kinds=None, masks=None):
        result = self.sampler(logits, rows, kinds, masks)
        self.timed.sampled()
        return result


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 3)


def timed_engine(forward: str, running: int, steps: int, overlap: bool) -> tuple[LLMEngine, TimedForward]:
    """The built-in model's engine for `running` requests of `steps` tokens, its forward the
    emulated device (`forward`)."""
    engine = LLMEngine(
        engine_config(
            "builtin",
            num_blocks=running * (3 + (PROMPT + steps) // 16) + 16,
            max_num_seqs=running,
            max_num_batched_tokens=max(2048, running * 2 * PROMPT),
            max_model_len=2 * PROMPT + steps + 64,
            **({"overlap": True} if overlap else {}),
        )
    )
    settle_heap()  # as a group's rank does once loaded (cluster/ray/rank_actor.py)
    runner = engine.executor.worker.runner
    mc = engine.model_config
    timed = TimedForward(mc.hidden_size, mc.vocab_size, 0.005 if forward == "fixed_5ms" else 0.0)
    runner.model = timed
    runner.sampler = TimedSampler(runner.sampler, timed)
    return engine, timed


def prompt_of(i: int, staggered: bool = False) -> list[int]:
    """Request i's prompt: one block; `staggered`, 16 + i % 16 tokens, so that the requests'
    positions enter new blocks at different steps (one or another in every step), as a
    server's requests do, rather than all in the same step every 16."""
    return [(7 * i + j) % 200 + 1 for j in range(PROMPT + (i % 16 if staggered else 0))]


def run_case(forward: str, running: int, steps: int, overlap: bool, staggered: bool = False) -> dict:
    engine, timed = timed_engine(forward, running, steps, overlap)
    params = SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True)
    for i in range(running):
        engine.add_request(prompt_of(i, staggered), params, request_id=f"r{i}")
    while engine.scheduler.waiting or any(  # until every request is past its prefill
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    ahead = getattr(engine.executor, "overlap", None)  # (an engine without overlap: none)
    before = (ahead.confirmed, ahead.discarded) if ahead else (0, 0)
    timed.steps.clear()
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    done = list(timed.steps)  # (with overlap, also a forward running ahead of the last step)
    assert len(done) >= steps and all(len(r.output_token_ids) > 0 for r in engine.scheduler.running)
    engine.executor.shutdown()
    device_s = sorted(d[3] for d in done)[len(done) // 2]
    overhead = [w - device_s for w in walls]
    gaps = [b[0] - a[2] for a, b in zip(done, done[1:], strict=False)]
    after_logits = [b[0] - a[1] for a, b in zip(done, done[1:], strict=False)]
    return {
        "bench": "step_overhead",
        "path": "engine",
        "forward": forward,
        "running": running,
        "steps": steps,
        "overlap": overlap,
        "prompts": "staggered" if staggered else "aligned",
        "step_ms_p50": pct(walls, 0.5),
        "step_ms_p99": pct(walls, 0.99),
        "overhead_ms_p50": pct(overhead, 0.5),
        "overhead_ms_p99": pct(overhead, 0.99),
        "gap_ms_p50": pct(gaps, 0.5),
        "gap_ms_p99": pct(gaps, 0.99),
        "gap_after_logits_ms_p50": pct(after_logits, 0.5),
        "ahead_confirmed": (ahead.confirmed - before[0]) if ahead else 0,
        "ahead_discarded": (ahead.discarded - before[1]) if ahead else 0,
    }


def run_served(forward: str, running: int, steps: int, form: str, overlap: bool = False) -> dict:
    """`running` requests of `steps` tokens through `AsyncEngine`, relayed as rank 0 does
    (`relay`) or by a task per request (`streams`); the steps after every prefill are timed."""
    engine, timed = timed_engine(forward, running, steps, overlap)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)  # as rank 0 sets it
    served = AsyncEngine(engine)
    batches = [0, 0]  # batches taken, bytes pickled

    async def serve() -> int:
        loop = asyncio.get_running_loop()
        outbox: list[OutputDelta] = []
        ready, ended = asyncio.Event(), loop.create_future()
        left = [running]

        def emit(out) -> None:  # rank 0's relay: a delta into the subscriber's outbox
            outbox.append(OutputDelta.of(out, False))
            ready.set()
            if out.finished:
                left[0] -= 1
                if not left[0]:
                    ended.set_result(None)

        async def follow(rid: str) -> None:  # a task per request (the streams form)
            async for out in served.generate(GenerationRequest(prompt_of(int(rid[1:])), params, request_id=rid)):
                emit(out)

        async def ship() -> None:  # the subscriber's output stream: a batch per wake-up
            while True:
                await ready.wait()
                ready.clear()
                batch, outbox[:] = list(outbox), []
                batches[0] += 1
                batches[1] += len(pickle.dumps(batch, protocol=5))

        shipping = asyncio.create_task(ship())
        for i in range(running):
            if form == "relay":
                served.submit(GenerationRequest(prompt_of(i), params, request_id=f"r{i}"), emit)
            else:
                loop.create_task(follow(f"r{i}"))
        await ended
        shipping.cancel()
        return left[0]

    try:
        assert asyncio.run(serve()) == 0
    finally:
        served.shutdown()
        engine.executor.shutdown()
        sys.setswitchinterval(switch)
    done = [d for d in timed.steps if d[0]]
    decode = done[-(steps - 1) :]  # (the first step is the prefill's)
    device_s = sorted(d[3] for d in decode)[len(decode) // 2]
    periods = [b[0] - a[0] for a, b in zip(decode, decode[1:], strict=False)]
    gaps = [b[0] - a[2] for a, b in zip(decode, decode[1:], strict=False)]
    return {
        "bench": "step_overhead",
        "path": "served",
        "form": form,
        "forward": forward,
        "running": running,
        "steps": steps,
        "overlap": overlap,
        "period_ms_p50": pct(periods, 0.5),
        "period_ms_p99": pct(periods, 0.99),
        "overhead_ms_p50": pct([p - device_s for p in periods], 0.5),
        "gap_ms_p50": pct(gaps, 0.5),
        "gap_ms_p99": pct(gaps, 0.99),
        "batches": batches[0],
        "pickled_kb_per_step": round(batches[1] / max(len(decode), 1) / 1024, 1),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps (smoke)")
    p.add_argument("--running", default="1,64,256", help="comma-separated running counts")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    lines = []
    runs = [int(r) for r in args.running.split(",")]
    for forward in ("null", "fixed_5ms"):
        for running in runs:
            serial = None
            for overlap in (False, True):
                line = run_case(forward, running, 20 if args.quick else 200, overlap)
                if serial is None:
                    serial = line
                else:
                    line["gap_vs_serial"] = round(line["gap_ms_p50"] / max(serial["gap_ms_p50"], 1e-9), 3)
                print(json.dumps(line), flush=True)
                lines.append(line)
    serial = None  # staggered prompts, 5 ms forward, at the largest count
    for overlap in (False, True):
        line = run_case("fixed_5ms", runs[-1], 20 if args.quick else 200, overlap, staggered=True)
        if serial is None:
            serial = line
        else:
            line["gap_vs_serial"] = round(line["gap_ms_p50"] / max(serial["gap_ms_p50"], 1e-9), 3)
        print(json.dumps(line), flush=True)
        lines.append(line)
    for forward in ("null", "fixed_5ms"):  # the served path, at the largest count
        for overlap in (False, True):
            streams, relay = (
                run_served(forward, runs[-1], 20 if args.quick else 200, form, overlap) for form in ("streams", "relay")
            )
            relay["relay_vs_streams"] = round(relay["period_ms_p50"] / max(streams["period_ms_p50"], 1e-9), 3)
            for line in (streams, relay):
                print(json.dumps(line), flush=True)
                lines.append(line)
    return lines


if __name__ == "__main__":
    main(sys.argv[1:])
