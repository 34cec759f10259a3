"""Outputs rebuilt from deltas equal the engine's own outputs, step by step."""

from __future__ import annotations

import asyncio
import pickle
from array import array

from cluster.ray.output_delta import OutputAssembler, OutputDelta
from pagefleet.llm import engine_config
from worker.engine.async_engine import AsyncEngine
from worker.engine.llm_engine import LLMEngine
from worker.protocol import GenerationRequest
from worker.sampling_params import SamplingParams


def test_deltas_rebuild_every_output():
    engine = AsyncEngine(LLMEngine(engine_config("builtin", num_blocks=64, max_model_len=256)))
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, stop=["zz"])
    assembler = OutputAssembler()
    request = GenerationRequest("A lighthouse on the rocks", params, request_id="r")

    async def run():
        first, steps = True, 0
        async for out in engine.generate(request):
            delta = OutputDelta.of(out, with_prompt=first)
            sent = pickle.loads(pickle.dumps(delta))  # as Ray carries it (`__reduce__`)
            assert sent == delta and sent is not delta
            rebuilt = assembler.apply(sent)
            first, steps = False, steps + 1
            # compared as each step arrives: later steps extend the same request's state
            assert rebuilt.token_ids == out.token_ids
            assert rebuilt.new_token_ids == out.new_token_ids
            assert rebuilt.prompt_token_ids == out.prompt_token_ids
            assert rebuilt.metrics.token_times == out.metrics.token_times
            assert [lp.token_id for lp in rebuilt.logprobs] == [lp.token_id for lp in out.logprobs]
        assert steps == 12
        return out, rebuilt

    try:
        last_out, last = asyncio.run(run())
    finally:
        engine.shutdown()
    assert last.finished and last.finish_reason == last_out.finish_reason
    assert last.text == last_out.text and last.metrics.ttft == last_out.metrics.ttft
    # a finished or dropped request leaves no state; late deltas for it are ignored
    assert assembler.apply(OutputDelta.of(last_out, with_prompt=False)) is None


def test_a_prompt_given_as_ids_is_not_sent_back():
    """When the receiving side gave the ids (`expect`), no delta carries them, and the outputs
    rebuilt are the engine's all the same."""
    engine = AsyncEngine(LLMEngine(engine_config("builtin", num_blocks=64, max_model_len=256)))
    params = SamplingParams(temperature=0, max_tokens=5)
    prompt = array("I", range(40, 80))
    assembler = OutputAssembler()
    assembler.expect("r", prompt)
    request = GenerationRequest(prompt, params, request_id="r")

    async def run():
        outs = []
        async for out in engine.generate(request):
            delta = OutputDelta.of(out, with_prompt=False)
            assert delta.prompt_token_ids is None
            rebuilt = assembler.apply(delta)  # compared as each step arrives, as above
            assert list(rebuilt.prompt_token_ids) == out.prompt_token_ids == list(range(40, 80))
            assert rebuilt.token_ids == out.token_ids and rebuilt.finished == out.finished
            assert rebuilt.metrics.arrival_time == out.metrics.arrival_time
            outs.append(out)
        return outs

    try:
        outs = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(outs) == 5 and assembler.apply(OutputDelta.of(outs[-1], False)) is None
