"""`pagefleet.LLM` at vLLM's shape, on the built-in model: prompt forms, `RequestOutput` and
`CompletionOutput` fields, logprobs as {token id: Logprob}, `n` completions sharing the prompt's
blocks, `min_tokens`, and `chat` rendering the model's chat template."""

from __future__ import annotations

import math
import pickle
from dataclasses import replace

import pytest

from pagefleet import LLM, SamplingParams
from worker.outputs import CompletionOutput, Logprob, RequestOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
TEXT = "The library opens at nine in the morning and closes at six in the evening."


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin", num_blocks=128, max_model_len=512, block_size=16)


def test_outputs_have_vllms_fields(llm):
    out = llm.generate(TEXT, SamplingParams(temperature=0.0, max_tokens=6, logprobs=2))[0]
    assert isinstance(out, RequestOutput) and out.finished
    assert out.prompt == TEXT and out.prompt_token_ids == llm.get_tokenizer().encode(TEXT)
    (completion,) = out.outputs
    assert isinstance(completion, CompletionOutput) and completion.index == 0
    assert len(completion.token_ids) == 6 and completion.finished()
    assert completion.finish_reason == "length" and completion.stop_reason is None
    assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert out.num_cached_tokens == 0 and out.metrics.ttft > 0
    # each token's logprobs read as vLLM's {token id: Logprob}, the chosen token included
    for token, lp in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token in lp and isinstance(lp[token], Logprob) and lp[token].rank == 1  # greedy
        assert len(lp) in (2, 3) and all(lp[t].logprob <= lp[token].logprob for t in lp)
    chosen = zip(completion.token_ids, completion.logprobs, strict=True)
    assert math.isclose(completion.cumulative_logprob, sum(lp[t].logprob for t, lp in chosen))
    assert llm.generate(TEXT, GREEDY)[0].outputs[0].cumulative_logprob is None  # not asked


def test_prompt_forms_give_the_same_output(llm):
    ids = llm.tokenizer.encode(TEXT)
    forms = [TEXT, ids, {"prompt": TEXT}, {"prompt_token_ids": ids}]
    outs = llm.generate(forms, GREEDY)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == [TEXT, None, TEXT, None]
    with pytest.raises(ValueError, match="exactly one of 'prompt' or 'prompt_token_ids'"):
        llm.generate({"text": TEXT})


def test_n_completions_share_the_prompts_blocks(llm):
    prompt = TEXT * 3  # several full blocks
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8, n=3)
    before = llm.stats()["prefix_cache_hits"]
    (out,) = llm.generate(prompt, params)
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    tokens = [c.token_ids for c in out.outputs]
    assert len({tuple(t) for t in tokens}) == 3  # different draws
    full_blocks = (len(out.prompt_token_ids) - 1) // 16 * 16
    # the second and third completions reuse the first one's full prompt blocks
    assert llm.stats()["prefix_cache_hits"] - before >= 2 * full_blocks
    # completion i is the request with seed 7 + i
    for i, want in enumerate(tokens):
        single = SamplingParams(temperature=1.0, seed=7 + i, max_tokens=8)
        assert llm.generate(prompt, single)[0].outputs[0].token_ids == want
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, n=2))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_min_tokens_holds_back_stop_tokens_and_stop_strings(llm):
    def run(**options) -> CompletionOutput:
        params = SamplingParams(temperature=0.0, max_tokens=8, **options)
        return llm.generate(TEXT, params)[0].outputs[0]

    first = run()
    stop_token = first.token_ids[0]
    assert run(stop_token_ids=[stop_token]).token_ids == [stop_token]
    held = run(stop_token_ids=[stop_token], min_tokens=4).token_ids
    assert len(held) >= 4 and stop_token not in held[:4]
    word = first.text.strip().split()[0]  # a stop string that the first tokens' text contains
    assert run(stop=[word]).finish_reason == "stop"
    assert run(stop=[word], min_tokens=8).token_ids == first.token_ids  # no stop before 8


def test_chat_renders_the_template_for_one_or_many_conversations(llm):
    chat = [{"role": "user", "content": "When does the library open?"}]
    one = llm.chat(chat, GREEDY)
    many = llm.chat([chat, [{"role": "user", "content": "Where does the river run?"}]], GREEDY)
    want = llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert one[0].prompt == want and many[0].prompt == want and len(many) == 2
    assert one[0].prompt_token_ids == llm.tokenizer.encode(want, add_special_tokens=False)
    assert one[0].outputs[0].token_ids == many[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"messages\[0\] must have string 'role' and 'content'"):
        llm.chat([{"role": "user"}])


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"n": 0}, "SamplingParams.n"),
        ({"min_tokens": 9, "max_tokens": 8}, "SamplingParams.min_tokens"),
        ({"min_tokens": -1}, "SamplingParams.min_tokens"),
        ({"skip_special_tokens": "no"}, "SamplingParams.skip_special_tokens"),
    ],
)
def test_new_sampling_fields_are_checked(options, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**options)


def test_the_engine_runs_one_completion_per_request(llm):
    with pytest.raises(ValueError, match="SamplingParams.n=2"):
        llm.engine.add_request(TEXT, SamplingParams(n=2))


def test_a_steps_outputs_keep_that_steps_text_and_reason(llm):
    """The engine's per-step output is one object whose completion is made when first read:
    read later, an output still says what that step said (text, finish_reason, cumulative
    logprob), while `token_ids` and `logprobs` are the request's own growing lists (documented).
    `replace`, equality and pickling see the same fields as `outputs`."""
    engine = llm.engine
    engine.add_request(TEXT, SamplingParams(temperature=0.0, max_tokens=5, logprobs=1), request_id="s")
    steps = []
    while engine.has_unfinished():
        steps += engine.step()
    assert len(steps) == 5 and [o.finished for o in steps] == [False] * 4 + [True]
    texts = [o.text for o in steps]  # read after the last step
    ids, checked = steps[-1].token_ids, 0
    for i, text in enumerate(texts):  # each the text of that step's tokens, not the last's
        want = llm.tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
        if "\ufffd" not in want:  # (a character still incomplete is held back)
            assert text == want
            checked += 1
    assert checked >= 1 and len(set(texts)) > 1  # (live text would be the last, five times)
    for i, out in enumerate(steps):
        (c,) = out.outputs
        assert c is out.outputs[0]  # made once
        assert (c.text, c.finish_reason, c.stop_reason) == (texts[i], out.finish_reason, None)
        assert out.finish_reason == ("length" if i == 4 else None)
        assert c.token_ids is out.token_ids is steps[-1].token_ids  # the request's own list
        assert math.isclose(c.cumulative_logprob, sum(lp.logprob for lp in out.logprobs[: i + 1]))
        assert out.new_token_ids == [out.token_ids[i]] and out.new_logprobs[0].token_id == out.token_ids[i]
    last = steps[-1]
    assert pickle.loads(pickle.dumps(last)) == last
    moved = last.replace(num_cached_tokens=7)
    assert moved.num_cached_tokens == 7 and moved.outputs == last.outputs and moved != last
    assert moved.text == last.text and moved.finish_reason == "length"
    other = replace(last.outputs[0], text="other")
    assert last.replace(outputs=[other]).text == "other"  # shortcuts read `outputs` when given
    with pytest.raises(TypeError, match="no field"):
        last.replace(texts="x")
