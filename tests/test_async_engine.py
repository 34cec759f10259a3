"""The built-in model (with its tokenizer) through the synchronous and the streaming APIs."""

from __future__ import annotations

import asyncio

import pytest

from pagefleet.llm import LLM, engine_config
from worker.engine.async_engine import AsyncEngine
from worker.engine.llm_engine import LLMEngine
from worker.protocol import GenerationRequest
from worker.sampling_params import SamplingParams

DOC = "The lighthouse keeper wrote down every ship that passed the rocks at night. " * 3


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin", num_blocks=128, max_model_len=512)


def test_text_prompts_and_stop_strings(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate(DOC, greedy)[0]
    assert full.text and full.text == llm.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip(), "pick a visible stop string"
    cut = llm.generate(DOC, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    kept = llm.generate(
        DOC,
        SamplingParams(
            temperature=0,
            max_tokens=24,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
    )[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]
    assert llm.stats()["blocks_free"] == llm.stats()["blocks_total"]


def test_streaming_equals_generate_and_cancel_frees_blocks(llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = llm.generate(DOC + "Who kept the light?", params)[0]
    engine = AsyncEngine(LLMEngine(engine_config("builtin", num_blocks=128, max_model_len=512)))

    async def stream(prompt, p, rid):
        tokens, text, last = [], "", None
        async for out in engine.generate(GenerationRequest(prompt, p, request_id=rid)):
            tokens += out.new_token_ids
            text += out.new_text
            last = out
        return tokens, text, last

    async def cancel_midway():
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        task = asyncio.create_task(stream(DOC, long, "to-cancel"))
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            s = engine.stats()
            if s["running"] == 0 and s["blocks_free"] == s["blocks_total"]:
                return s
            await asyncio.sleep(0.01)
        raise AssertionError(f"blocks not freed after cancel: {engine.stats()}")

    async def main():
        (t1, x1, last1), (t2, _, _) = await asyncio.gather(
            stream(DOC + "Who kept the light?", params, "a"),
            stream("Another question", params, "b"),
        )
        assert t1 == want.token_ids and x1 == want.text and last1.finished
        assert len(t2) == 16
        await cancel_midway()
        with pytest.raises(ValueError, match="empty"):
            await stream([], params, "bad")

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_submit_relays_what_generate_streams():
    """`submit` (a callback per output on the caller's loop, a step's outputs in one wake-up)
    passes the same outputs as `generate` streams, ends at the finished one, passes a bad
    request's error instead, and an abort's final output ("abort") ends an aborted one."""
    engine = AsyncEngine(LLMEngine(engine_config("builtin", num_blocks=128, max_model_len=512)))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = {"a": DOC + "Who kept the light?", "b": "Another question", "c": DOC}

    async def streamed(rid):
        outs = []
        async for out in engine.generate(GenerationRequest(prompts[rid], params, request_id=rid)):
            outs.append((out.new_token_ids, out.new_text, out.finished, out.text))
        return outs

    async def relayed():
        loop = asyncio.get_running_loop()
        got: dict[str, list] = {"a": [], "b": [], "c": [], "bad": []}
        ended = {rid: loop.create_future() for rid in got}

        def relay_to(rid):
            def relay(item):
                assert asyncio.get_running_loop() is loop  # (on the caller's loop)
                got[rid].append(item)
                if isinstance(item, BaseException) or item.finished:
                    ended[rid].set_result(None)

            return relay

        for rid in ("a", "b", "c"):
            assert engine.submit(GenerationRequest(prompts[rid], params, request_id=rid), relay_to(rid)) == rid
        with pytest.raises(ValueError, match="in use"):  # (until its last output, an id is held)
            engine.submit(GenerationRequest("x", params, request_id="c"), relay_to("c"))
        engine.submit(GenerationRequest([], params, request_id="bad"), relay_to("bad"))
        await asyncio.gather(*ended.values())
        return got

    async def aborted():
        loop = asyncio.get_running_loop()
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        outs, done = [], loop.create_future()

        def relay(out):
            outs.append(out)
            if out.finished:
                done.set_result(None)

        engine.submit(GenerationRequest(DOC, long, request_id="long"), relay)
        while not outs:
            await asyncio.sleep(0.01)
        engine.abort("long")
        await done
        return outs

    async def main():
        want = {rid: await streamed(rid) for rid in ("a", "b", "c")}
        got = await relayed()
        return want, got, await aborted()

    try:
        want, got, outs = asyncio.run(main())
        assert engine.num_in_flight == 0  # (every entry ended with its last output)
    finally:
        engine.shutdown()
    for rid in ("a", "b", "c"):
        assert [(o.new_token_ids, o.new_text, o.finished, o.text) for o in got[rid]] == want[rid]
        assert len(want[rid]) == 12 and want[rid][-1][2]
    (error,) = got["bad"]
    assert isinstance(error, ValueError) and "empty" in str(error)
    assert outs[-1].finished and outs[-1].finish_reason == "abort" and len(outs) < 400


def test_a_failing_receiver_costs_only_its_own_outputs(caplog):
    """A step's outputs reach a loop together; a receiver that raises is logged, and the others
    of the same steps still get every output to their last."""
    engine = AsyncEngine(LLMEngine(engine_config("builtin", num_blocks=64, max_model_len=256)))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def main():
        loop = asyncio.get_running_loop()
        got, done = [], loop.create_future()

        def broken(out):
            raise RuntimeError("receiver down")

        def fine(out):
            got.append(out)
            if out.finished:
                done.set_result(None)

        engine.submit(GenerationRequest("same step", params, request_id="broken"), broken)
        engine.submit(GenerationRequest("same step", params, request_id="fine"), fine)
        await asyncio.wait_for(done, 60)
        return got

    try:
        got = asyncio.run(main())
        assert engine.num_in_flight == 0
    finally:
        engine.shutdown()
    assert len(got) == 6 and got[-1].finished
    assert "the receiver of 'broken' failed" in caplog.text
