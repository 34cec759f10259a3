"""Overlapped decode steps (worker/exec/overlap.py) give the tokens of serial steps.

The same requests run on two engines of the built-in model, one with `overlap=True` (on CPU too,
with its forward thread) and one without; every request's tokens, text, finish reason and
logprobs must be equal, through what makes a forward run ahead useless: requests ending at
different lengths, stop strings, an abort, requests arriving while others decode, and a pool
so small that requests are preempted. The counters say that forwards did run ahead and were
adopted, and that some were discarded.
"""

from __future__ import annotations

import pytest

from pagefleet.llm import engine_config
from worker.engine.llm_engine import LLMEngine
from worker.sampling_params import SamplingParams


def make_engine(overlap: bool, **options) -> LLMEngine:
    opts = dict(num_blocks=120, max_num_seqs=8, max_model_len=256) | options
    return LLMEngine(engine_config("builtin", overlap=overlap, **opts))


def prompt(i: int, n: int) -> list[int]:
    return [(13 * i + 7 * j) % 900 + 5 for j in range(n)]


def drive(engine: LLMEngine, script) -> dict[str, tuple]:
    """Step the engine to the end; `script(step_no, engine)` adds or aborts requests between
    steps. Returns each request's (token ids, text, finish reason, logprobs)."""
    done: dict[str, tuple] = {}
    steps = 0
    while True:
        script(steps, engine)
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                lps = None if c.logprobs is None else [(lp.token_id, lp.logprob) for lp in c.logprobs]
                done[out.request_id] = (tuple(c.token_ids), c.text, c.finish_reason, lps)
        steps += 1
    return done


def mixed_script(steps: int, engine: LLMEngine) -> None:
    greedy = dict(temperature=0.0, ignore_eos=True)
    if steps == 0:
        for i in range(6):
            params = SamplingParams(max_tokens=20 + 9 * i, logprobs=2 if i == 1 else None, **greedy)
            engine.add_request(prompt(i, 12 + 5 * i), params, request_id=f"a{i}")
    if steps == 7:  # arrives while the others decode
        engine.add_request(prompt(9, 40), SamplingParams(max_tokens=25, **greedy), request_id="late")
    if steps == 12:
        engine.abort("a5")
    if steps == 30:  # ends on EOS or a stop string, whichever the random model says
        engine.add_request(
            prompt(11, 20),
            SamplingParams(max_tokens=40, temperature=0.0, stop=["e", " t"]),
            request_id="stops",
        )


def test_overlapped_steps_give_the_tokens_of_serial_steps():
    serial = drive(make_engine(False), mixed_script)
    engine = make_engine(True)
    overlapped = drive(engine, mixed_script)
    assert overlapped == serial
    assert set(serial) == {"a0", "a1", "a2", "a3", "a4", "late", "stops"}  # a5: aborted
    ahead = engine.executor.overlap
    assert ahead.confirmed > 20, (ahead.confirmed, ahead.discarded)
    assert ahead.discarded >= 1  # the late arrival, the abort or the stop


def test_forwards_run_ahead_across_block_boundaries():
    """Requests whose positions enter new blocks at different steps (one or another does in
    almost every step): the scheduler allocates each next block a step early, so that nearly
    every step's forward runs ahead and is adopted, and the tokens are the serial steps'."""

    def script(steps: int, engine: LLMEngine) -> None:
        if steps == 0:
            params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
            for i in range(8):  # prompts of 17, 19, ... 31 tokens: eight phases of 16
                engine.add_request(prompt(i, 17 + 2 * i), params, request_id=f"b{i}")

    serial = drive(make_engine(False), script)
    engine = make_engine(True)
    assert drive(engine, script) == serial
    assert engine.scheduler.lookahead == 1 and make_engine(False).scheduler.lookahead == 0
    ahead = engine.executor.overlap
    # 48 tokens: a prefill step, then 47 decodes, every one but the first two run ahead
    assert ahead.confirmed >= 44 and ahead.discarded == 0, (ahead.confirmed, ahead.discarded)


def test_preemption_and_seeded_sampling_give_the_same_tokens():
    """A pool that cannot hold every request (preemption, recompute) and seeded random rows
    (whose draw depends on the position, which the runner advances with each adopted step)."""

    def script(steps: int, engine: LLMEngine) -> None:
        if steps == 0:
            for i in range(6):
                params = SamplingParams(
                    max_tokens=40,
                    temperature=0.9 if i % 2 else 0.0,
                    seed=100 + i if i % 2 else None,
                    ignore_eos=True,
                )
                engine.add_request(prompt(i, 30), params, request_id=f"p{i}")

    small = dict(num_blocks=14, max_num_seqs=6, max_model_len=128)
    serial_engine = make_engine(False, **small)
    serial = drive(serial_engine, script)
    engine = make_engine(True, **small)
    assert drive(engine, script) == serial
    assert serial_engine.scheduler.num_preemptions > 0


