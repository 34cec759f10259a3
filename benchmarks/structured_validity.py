"""The validity suite of structured outputs on a real model: every JSON Schema of
tests/structured_schemas.py, sampled at temperature 1 with 3 seeds, must parse and validate
(`jsonschema`); regexes and choices must match. Too slow for the test suite on the default
model (tests/test_structured_outputs.py runs it on the built-in one), so it is a case of
benchmarks/structured.py (`--validity`), or alone:

    python -m benchmarks.structured_validity            # the default model
"""

from __future__ import annotations

import argparse
import json
import re
import time

import jsonschema

from pagefleet.llm import engine_config
from tests.structured_schemas import SCHEMAS
from worker.engine.llm_engine import LLMEngine
from worker.sampling_params import SamplingParams

SEEDS = (0, 1, 2)
PROMPT = "Answer in JSON only. Describe item {} of a library's catalogue:"
REGEXES = (
    r"[a-z]{2,5}-\d{3}",
    r"(yes|no), because [a-z ]{1,20}\.",
    r"\d{4}-\d{2}-\d{2}",
    r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8})?",
)
CHOICES = (("positive", "negative", "neutral"), ("red", "green", "blue", 'a "quoted" one'))


def _requests() -> list[tuple[str, dict, object]]:
    """(kind, constraint, what the output must satisfy) for every request of the suite."""
    reqs = [("json", {"json": s}, s) for s in SCHEMAS for _ in SEEDS]
    reqs += [("regex", {"regex": r}, r) for r in REGEXES for _ in SEEDS]
    reqs += [("choice", {"choice": list(c)}, c) for c in CHOICES for _ in SEEDS]
    return reqs


def _valid(kind: str, text: str, want: object) -> bool:
    if kind == "regex":
        return re.fullmatch(want, text) is not None
    if kind == "choice":
        return text in want
    try:
        jsonschema.validate(json.loads(text), want)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def validity_case(engine: LLMEngine, max_tokens: int = 200) -> dict:
    """Every request of the suite through `engine`, batched; the counts that finished and matched."""
    reqs = _requests()
    for i, (_, constraint, _) in enumerate(reqs):
        params = SamplingParams(
            temperature=1.0, seed=SEEDS[i % len(SEEDS)], max_tokens=max_tokens, structured_outputs=constraint
        )
        engine.add_request(PROMPT.format(i), params, request_id=f"valid-{i}")
    t0, done, tokens = time.perf_counter(), {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += 1
            if out.finished:
                done[out.request_id] = out.outputs[0]
        failed = engine.take_failures()
        assert not failed, failed
    seconds = time.perf_counter() - t0
    counts: dict[str, list[int]] = {}  # kind -> [outputs, finished by the grammar, valid]
    invalid = []
    for i, (kind, _, want) in enumerate(reqs):
        c = done[f"valid-{i}"]
        got = counts.setdefault(kind, [0, 0, 0])
        got[0] += 1
        got[1] += c.finish_reason == "stop"
        ok = _valid(kind, c.text, want)
        got[2] += ok
        if not ok:
            invalid.append({"kind": kind, "finish": c.finish_reason, "text": c.text[:120]})
    return {
        "case": "validity",
        "schemas": len(SCHEMAS),
        "seeds": len(SEEDS),
        "temperature": 1.0,
        "max_tokens": max_tokens,
        **{f"{k}_outputs_finished_valid": v for k, v in counts.items()},
        "invalid": invalid[:5],
        "tok_per_s": round(tokens / seconds, 1),
        "seconds": round(seconds, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory, .gguf, 'builtin' (default: the default model)")
    args = ap.parse_args()
    engine = LLMEngine(engine_config(args.model, max_num_seqs=32, max_model_len=1024, num_blocks=1024))
    print(json.dumps(validity_case(engine)), flush=True)


if __name__ == "__main__":
    main()
