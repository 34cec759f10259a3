"""The cost of structured outputs on the engine: decode throughput with constrained rows, serial
and run ahead, the mask's time per step, time to first token with a schema never seen before,
and the validity of outputs over the schema suite on a real model.

    python -m benchmarks.structured                 # the default model (SmolLM2-135M), CPU
    python -m benchmarks.structured --validity      # and the validity suite on that model
    python -m benchmarks.structured --model builtin --steps 4 --rounds 1    # smoke

Cases, one JSON line each:
- `decode`: 32 requests decoding together at temperature 1 (seeded), of which 0, 8 or 32
  follow a JSON Schema (a string of 60-80 characters, so that no row's grammar ends within the
  measured steps), on an engine with overlap off (`serial`) and one with it on (`overlap`: the
  next step's forward runs ahead, worker/exec/overlap.py). The cases are interleaved: each of
  `--rounds` rounds runs every (engine, constrained) pair once, so load that drifts across the
  run falls on every case alike. Figures are medians over the rounds: tok_per_s over `--steps`
  decode steps once every row has its first token; mask_ms_per_step the sampler's time filling
  and applying the masks (worker/exec/sampler.py: `mask_seconds`) and mask_fill_ms_per_step the
  filling's part, which runs beside the forward (`ModelRunner.start_masks`); vs_unconstrained
  the median over rounds of each round's ratio to the same engine's 0-constrained batch; ahead
  the share of steps whose forward ran ahead and was adopted.
- `ttft`: one request alone, with a schema new to the engine (compiled while it waits) and
  unconstrained, alternately; the median of `--repeats`, and the ratio. The grammar engine's
  tokenizer tables are built once per engine, by a first constrained request before the timing.
- `validity` (with `--validity`): every schema of tests/structured_schemas.py, 3 seeds each at
  temperature 1, and regexes and choices, through the model: how many outputs parse and
  validate (`jsonschema`) or match.
- `backends` (with `--backends`): xgrammar, the engine's grammar engine, against llguidance
  (the `bench` extra) on the schema suite: compile time and one step's mask time at batch 32.
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
MIXED = (0, 8, 32)  # constrained rows of the batch, per case
LONG = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 60, "maxLength": 80}},
    "required": ["text"],
}
PROMPT = "Write a short note about the library, the river and the old mill. Note {}:"


def decode_case(engine: LLMEngine, constrained: int, steps: int) -> dict:
    """Figures of `steps` decode steps of BATCH rows, `constrained` of them under LONG."""
    sampler = engine.executor.worker.runner.sampler
    overlap = engine.executor.overlap
    tag = f"c{constrained}-{time.perf_counter_ns()}"
    for i in range(BATCH):
        so = {"json": LONG} if i < constrained else None
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=steps + 8, ignore_eos=True, structured_outputs=so)
        engine.add_request(PROMPT.format(i), params, request_id=f"{tag}-{i}")
    started = set()
    while len(started) < BATCH:  # prefill, until every row has its first token
        started |= {o.request_id for o in engine.step()}
    mask0, fill0 = sampler.mask_seconds, sampler.mask_fill_seconds
    ahead0 = overlap.confirmed if overlap is not None else 0
    t0 = time.perf_counter()
    for _ in range(steps):
        assert len(engine.step()) == BATCH
    seconds = time.perf_counter() - t0
    engine.abort([f"{tag}-{i}" for i in range(BATCH)])
    return {
        "tok_per_s": BATCH * steps / seconds,
        "step_ms": 1e3 * seconds / steps,
        "mask_ms_per_step": 1e3 * (sampler.mask_seconds - mask0) / steps,
        "mask_fill_ms_per_step": 1e3 * (sampler.mask_fill_seconds - fill0) / steps,
        "ahead": ((overlap.confirmed if overlap is not None else 0) - ahead0) / steps,
    }


def decode_cases(engines: dict[str, LLMEngine], steps: int, rounds: int) -> list[dict]:
    """Every (engine, constrained) pair once a round, interleaved; medians over the rounds."""
    runs: dict[tuple[str, int], list[dict]] = {(m, c): [] for m in engines for c in MIXED}
    for _ in range(rounds):
        for constrained in MIXED:
            for mode, engine in engines.items():
                runs[mode, constrained].append(decode_case(engine, constrained, steps))
    lines = []
    for (mode, constrained), got in runs.items():
        base = runs[mode, 0]
        med = {k: statistics.median(r[k] for r in got) for k in got[0]}
        ratios = [r["tok_per_s"] / b["tok_per_s"] for r, b in zip(got, base, strict=True)]
        lines.append(
            {
                "case": "decode",
                "engine": mode,
                "batch": BATCH,
                "constrained": constrained,
                "steps": steps,
                "rounds": rounds,
                "tok_per_s": round(med["tok_per_s"], 1),
                "step_ms": round(med["step_ms"], 2),
                "mask_ms_per_step": round(med["mask_ms_per_step"], 3),
                "mask_fill_ms_per_step": round(med["mask_fill_ms_per_step"], 3),
                "mask_share": round(med["mask_ms_per_step"] / med["step_ms"], 4),
                "ahead": round(med["ahead"], 3),
                "vs_unconstrained": round(statistics.median(ratios), 3),
                "vs_unconstrained_min_max": [round(min(ratios), 3), round(max(ratios), 3)],
            }
        )
    return lines


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


def make_engine(model: str | None, overlap: bool) -> LLMEngine:
    return LLMEngine(engine_config(model, max_num_seqs=BATCH, max_model_len=1024, num_blocks=1024, overlap=overlap))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory, .gguf, 'builtin' (default: the default model)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--validity", action="store_true", help="also the validity suite on the model")
    ap.add_argument("--backends", action="store_true", help="also xgrammar against llguidance")
    args = ap.parse_args()
    engines = {"serial": make_engine(args.model, False), "overlap": make_engine(args.model, True)}
    for engine in engines.values():
        first_token_s(engine, SamplingParams(max_tokens=2, structured_outputs={"json": LONG}), "warm")  # tables
        decode_case(engine, BATCH // 4, 2)  # warm the batch's code paths
    for line in decode_cases(engines, args.steps, args.rounds):
        print(json.dumps(line), flush=True)
    print(json.dumps(ttft_case(engines["serial"], args.repeats)), flush=True)
    if args.validity:
        from benchmarks.structured_validity import validity_case

        print(json.dumps(validity_case(engines["serial"])), flush=True)
    if args.backends:
        from benchmarks.structured_backends import backends_case

        print(json.dumps(backends_case(engines["serial"])), flush=True)


if __name__ == "__main__":
    main()
