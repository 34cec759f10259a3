"""Structured outputs in a tensor-parallel group: rank 0 samples under the mask, as it samples
today, so a TP=2 group on Ray gives the tokens of one device, and they validate."""

from __future__ import annotations

import json

import jsonschema

from pagefleet import LLM, SamplingParams

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
}
OPTIONS = dict(num_blocks=128, max_model_len=256, dtype="float32")


def test_tp2_constrained_tokens_equal_one_devices(ray_runtime):
    prompts = ["The river runs", "Hello!", "A good question"]
    params = [
        SamplingParams(temperature=t, seed=s, max_tokens=64, structured_outputs={"json": PERSON})
        for t, s in ((0.0, None), (1.0, 3), (1.0, 4))
    ]
    one = [o.outputs[0] for o in LLM("builtin", **OPTIONS).generate(prompts, params)]
    tp = LLM("builtin", tensor_parallel_size=2, **OPTIONS)
    try:
        two = [o.outputs[0] for o in tp.generate(prompts, params)]
    finally:
        tp.shutdown()
    assert [c.token_ids for c in two] == [c.token_ids for c in one]
    for c in two:
        jsonschema.validate(json.loads(c.text), PERSON)
