"""The cost of structured outputs on the engine: decode throughput with constrained rows, the
mask's time per step, and time to first token with a schema never seen before.

    python -m benchmarks.structured                 # the default model (SmolLM2-135M), CPU
    python -m benchmarks.structured --model builtin --steps 8    # smoke

Cases, one JSON line each:
- `decode`: 32 requests decoding together, of which 0, 8 or 32 follow a JSON Schema (a string
  of 60-80 characters, so that no row's grammar ends within the measured steps); tok_per_s over
  `--steps` decode steps once every row has its first token, mask_ms_per_step the sampler's
  time filling and applying the masks (worker/exec/sampler.py: `mask_seconds`), and
  vs_unconstrained the same run's ratio to the 0-constrained batch.
- `ttft`: one request alone, with a schema new to the engine (compiled while it waits) and
  unconstrained; the median of `--repeats`, and the ratio. The grammar engine's tokenizer
  tables are built once per engine, by a first constrained request before the timing.
Goals: constrained rows cost <= 10% of step time at batch 32, unconstrained neighbours <= 3%;
TTFT with a new schema <= 1.5x an unconstrained one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagefleet.llm import engine_config
from worker.engine.llm_engine import LLMEngine
from worker.sampling_params import SamplingParams

BATCH = 32
LONG = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 60, "maxLength": 80}},
    "required": ["text"],
}
PROMPT = "Write a short note about the library, the river and the old mill. Note {}:"


def decode_case(engine: LLMEngine, constrained: int, steps: int) -> dict:
    """tok/s and mask time of `steps` decode steps of BATCH rows, `constrained` of them under LONG."""
    sampler = engine.executor.worker.runner.sampler
    for i in range(BATCH):
        so = {"json": LONG} if i < constrained else None
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=steps + 8, ignore_eos=True, structured_outputs=so)
        engine.add_request(PROMPT.format(i), params, request_id=f"c{constrained}-{i}")
    started = set()
    while len(started) < BATCH:  # prefill, until every row has its first token
        started |= {o.request_id for o in engine.step()}
    mask0, t0 = sampler.mask_seconds, time.perf_counter()
    for _ in range(steps):
        assert len(engine.step()) == BATCH
    seconds = time.perf_counter() - t0
    mask = sampler.mask_seconds - mask0
    engine.abort([f"c{constrained}-{i}" for i in range(BATCH)])
    return {
        "case": "decode",
        "batch": BATCH,
        "constrained": constrained,
        "steps": steps,
        "tok_per_s": round(BATCH * steps / seconds, 1),
        "step_ms": round(1e3 * seconds / steps, 2),
        "mask_ms_per_step": round(1e3 * mask / steps, 3),
        "mask_share": round(mask / seconds, 4),
    }


def first_token_s(engine: LLMEngine, params: SamplingParams, rid: str) -> float:
    engine.add_request(PROMPT.format(rid), params, request_id=rid)
    while True:
        for out in engine.step():
            if out.request_id == rid:
                engine.abort(rid)
                return out.metrics.ttft


def ttft_case(engine: LLMEngine, repeats: int) -> dict:
    free, fresh = [], []
    for r in range(repeats):
        free.append(first_token_s(engine, SamplingParams(max_tokens=2), f"free-{r}"))
        schema = {**LONG, "title": f"schema {r}", "properties": {**LONG["properties"], f"n{r}": {"type": "integer"}}}
        params = SamplingParams(max_tokens=2, structured_outputs={"json": schema})
        fresh.append(first_token_s(engine, params, f"fresh-{r}"))
    a, b = statistics.median(free), statistics.median(fresh)
    return {
        "case": "ttft",
        "repeats": repeats,
        "unconstrained_ms": round(1e3 * a, 2),
        "new_schema_ms": round(1e3 * b, 2),
        "new_schema_vs_unconstrained": round(b / a, 3),
        "compiled": engine.grammars.compiled,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory, .gguf, 'builtin' (default: the default model)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    engine = LLMEngine(engine_config(args.model, max_num_seqs=BATCH, max_model_len=1024, num_blocks=1024))
    first_token_s(engine, SamplingParams(max_tokens=2, structured_outputs={"json": LONG}), "warm")  # tables
    decode_case(engine, 0, 2)  # warm the batch's code paths
    base = None
    for constrained in (0, 8, 32):
        line = decode_case(engine, constrained, args.steps)
        base = base or line["tok_per_s"]
        line["vs_unconstrained"] = round(line["tok_per_s"] / base, 3)
        print(json.dumps(line), flush=True)
    print(json.dumps(ttft_case(engine, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
