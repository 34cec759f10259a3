"""The engine's own time per decode step: what a GPU would wait on between two forwards.

    python -m benchmarks.step_overhead
    python -m benchmarks.step_overhead --quick      # fewer steps (smoke)

The built-in model's forward is replaced by one that does no work (`null`: zeros for the
hidden states and the logits) or that only waits a fixed time (`fixed_5ms`, as a GPU's forward
of a small model would take, the CPU free meanwhile), so that what remains of a step is the
engine's: scheduling, block tables, input preparation, sampling and its bookkeeping,
detokenizing, output processing. With 1, 64 and 256 requests decoding, after their prefill:

- overhead_ms: a step's wall time less its forward's, p50 and p99;
- gap_ms: from the end of one forward to the start of the next, p50 and p99 (with a fixed-time
  forward the engine does not yet prepare step N+1 during step N's forward, so the gap is the
  overhead).

One JSON line per (forward, running) case. The goals: overhead <= 0.5 ms at 256
running; gap <= 0.1 ms p50 at 256 with a 5 ms forward, which needs the overlap.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch

from pagefleet.llm import engine_config
from worker.engine.llm_engine import LLMEngine
from worker.sampling_params import SamplingParams

PROMPT = 16  # tokens: one block


class TimedForward:
    """Stands for the model in the runner: no work (or a fixed wait), timed."""

    def __init__(self, hidden_size: int, vocab_size: int, wait_s: float) -> None:
        self.hidden_size, self.vocab, self.wait_s = hidden_size, vocab_size, wait_s
        self.spans: list[tuple[float, float]] = []

    def __call__(self, input_ids, positions, meta):
        start = time.perf_counter()
        if self.wait_s:
            time.sleep(self.wait_s)
        out = torch.zeros(len(input_ids), self.hidden_size)
        self.spans.append((start, time.perf_counter()))
        return out

    def compute_logits(self, hidden):
        return torch.zeros(hidden.shape[0], self.vocab)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 3)


def run_case(forward: str, running: int, steps: int) -> dict:
    engine = LLMEngine(engine_config(
        "builtin", num_blocks=running * (2 + (PROMPT + steps) // 16) + 16, max_num_seqs=running,
        max_num_batched_tokens=max(2048, running * PROMPT), max_model_len=PROMPT + steps + 64,
    ))  # fmt: skip
    gc.collect()
    gc.freeze()  # as a server does once loaded (router/serve.py: freeze_heap)
    runner = engine.executor.worker.runner
    mc = engine.model_config
    timed = TimedForward(mc.hidden_size, mc.vocab_size, 0.005 if forward == "fixed_5ms" else 0.0)
    runner.model = timed
    params = SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True)
    for i in range(running):
        engine.add_request(
            [(7 * i + j) % 200 + 1 for j in range(PROMPT)], params, request_id=f"r{i}"
        )
    while engine.scheduler.waiting or any(  # until every request is past its prefill
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    timed.spans.clear()
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    spans = timed.spans
    assert len(spans) == steps and all(len(r.output_token_ids) > 0 for r in engine.scheduler.running)  # fmt: skip
    overhead = [w - (end - start) for w, (start, end) in zip(walls, spans, strict=True)]
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:], strict=False)]
    return {
        "bench": "step_overhead", "forward": forward, "running": running, "steps": steps,
        "overhead_ms_p50": pct(overhead, 0.5), "overhead_ms_p99": pct(overhead, 0.99),
        "gap_ms_p50": pct(gaps, 0.5), "gap_ms_p99": pct(gaps, 0.99),
        "overlap": False,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps (smoke)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    lines = []
    for forward in ("null", "fixed_5ms"):
        for running in (1, 64, 256):
            line = run_case(forward, running, 20 if args.quick else 200)
            print(json.dumps(line), flush=True)
            lines.append(line)
    return lines


if __name__ == "__main__":
    main(sys.argv[1:])
