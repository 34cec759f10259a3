"""The gRPC front door end to end: a real `pagefleet serve` subprocess and real gRPC clients
over 127.0.0.1, checked against `pagefleet.LLM` in this process on the same built-in model.

One server for the whole module (its start-up is most of the cost). It is started with a
small pool, a 512-token context, at most 2 running and 2 waiting requests per group, so that
a full queue and a prompt beyond the context are cheap to reach.
"""

from __future__ import annotations

import asyncio
import math
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from pagefleet.client import AsyncClient, Client, build_request
from protos.pagefleet.v1 import pagefleet_pb2 as pb
from protos.pagefleet.v1 import pagefleet_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
ENGINE = dict(num_blocks=256, max_model_len=512, max_num_seqs=2, max_waiting=2)
START_TIMEOUT_S = 240  # two cold processes loading torch on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llm_loading():
    """`pagefleet.LLM` on the server's options, loading on a thread while the server starts."""

    def load():
        from pagefleet import LLM

        return LLM("builtin", **ENGINE)

    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(load)


@pytest.fixture(scope="module")
def server(tmp_path_factory, llm_loading):
    """A running server; records what health and Generate said while it was loading."""
    port, metrics_port = free_port(), free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagefleet",
                "serve",
                "--model=builtin",
                f"--port={port}",
                f"--metrics-port={metrics_port}",
                "--grace=5",
                "--no-http",
                *flags,
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    client = Client(f"127.0.0.1:{port}", timeout=60)
    seen = {"health": [], "generate_while_loading": None}
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                status = client.health(timeout=2)
            except grpc.RpcError:
                time.sleep(0.1)  # not bound yet
                continue
            if not seen["health"] or seen["health"][-1] != status:
                seen["health"].append(status)
            if status == "SERVING":
                break
            seen.setdefault("liveness_while_loading", client.health("liveness", timeout=2))
            if seen["generate_while_loading"] is None:
                try:
                    client.generate("x", max_tokens=1)
                except grpc.RpcError as e:
                    seen["generate_while_loading"] = e.code()
            time.sleep(0.1)
        else:
            pytest.fail(f"server not SERVING after {START_TIMEOUT_S} s:\n{log.read_text()}")
        seen["status_at_ready"] = client.cluster_status()
        yield client, metrics_port, seen
    finally:
        client.close()
        proc.terminate()
        proc.wait(60)


@pytest.fixture(scope="module")
def llm(llm_loading):
    return llm_loading.result()


def reference(llm, prompt, max_tokens: int, logprobs: int | None = None):
    from pagefleet import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs)
    return llm.generate(prompt, params)[0]


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def all_blocks_free(client: Client) -> bool:
    return all(g.blocks_free == g.blocks_total and g.running == 0 and g.waiting == 0 for g in client.cluster_status())


# ---- readiness -----------------------------------------------------------------------------


def test_health_is_serving_only_once_ready(server):
    client, _, seen = server
    assert seen["health"][0] == "NOT_SERVING"  # bound before the groups loaded
    assert seen["health"][-1] == "SERVING"
    assert seen["generate_while_loading"] == grpc.StatusCode.UNAVAILABLE
    groups = seen["status_at_ready"]
    assert groups and all(g.alive for g in groups)
    # warmed up: every group has already run its tiny generation
    assert all(g.prefix_cache_queries > 0 for g in groups)
    assert client.health("pagefleet.v1.PageFleet") == "SERVING"
    # liveness (Kubernetes' probe) holds while the groups load, as once they serve
    assert seen["liveness_while_loading"] == "SERVING" == client.health("liveness")


def test_model_info_matches_the_engine(server, llm):
    client, _, _ = server
    info = client.model_info()
    assert info.max_model_len == llm.engine.max_model_len == 512
    assert info.vocab_size == llm.engine.model_config.vocab_size
    assert info.block_size == llm.engine.config.cache.block_size
    assert list(info.eos_token_ids) == list(llm.engine.eos_token_ids)


# ---- outputs equal pagefleet.LLM -------------------------------------------------------------


def chat_token_ids(llm, chat: list[dict]) -> list[int]:
    """The chat template rendered by transformers itself."""
    ids = llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return llm.tokenizer.encode(ids, add_special_tokens=False)


def test_stream_equals_llm_for_text_and_token_ids(server, llm):
    client, _, _ = server
    text = "The river runs past the old mill"
    for kwargs, ref_prompt in [
        ({"prompt": text}, text),
        ({"token_ids": [5, 17, 300, 42, 99]}, [5, 17, 300, 42, 99]),
    ]:
        assert_stream_equals_llm(client, llm, kwargs, ref_prompt)
    assert client.tokenize(text) == llm.tokenizer.encode(text)