def test_unseeded_random_batches_run_ahead():
    engine = make_engine(True)
    params = SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True)
    for i in range(4):
        engine.add_request(prompt(i, 10), params, request_id=f"u{i}")
    outs = drive(engine, lambda *_: None)
    assert all(len(o[0]) == 30 for o in outs.values())
    assert engine.executor.overlap.confirmed > 10


class Broken(Exception):
    pass


def test_a_failing_forward_is_raised_by_the_step_not_hung():
    engine = make_engine(True)
    model = engine.executor.worker.runner.model
    calls = 0

    def failing(*args):
        nonlocal calls
        calls += 1
        if calls == 6:  # a forward run ahead
            raise Broken("forward failed")
        return model(*args)

    engine.executor.worker.runner.model = failing
    failing.compute_logits = model.compute_logits
    engine.add_request(prompt(1, 10), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    with pytest.raises(Broken):
        for _ in range(20):
            engine.step()
    engine.executor.shutdown()


SCHEMA = {
    "type": "object",
    "properties": {"word": {"type": "string", "maxLength": 10}, "n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["word", "n"],
}
REGEX = "[a-z]{3,6}-[0-9]{2}"


def constrained_script(ignore_eos: bool, constrained: bool = True):
    """Eight requests, a quarter under a JSON Schema, greedy and seeded at temperature 1; then
    a regex-constrained one arriving while they decode, and an abort."""

    def script(steps: int, engine: LLMEngine) -> None:
        if steps == 0:
            if constrained:  # compiled first: each request joins its batch at the step it is added
                for so in ({"json": SCHEMA}, {"regex": REGEX}):
                    engine.grammars.compile(SamplingParams(structured_outputs=so).structured_outputs).result()
            for i in range(8):
                so = {"json": SCHEMA} if constrained and i % 4 == 0 else None
                seeded = dict(temperature=1.0, seed=40 + i) if i % 2 else dict(temperature=0.0)
                params = SamplingParams(max_tokens=24 + 3 * i, ignore_eos=ignore_eos, structured_outputs=so, **seeded)
                engine.add_request(prompt(i, 12 + 3 * i), params, request_id=f"m{i}")
        if steps == 9:
            so = {"regex": REGEX} if constrained else None
            params = SamplingParams(
                max_tokens=30, temperature=1.0, seed=7, ignore_eos=ignore_eos, structured_outputs=so
            )
            engine.add_request(prompt(20, 16), params, request_id="late")
        if steps == 15:
            engine.abort("m5")

    return script


def test_mixed_constrained_batches_run_ahead_with_the_serial_tokens():
    """Constrained rows beside unconstrained ones, greedy and seeded: each row's grammar and
    seeded position are advanced by the runner that samples, once a forward run ahead is
    adopted, so the tokens are the serial steps' and the outputs follow their constraints."""
    import json
    import re

    import jsonschema

    script = constrained_script(ignore_eos=False)
    serial = drive(make_engine(False), script)
    engine = make_engine(True)
    assert drive(engine, script) == serial
    for rid in ("m0", "m4"):
        if serial[rid][2] == "stop":  # (the grammar ended before max_tokens)
            jsonschema.validate(json.loads(serial[rid][1]), SCHEMA)
    assert serial["late"][2] != "stop" or re.fullmatch(REGEX, serial["late"][1])
    ahead = engine.executor.overlap
    assert ahead.confirmed > 20 and ahead.discarded >= 1, (ahead.confirmed, ahead.discarded)


def test_constrained_rows_do_not_stop_their_neighbours_running_ahead():
    """The same batch with and without its constraints (every request to max_tokens, so the
    steps are the same): as many forwards run ahead and are adopted either way."""
    free = make_engine(True)
    drive(free, constrained_script(ignore_eos=True, constrained=False))
    constrained = make_engine(True)
    drive(constrained, constrained_script(ignore_eos=True))
    counts = [(e.executor.overlap.confirmed, e.executor.overlap.discarded) for e in (free, constrained)]
    assert counts[0] == counts[1] and counts[0][0] > 30, counts
