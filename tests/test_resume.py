"""A request resumed on another engine after k of its tokens: the continuation equals the
undisturbed run, token for token and in text, greedy and seeded, with penalties, stop strings,
max_tokens and logprobs carried across."""

from __future__ import annotations

import pytest

from pagefleet.llm import engine_config
from worker.engine.llm_engine import LLMEngine
from worker.protocol import Resume
from worker.sampling_params import SamplingParams

PROMPT = "The lighthouse keeper wrote down every ship that passed the rocks at night."


@pytest.fixture(scope="module")
def engines():
    config = engine_config("builtin", num_blocks=128, max_model_len=512)
    return LLMEngine(config), LLMEngine(config)  # the group that dies, the one that resumes


def run(engine: LLMEngine, params: SamplingParams, resume: Resume | None = None) -> list:
    rid = engine.add_request(PROMPT, params, resume=resume)
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == rid]
    return outputs


CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True),
    "penalties": SamplingParams(
        temperature=0.8,
        seed=3,
        max_tokens=30,
        ignore_eos=True,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("cut", [1, 11, 29])
def test_a_resumed_request_continues_as_the_undisturbed_one(engines, case, cut):
    first, second = engines
    params = CASES[case]
    whole = run(first, params)
    done = whole[-1]
    assert len(done.token_ids) == 30
    before = whole[:cut]  # what streamed before the group died
    sent_text = "".join(o.new_text for o in before)
    sent = [t for o in before for t in o.new_token_ids]
    logprobs = tuple((before[-1].logprobs or ())[: len(sent)])  # (a list the engine extends)
    resume = Resume(tuple(sent), len(sent_text), logprobs)
    after = run(second, params, resume)
    assert [t for o in before + after for t in o.new_token_ids] == done.token_ids
    assert sent_text + "".join(o.new_text for o in after) == done.text
    last = after[-1]
    assert last.finished and last.finish_reason == "length" and last.token_ids == done.token_ids
    if params.logprobs is not None:
        assert [lp.token_id for lp in last.logprobs] == done.token_ids
        assert last.outputs[0].cumulative_logprob == pytest.approx(done.outputs[0].cumulative_logprob, rel=1e-5)


def test_a_stop_string_across_the_cut_ends_the_resumed_request(engines):
    first, second = engines
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    text = run(first, greedy)[-1].text
    stop = text[10:16]  # a stop string of six characters, likely spanning tokens
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    whole = run(first, params)
    assert whole[-1].finish_reason == "stop"
    cut = next(i for i, o in enumerate(whole) if len("".join(x.new_text for x in whole[: i + 1])) >= 8)
    before = whole[: cut + 1]
    sent = "".join(o.new_text for o in before)
    tokens = tuple(t for o in before for t in o.new_token_ids)
    after = run(second, params, Resume(tokens, len(sent)))
    assert sent + "".join(o.new_text for o in after) == whole[-1].text == text[:10]
    assert after[-1].finish_reason == "stop" and after[-1].stop_reason == stop