def test_chat_stream_equals_llm(server, llm):
    client, _, _ = server
    chat = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Who built the bridge?"}]
    ids = chat_token_ids(llm, chat)
    assert client.tokenize(messages=chat) == ids
    assert_stream_equals_llm(client, llm, {"messages": chat}, ids)


def test_llm_chat_equals_generate_with_the_same_messages(server, llm):
    from pagefleet import SamplingParams

    client, _, _ = server
    chats = [
        [{"role": "user", "content": "Where does the river run?"}],
        [
            {"role": "system", "content": "You are a librarian."},
            {"role": "user", "content": "When does the library open?"},
            {"role": "assistant", "content": "At nine."},
            {"role": "user", "content": "And when does it close?"},
        ],
    ]
    outs = llm.chat(chats, SamplingParams(temperature=0.0, max_tokens=16))
    for chat, out in zip(chats, outs, strict=True):
        done = client.generate(messages=chat, max_tokens=16, temperature=0.0)
        assert out.prompt_token_ids == client.tokenize(messages=chat)
        assert out.outputs[0].token_ids == done.token_ids and len(done.token_ids) > 1
        assert out.outputs[0].text == done.text
        assert out.prompt == llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)


def assert_stream_equals_llm(client: Client, llm, kwargs: dict, ref_prompt) -> None:
    ref = reference(llm, ref_prompt, max_tokens=24)
    chunks = list(client.generate_stream(**kwargs, max_tokens=24, temperature=0.0))
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert "".join(c.text for c in chunks) == ref.text
    last = chunks[-1]
    assert last.finished and last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert last.usage.completion_tokens == 24
    assert chunks[0].placement.group_id.startswith("group-")


def test_logprobs_and_final_only_equal_llm(server, llm):
    client, _, _ = server
    ref = reference(llm, "A page is a fixed number of slots", max_tokens=6, logprobs=3)
    done = client.generate(
        "A page is a fixed number of slots",
        max_tokens=6,
        temperature=0.0,
        logprobs=3,
        output_kind=pb.OUTPUT_KIND_FINAL_ONLY,
    )
    assert done.token_ids == ref.token_ids and done.text == ref.text
    for got, want in zip(done.logprobs, ref.logprobs, strict=True):
        assert got.token_id == want.token_id and got.rank == want.rank
        assert [t.token_id for t in got.top] == [t for t, _ in want.top]
        assert math.isclose(got.logprob, want.logprob, rel_tol=1e-5, abs_tol=1e-5)


@pytest.mark.parametrize("options", [dict(temperature=0.0, logprobs=2), dict(temperature=1.0, top_p=0.9, seed=5)])
def test_a_stream_resumed_from_what_it_delivered_goes_on_as_the_undisturbed_one(server, options):
    """GenerateRequest.resume (what a client sends another router when its own died mid-way):
    the rest of the stream equals the undisturbed run's, text and logprobs included."""
    client, _, _ = server
    prompt = dict(prompt="Pages hold the keys and values of", max_tokens=24, ignore_eos=True)
    chunks = list(client.generate_stream(**prompt, **options))
    cut = 3  # responses delivered before the router went away
    request = build_request(**prompt, **options)
    for c in chunks[:cut]:
        request.resume.token_ids.extend(c.token_ids)
        request.resume.text_chars += len(c.text)
        request.resume.logprobs.extend(c.logprobs)
    rest = list(client.stub.Generate(request, timeout=60))
    tokens = lambda cs: [t for c in cs for t in c.token_ids]  # noqa: E731
    assert tokens(rest) == tokens(chunks[cut:])
    assert "".join(c.text for c in rest) == "".join(c.text for c in chunks[cut:])
    got = [(lp.token_id, lp.rank, [t.token_id for t in lp.top]) for c in rest for lp in c.logprobs]
    want = [(lp.token_id, lp.rank, [t.token_id for t in lp.top]) for c in chunks[cut:] for lp in c.logprobs]
    assert got == want
    assert rest[-1].usage.resumes == 1 and rest[-1].usage.completion_tokens == 24


