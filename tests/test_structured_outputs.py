"""Structured outputs through `pagefleet.LLM` on the built-in model: JSON Schemas, JSON objects,
regexes, grammars and choices constrain what is sampled, greedy and at temperature 1, with n > 1,
logprobs from the masked distribution, stop strings, max_tokens, preemption, overlapped steps and
a resume; bad constraints are refused with the grammar engine's message.

The reference for the mask is transformers' logits on the same weights and xgrammar's own
matcher: each greedy token is the argmax of the model's logits over the tokens the grammar
allows after the tokens before it."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
import torch

from pagefleet import LLM, SamplingParams, StructuredOutputs
from pagefleet.llm import engine_config
from worker.engine.llm_engine import LLMEngine
from worker.protocol import Resume

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["reader", "teacher", "baker"]},
    },
    "required": ["name", "age", "role"],
}
PROMPTS = ["The library opens at nine", "A good question is short and clear", "Hello!"]


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin", num_blocks=256, max_model_len=512, block_size=16, dtype="float32")


def sampled(schema=None, seed=None, temperature=1.0, max_tokens=64, **constraint) -> SamplingParams:
    so = StructuredOutputs(json=schema) if schema is not None else StructuredOutputs(**constraint)
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, structured_outputs=so)


def test_json_schema_outputs_validate_at_temperature_one(llm):
    params = [sampled(PERSON, seed=s) for s in (0, 1, 2)]
    outs = llm.generate([p for p in PROMPTS for _ in params], params * len(PROMPTS))
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        value = json.loads(c.text)
        jsonschema.validate(value, PERSON)
        assert list(value) == ["name", "age", "role"]  # the schema's order


def test_n_completions_each_follow_the_schema(llm):
    (out,) = llm.generate(PROMPTS[0], SamplingParams(n=3, seed=5, max_tokens=64, structured_outputs={"json": PERSON}))
    texts = [c.text for c in out.outputs]
    for t in texts:
        jsonschema.validate(json.loads(t), PERSON)
    assert len(set(texts)) > 1  # seeds 5, 6, 7 differ


def test_seeded_constrained_runs_reproduce(llm):
    params = sampled(PERSON, seed=11)
    first = llm.generate(PROMPTS, params)
    again = llm.generate(PROMPTS[::-1], params)[::-1]  # other neighbours, other order
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]


def test_regex_choice_grammar_and_json_object(llm):
    regex = r"[a-z]{2,5}-\d{3}"
    outs = llm.generate(PROMPTS, [sampled(seed=s, regex=regex) for s in range(3)])
    assert all(re.fullmatch(regex, o.outputs[0].text) for o in outs), [o.outputs[0].text for o in outs]
    choices = ["yes", "no", 'say "maybe"']
    outs = llm.generate(PROMPTS * 2, [sampled(seed=s, choice=choices) for s in range(6)])
    assert {o.outputs[0].text for o in outs} <= set(choices)
    grammar = 'root ::= "(" item ("," item){0,2} ")"\nitem ::= [0-9] | "x"'
    outs = llm.generate(PROMPTS, [sampled(seed=s, grammar=grammar) for s in range(3)])
    assert all(re.fullmatch(r"\((\d|x)(,(\d|x)){0,2}\)", o.outputs[0].text) for o in outs)
    outs = llm.generate(PROMPTS, [sampled(seed=s, json_object=True, max_tokens=200) for s in range(3)])
    for o in outs:
        if o.outputs[0].finish_reason == "stop":  # (a random model may write a long object)
            assert isinstance(json.loads(o.outputs[0].text), dict)
        assert o.outputs[0].text.startswith("{")


def test_greedy_tokens_are_the_argmax_over_the_allowed_ones(llm):
    """transformers' logits, teacher-forced on the engine's tokens, and an xgrammar matcher of
    our own: each token is the best the grammar allows, and a logprob reported is a share of
    the allowed tokens only (the masked distribution sums to 1 over them)."""
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=96, logprobs=5, structured_outputs={"json": PERSON})
    (out,) = llm.generate(PROMPTS[1], params)
    c = out.outputs[0]
    jsonschema.validate(json.loads(c.text), PERSON)
    model = AutoModelForCausalLM.from_pretrained(engine.config.model, dtype=torch.float32)
    ids = torch.tensor([[*out.prompt_token_ids, *c.token_ids]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(out.prompt_token_ids) - 1 :]  # (len(c) + 1, vocab)
    matcher = xgr.GrammarMatcher(engine.grammars.compile(params.structured_outputs).result())
    bitmask = xgr.allocate_token_bitmask(1, logits.shape[1])
    for i, token in enumerate(c.token_ids):
        matcher.fill_next_token_bitmask(bitmask)
        row = logits[i : i + 1].clone()
        xgr.apply_token_bitmask_inplace(row, bitmask)
        assert token == int(row.argmax()), i
        lps = c.logprobs[i]
        allowed = torch.log_softmax(row[0], -1)
        assert math.isclose(lps[token].logprob, float(allowed[token]), abs_tol=1e-3)
        assert all(math.isfinite(lp.logprob) or lp.logprob == -math.inf for lp in lps.values())
        assert matcher.accept_token(token)
    assert matcher.is_terminated()  # the last token was EOS


def test_stop_strings_and_max_tokens_cut_the_output(llm):
    (cut,) = llm.generate(PROMPTS[0], sampled(PERSON, seed=1, max_tokens=4))
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) == 4
    (full,) = llm.generate(PROMPTS[0], sampled(PERSON, seed=1))
    assert full.outputs[0].text.startswith(cut.outputs[0].text)
    params = SamplingParams(seed=1, max_tokens=64, stop=[","], structured_outputs={"json": PERSON})
    (stopped,) = llm.generate(PROMPTS[0], params)
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == ","
    assert stopped.outputs[0].text == full.outputs[0].text.split(",")[0]


def test_bad_constraints_name_the_field():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputs(json=PERSON, regex="a")
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="StructuredOutputs.json is not valid JSON"):
        StructuredOutputs(json="{nope")
    with pytest.raises(ValueError, match=r"StructuredOutputs.choice\[1\]"):
        StructuredOutputs(choice=["a", ""])
    with pytest.raises(ValueError, match="at most 65536 allowed"):
        StructuredOutputs(grammar="root ::= " + '"a" | ' * 20000 + '"b"')
    with pytest.raises(ValueError, match="structured_outputs has unknown field"):
        SamplingParams(structured_outputs={"jsn": {}})


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        ({"regex": "a(b"}, r"StructuredOutputs.regex is refused: .*parenthesis is not closed"),
        ({"json": {"type": "frobnicate"}}, r"StructuredOutputs.json is refused: Unsupported type"),
        ({"grammar": "root ::= item"}, r"StructuredOutputs.grammar is refused: .*Rule \"item\" is not defined"),
    ],
)
def test_refused_constraints_carry_the_engines_message(llm, constraint, message):
    params = SamplingParams(max_tokens=8, structured_outputs=constraint)
    for _ in range(2):  # compiled, then from the cache of refusals
        with pytest.raises(ValueError, match=message) as e:
            llm.generate(PROMPTS[0], params)
        assert "/project/" not in str(e.value)  # no source location of the grammar engine
    assert not llm.engine.has_unfinished()
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=2)) is not None  # the engine goes on


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], resume=None) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id=rid, resume=(resume or {}).get(rid))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        assert not engine.take_failures()
    return done


def mixed_requests(tok) -> dict[str, tuple[list[int], SamplingParams]]:
    """Constrained and unconstrained requests, greedy and seeded, in one batch."""
    reqs = {}
    for i in range(6):
        ids = tok.encode(PROMPTS[i % 3] + " " * i)
        so = {"json": PERSON} if i % 2 == 0 else None
        params = SamplingParams(temperature=0 if i < 3 else 1, seed=i, max_tokens=80, structured_outputs=so)
        reqs[f"r{i}"] = (ids, params)
    return reqs


def test_overlap_preemption_and_resume_keep_the_tokens(llm):
    tok = llm.tokenizer
    reqs = mixed_requests(tok)
    serial = run(LLMEngine(engine_config("builtin", num_blocks=128, max_model_len=512)), reqs)
    for i in (0, 2, 4):
        jsonschema.validate(json.loads(tok.decode(serial[f"r{i}"], skip_special_tokens=True)), PERSON)
    overlapped = LLMEngine(engine_config("builtin", num_blocks=128, max_model_len=512, overlap=True))
    assert run(overlapped, reqs) == serial
    assert overlapped.executor.overlap.confirmed > 20  # constrained and seeded rows ran ahead
    tight = LLMEngine(engine_config("builtin", num_blocks=40, block_size=4, max_model_len=112))
    assert run(tight, reqs) == serial and tight.scheduler.num_preemptions > 0
    # a resume of each request after its first 7 tokens goes on as the undisturbed run did
    resume = {rid: Resume(tuple(serial[rid][:7])) for rid in reqs}
    resumed = run(LLMEngine(engine_config("builtin", num_blocks=128, max_model_len=512)), reqs, resume)
    assert resumed == serial


def test_a_resume_off_the_grammar_is_refused(llm):
    engine = llm.engine
    params = sampled(PERSON, seed=0)
    engine.grammars.compile(params.structured_outputs).result()  # compiled: refused at once
    bad = Resume(tuple(llm.tokenizer.encode("hello")))
    with pytest.raises(ValueError, match=r"resume.token_ids\[0\] .* does not follow the request's structured output"):
        engine.add_request(llm.tokenizer.encode(PROMPTS[0]), params, request_id="off", resume=bad)
    assert not engine.has_unfinished()


def test_a_suite_of_schemas_validates_at_temperature_one_with_three_seeds(llm):
    """tests/structured_schemas.py: every output of every schema, 3 seeds each, parses and
    validates (the built-in model; bounded schemas, so each ends within max_tokens)."""
    from tests.structured_schemas import SCHEMAS

    params = [sampled(schema, seed=seed, max_tokens=160) for schema in SCHEMAS for seed in range(3)]
    outs = llm.generate([PROMPTS[i % 3] for i in range(len(params))], params)
    for i, out in enumerate(outs):
        c, schema = out.outputs[0], SCHEMAS[i // 3]
        assert c.finish_reason == "stop", (i // 3, schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