def test_two_concurrent_streams(server, llm):
    client, _, _ = server
    target = client.target
    prompts = ["Bread rises in a warm room", "Children walk to school in groups"]
    refs = [reference(llm, p, max_tokens=32) for p in prompts]

    async def one(c: AsyncClient, prompt: str):
        times, ids = [], []
        async for chunk in c.generate_stream(prompt, max_tokens=32, temperature=0.0):
            times.append(time.monotonic())
            ids.extend(chunk.token_ids)
        return times, ids

    async def both():
        async with AsyncClient(target, timeout=60) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    (ta, ids_a), (tb, ids_b) = asyncio.run(both())
    assert ids_a == refs[0].token_ids and ids_b == refs[1].token_ids
    assert tb[0] < ta[-1] and ta[0] < tb[-1]  # the streams overlapped


# ---- cancellation and deadlines ------------------------------------------------------------


def test_cancelling_a_stream_frees_its_blocks(server):
    client, _, _ = server
    stream = client.generate_stream(token_ids=list(range(1, 101)), max_tokens=400)
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    (group,) = client.cluster_status()
    assert group.running == 1 and group.blocks_free < group.blocks_total
    stream.close()  # cancels the call
    wait_for(lambda: all_blocks_free(client), what="blocks freed after cancel")
    assert client.generate("still serving", max_tokens=2).completion_tokens == 2


def test_deadline_expires_cleanly_and_is_counted_as_a_deadline(server):
    client, metrics_port, _ = server
    prompt = list(range(200, 300))
    # 400 tokens in 0.25 s would take 1,600 tokens/s: more than a step of even this tiny model
    # allows (a deadline too short would expire before the handler runs, uncounted by it).
    timeout = 0.25
    errors = 'pagefleet:request_errors_total{code="%s",model_name="builtin-v1"}'
    before = scrape(metrics_port)
    with pytest.raises(grpc.RpcError) as err:
        client.generate(token_ids=prompt, max_tokens=400, timeout=timeout)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: all_blocks_free(client), what="blocks freed after the deadline")
    after = scrape(metrics_port)
    for code, want in (("DEADLINE_EXCEEDED", 1), ("CANCELLED", 0)):
        assert after.get(errors % code, 0) - before.get(errors % code, 0) == want, code
    assert client.generate("still serving", max_tokens=2).completion_tokens == 2


def test_full_queue_is_resource_exhausted(server):
    client, metrics_port, _ = server
    before = scrape(metrics_port)

    async def run():
        async with AsyncClient(client.target, timeout=120) as c:
            streams = [c.generate_stream(token_ids=[7 + i] * 20, max_tokens=400) for i in range(4)]
            tasks = [asyncio.ensure_future(s.__anext__()) for s in streams[:2]]
            await asyncio.gather(*tasks)  # both running (max_num_seqs=2)
            tasks += [asyncio.ensure_future(s.__anext__()) for s in streams[2:]]
            for _ in range(200):  # until both wait (max_waiting=2)
                if (await c.cluster_status())[0].waiting == 2:
                    break
                await asyncio.sleep(0.05)
            with pytest.raises(grpc.RpcError) as err:
                await c.generate("one too many", max_tokens=2)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in streams:
                await s.aclose()
            return err.value

    err = asyncio.run(run())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue is full" in err.details() and "retry after 1 s" in err.details()
    assert ("grpc-retry-pushback-ms", "1000") in tuple(err.trailing_metadata())
    wait_for(lambda: all_blocks_free(client), what="blocks freed after the full queue")
    after = scrape(metrics_port)
    errors = 'pagefleet:request_errors_total{code="%s",model_name="builtin-v1"}'
    # each request counted once: the refused one, and the four the client went away from
    for code, want in (("RESOURCE_EXHAUSTED", 1), ("CANCELLED", 4), ("UNAVAILABLE", 0)):
        assert after.get(errors % code, 0) - before.get(errors % code, 0) == want, code
    assert total(after, "pagefleet:request_success_total") == total(before, "pagefleet:request_success_total")


# ---- bad input -----------------------------------------------------------------------------

INVALID, RANGE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE


def _with_kind(kind: int) -> pb.GenerateRequest:
    request = pb.GenerateRequest(text="hello")
    request.output_kind = kind  # proto3 enums are open: an unknown value goes on the wire
    return request


def resumed(tokens: list[int], text_chars: int = 0, lps: int = 0, **options) -> pb.GenerateRequest:
    request = build_request("a", **{"max_tokens": 16, **options})
    request.resume.token_ids.extend(tokens)
    request.resume.text_chars = text_chars
    request.resume.logprobs.extend(pb.TokenLogprob(token_id=7) for _ in range(lps))
    return request


BAD_REQUESTS = {
    "empty prompt": (pb.GenerateRequest(text=""), INVALID, "text is empty"),
    "no prompt": (pb.GenerateRequest(), INVALID, "exactly one of text, token_ids or messages"),
    "two prompts": (pb.GenerateRequest(text="a", token_ids=[1]), INVALID, "text and token_ids"),
    "unknown output_kind": (_with_kind(7), INVALID, "output_kind"),
    "negative max_tokens": (build_request("a", max_tokens=-5), INVALID, "sampling.max_tokens"),
    "zero max_tokens": (build_request("a", max_tokens=0), INVALID, "sampling.max_tokens"),
    "huge max_tokens": (build_request("a", max_tokens=10**12), RANGE, "sampling.max_tokens"),
    "token id beyond vocab": (build_request(token_ids=[1, 10**6]), INVALID, "token_ids[1]"),
    "negative token id": (build_request(token_ids=[-3]), INVALID, "token_ids[0]"),
    "top_p 0": (build_request("a", top_p=0.0), INVALID, "sampling.top_p"),
    "top_p 1.5": (build_request("a", top_p=1.5), INVALID, "sampling.top_p"),
    "negative temperature": (
        build_request("a", temperature=-0.5),
        INVALID,
        "sampling.temperature",
    ),
    "nan temperature": (
        build_request("a", temperature=math.nan),
        INVALID,
        "sampling.temperature",
    ),
    "top_k -2": (build_request("a", top_k=-2), INVALID, "sampling.top_k"),
    "min_p 2": (build_request("a", min_p=2.0), INVALID, "sampling.min_p"),
    "logprobs 21": (build_request("a", logprobs=21), INVALID, "sampling.logprobs"),
    "penalty 3": (build_request("a", presence_penalty=3.0), INVALID, "sampling.presence_penalty"),
    "negative stop token": (
        build_request("a", stop_token_ids=[-1]),
        INVALID,
        "sampling.stop_token_ids",
    ),
    "prompt beyond context": (build_request(token_ids=[5] * 600), RANGE, "context"),
    "prompt fills context": (build_request(token_ids=[5] * 512), RANGE, "context"),
    "bad tenant": (build_request("a", tenant="acme corp/1"), INVALID, "tenant"),
    "bad cache_salt": (build_request("a", cache_salt="salt\x00"), INVALID, "cache_salt"),
    "salt and tenant": (
        build_request("a", cache_salt="s", tenant="t"),
        INVALID,
        "cache_salt or tenant",
    ),
    "chat without role": (build_request(messages=[("", "hi")]), INVALID, "messages[0].role"),
    "bad request_id": (build_request("a", request_id="has space"), INVALID, "request_id"),
    "resume of max_tokens": (resumed([7] * 4, max_tokens=4), INVALID, "resume.token_ids has 4"),
    "resume beyond vocab": (resumed([7, 10**6]), INVALID, "resume.token_ids[1]"),
    "resume negative chars": (resumed([7], text_chars=-1), INVALID, "resume.text_chars"),
    "resume without logprobs": (resumed([7, 8], logprobs=2), INVALID, "resume.logprobs has 0"),
    "resume with logprobs": (resumed([7], lps=1), INVALID, "asks for no logprobs"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_input_gets_its_status_and_the_server_keeps_serving(server, case):
    client, _, _ = server
    request, code, words = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as err:
        list(client.stub.Generate(request, timeout=30))
    assert err.value.code() == code, err.value.details()
    assert words in err.value.details()
    assert "Traceback" not in err.value.details()
    assert client.generate("ok", max_tokens=1).completion_tokens == 1


def test_oversized_message_is_refused_by_the_server(server):
    client, _, _ = server
    # A channel without its own send limit, so the server's limit is what refuses it.
    with grpc.insecure_channel(client.target, options=[("grpc.max_send_message_length", -1)]) as ch:
        stub = pb_grpc.PageFleetStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(text="x" * (5 << 20)), timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in err.value.details()
    assert client.generate("ok", max_tokens=1).completion_tokens == 1


# ---- metrics -------------------------------------------------------------------------------


# What a Prometheus server asks for: OpenMetrics first (whose writer would mangle the ':' of
# pagefleet:'s sample names), the text format next.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
    "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def scrape(port: int) -> dict[str, float]:
    """Prometheus text -> {series with labels: value}, asked for as Prometheus asks."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": PROMETHEUS_ACCEPT})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def total(series: dict[str, float], name: str) -> float:
    return sum(v for k, v in series.items() if k == name or k.startswith(name + "{"))


def test_metrics_expose_pagefleet_series(server):
    client, metrics_port, _ = server
    doc = list(range(300, 364))  # four full blocks
    before = scrape(metrics_port)
    first = client.generate(token_ids=doc + [1], max_tokens=3)
    second = client.generate(token_ids=doc + [2], max_tokens=3)
    wait_for(lambda: all_blocks_free(client), what="an idle group")
    after = scrape(metrics_port)
    assert second.cached_tokens == 64 and first.cached_tokens == 0

    def delta(name):
        return total(after, name) - total(before, name)

    assert delta("pagefleet:time_to_first_token_seconds_count") == 2
    assert delta("pagefleet:e2e_request_latency_seconds_count") == 2
    assert delta("pagefleet:request_queue_time_seconds_count") == 2
    assert delta("pagefleet:inter_token_latency_seconds_count") == 4  # 2 gaps per request
    for name in (
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_time_per_output_token_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert delta(f"pagefleet:{name}_count") == 2, name
    assert delta("pagefleet:routed_prompt_tokens_total") == 130
    assert delta("pagefleet:actual_cached_tokens_total") == 64
    assert delta("pagefleet:generation_tokens_total") == 6
    assert delta("pagefleet:prompt_tokens_total") == 130
    assert delta("pagefleet:prefix_cache_queries_total") == 130
    assert delta("pagefleet:prefix_cache_hits_total") == 64
    assert delta("pagefleet:kv_tier_hit_tokens_total") == 64  # all on the device: no tier under it
    assert delta("pagefleet:routing_decisions_total") == 2
    match = 'pagefleet:prefix_index_round_trip_seconds_count{model_name="builtin-v1",operation="match"}'
    assert after[match] - before.get(match, 0) == 2  # one index round trip per placement
    for name in (
        "pagefleet:num_requests_running",
        "pagefleet:num_requests_waiting",
        "pagefleet:kv_cache_usage_perc",
        "pagefleet:num_preemptions_total",
    ):
        assert f'{name}{{group="group-0",model_name="builtin-v1"}}' in after
    (group,) = client.cluster_status()
    labels = 'device="cpu",group="group-0",model_name="builtin-v1"'
    assert after[f"pagefleet:kv_cache_blocks_free{{{labels}}}"] == group.blocks_free
    assert after[f"pagefleet:kv_cache_blocks_used{{{labels}}}"] == 0
    # the prefix index as the router sees it, and the process
    assert after['pagefleet:prefix_index_up{backend="memory",model_name="builtin-v1"}'] == 1
    assert after['pagefleet:prefix_index_groups{model_name="builtin-v1"}'] == 1
    assert after['pagefleet:prefix_index_entries{model_name="builtin-v1"}'] >= 4  # the document
    assert total(after, "pagefleet:group_restarts_total") == 0
    assert after["process_resident_memory_bytes"] > 0 and total(after, "python_info") == 1


def test_reflection_lists_the_services(server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    client, _, _ = server
    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    names = {s.name for s in reply.list_services_response.service}
    assert {"pagefleet.v1.PageFleet", "grpc.health.v1.Health"} <= names


def test_generated_modules_are_fresh():
    from protos.generate import stale_files

    assert stale_files() == []


def test_router_side_hashes_like_the_engine(llm):
    """The router's hasher is built from the model directory (groups may be remote); it must
    name blocks exactly as the engine does."""
    from router.launch.local import router_side

    hasher, tokenizer, info = router_side(llm.engine.config, "builtin-v1")
    assert hasher.fingerprint == llm.engine.hasher.fingerprint
    assert info.max_model_len == llm.engine.max_model_len
    assert info.kv_cache_dtype == str(llm.engine.layout.dtype).removeprefix("torch.")
    assert tokenizer.encode("The river runs") == llm.tokenizer.encode("The river runs")


def test_a_client_with_several_routers_moves_past_one_that_is_down(server):
    client, _, _ = server
    down = f"127.0.0.1:{free_port()}"  # nothing listens there
    with Client([down, client.target], timeout=30) as both:
        assert both.target == down
        done = both.generate(token_ids=[5, 6, 7], max_tokens=2, temperature=0.0)
        assert done.completion_tokens == 2 and both.target == client.target
        assert both.model_info().vocab_size == client.model_info().vocab_size
    with Client(down, timeout=5) as alone, pytest.raises(grpc.RpcError) as err:
        alone.generate("x", max_tokens=1)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
