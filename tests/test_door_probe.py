"""A running `pagefleet serve`, probed from outside as a careless or hostile client would:
huge texts and chat lists, unbounded stop lists, oversized field values, bytes that do not
parse, a salt that claims a tenant's namespace, random mutations of valid requests, and a
shutdown with streams still running.

One server for the module (a 512-token context, a 0.25 s grace period); the shutdown test comes
last and stops it.
"""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time

import grpc
import pytest

from pagefleet.client import AsyncClient, Client, build_request
from protos.pagefleet.v1 import pagefleet_pb2 as pb
from tests.redis_server import free_port
from tests.serve_process import all_blocks_free, mutated, start_serve, wait_for

CONTEXT = 512
# The shutdown test's stream must outlast it: the built-in model decodes its ~500 tokens in
# about 1 s on a 2-core CPU (a 1 s grace let the stream finish first there).
GRACE_S = 0.25
START_TIMEOUT_S = 240
INVALID, RANGE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE
GENERATE = "/pagefleet.v1.PageFleet/Generate"


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """(process, client, log path) of a server on the built-in model."""
    log = tmp_path_factory.mktemp("probe") / "serve.log"
    flags = [
        "--model=builtin",
        "--no-metrics",
        f"--grace={GRACE_S}",
        f"--max-model-len={CONTEXT}",
        "--num-blocks=256",
        "--max-num-seqs=4",
        "--max-waiting=64",
    ]
    proc, client = start_serve(flags, free_port(), log, START_TIMEOUT_S)
    try:
        yield proc, client, log
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def refused(client: Client, request: pb.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        list(client.stub.Generate(request, timeout=60))
    return err.value


def health_latencies_while(client: Client, work) -> tuple[object, list[float]]:
    """Run `work()` while another thread checks health back to back; (work's result or its
    error, the health checks' latencies in seconds)."""
    latencies, done = [], threading.Event()

    def probe() -> None:
        while not done.is_set():
            start = time.monotonic()
            client.health(timeout=5)
            latencies.append(time.monotonic() - start)

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        result = work()
    except grpc.RpcError as e:
        result = e
    finally:
        done.set()
        thread.join()
    return result, latencies


# ---- the front door stays responsive ------------------------------------------------------


@pytest.mark.parametrize(
    "request_",
    [
        pb.GenerateRequest(text="The river runs past the old mill. " * 115_000),  # 3.9 MB
        build_request(messages=[("user", "hi")] * 150_000),
    ],
    ids=["3.9 MB of text", "150k chat messages"],
)
def test_a_prompt_that_cannot_fit_is_refused_at_once_and_health_answers(probed, request_):
    _, client, _ = probed
    err, latencies = health_latencies_while(client, lambda: list(client.stub.Generate(request_, timeout=60)))
    assert isinstance(err, grpc.RpcError) and err.code() == RANGE, err
    assert "context" in err.details()
    assert latencies and max(latencies) < 1.0, max(latencies)


def test_tokenize_is_bounded_by_the_context_and_names_the_api_fields(probed):
    _, client, _ = probed
    with pytest.raises(grpc.RpcError) as err:
        client.stub.Tokenize(pb.TokenizeRequest(text="word " * 800_000), timeout=60)
    assert err.value.code() == RANGE and "context" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # a few tokens over the context, under the bound
        client.stub.Tokenize(pb.TokenizeRequest(text="river " * 600), timeout=60)
    assert err.value.code() == RANGE and f"context is {CONTEXT} tokens" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.stub.Tokenize(pb.TokenizeRequest(), timeout=60)
    assert err.value.code() == INVALID
    assert err.value.details() == "give exactly one of text or messages"
    assert client.tokenize("river bank") == client.tokenize(messages=None, text="river bank")


# ---- bounded requests, short errors --------------------------------------------------------


def test_stop_lists_are_bounded_and_a_bad_entry_is_named_by_index(probed):
    _, client, _ = probed
    err = refused(client, build_request("a", stop=["x"] * 400_000))
    assert err.code() == INVALID and "sampling.stop has 400000 entries" in err.details()
    err = refused(client, build_request("a", stop=["ok", "y" * 5000]))
    assert err.code() == INVALID and "sampling.stop[1]" in err.details()
    assert len(err.details()) < 300
    done = client.generate("a", stop=[f"stop{i}" for i in range(32)], max_tokens=2)
    assert done.completion_tokens <= 2


@pytest.mark.parametrize("field", ["tenant", "request_id"])
def test_a_huge_invalid_value_gets_a_short_invalid_argument(probed, field):
    _, client, _ = probed
    err = refused(client, build_request("a", **{field: "é" * 20_000}))
    assert err.code() == INVALID and field in err.details()
    assert len(err.details()) < 300 and "20000 characters" in err.details()


# ---- bytes that do not parse ---------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        build_request("hello", max_tokens=4).SerializeToString()[:-3],  # truncated
        b"\x12\x03\xff\xfe\xfd",  # text = invalid UTF-8
        b"\x0f\x01",  # a field with a reserved wire type
        b"\x1a\xff\xff\xff\xff\x0f",  # token_ids: a length far past the end
    ],
    ids=["truncated", "invalid utf-8", "bad wire type", "bad length"],
)
def test_a_request_that_does_not_parse_is_invalid_argument(probed, data):
    _, client, _ = probed
    call = client.channel.unary_stream(
        GENERATE,
        request_serializer=lambda b: b,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as err:
        list(call(data, timeout=30))
    assert err.value.code() == INVALID, err.value.details()
    assert err.value.details() == "request does not parse as pagefleet.v1.GenerateRequest"


# ---- cache namespaces ----------------------------------------------------------------------


def test_a_raw_salt_cannot_reach_a_tenants_blocks(probed):
    _, client, _ = probed
    doc = list(range(100, 164))  # four full blocks
    first = client.generate(token_ids=doc + [1], max_tokens=1, tenant="acme")
    again = client.generate(token_ids=doc + [2], max_tokens=1, tenant="acme")
    assert first.cached_tokens == 0 and again.cached_tokens == 64
    for salt in ("tenant:acme", "acme", "tenant\\x00acme"):
        other = client.generate(token_ids=doc + [3], max_tokens=1, cache_salt=salt)
        assert other.cached_tokens == 0, salt
    plain = client.generate(token_ids=doc + [4], max_tokens=1)
    assert plain.cached_tokens == 0


# ---- fuzz ----------------------------------------------------------------------------------

FUZZ_CASES = 300
ALLOWED = {
    grpc.StatusCode.OK,
    INVALID,
    RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # a full queue
    grpc.StatusCode.DEADLINE_EXCEEDED,  # the fuzzer's own deadline on a long generation
}


def fuzz_inputs(rng: random.Random, n: int) -> list[bytes]:
    """Byte-level mutations of valid requests (flips, cuts, insertions, repeats) and random
    bytes."""
    seeds = [
        build_request("The baker starts work", max_tokens=8).SerializeToString(),
        build_request(token_ids=list(range(1, 40)), max_tokens=4, stop=["x"]).SerializeToString(),
        build_request(
            messages=[("user", "hi"), ("assistant", "yo")],
            max_tokens=3,
            tenant="t",
            logprobs=2,
            temperature=0.7,
            seed=5,
        ).SerializeToString(),
    ]
    out = []
    for i in range(n):
        if i % 5 == 4:
            out.append(rng.randbytes(rng.randrange(1, 64)))
            continue
        out.append(mutated(rng, rng.choice(seeds)))
    return out


def test_fuzzed_requests_get_clean_statuses_and_leak_nothing(probed):
    proc, client, log = probed
    inputs = fuzz_inputs(random.Random(0), FUZZ_CASES)

    async def run() -> list[tuple[grpc.StatusCode, str]]:
        async with AsyncClient(client.target, timeout=60) as c:
            call = c.channel.unary_stream(
                GENERATE, request_serializer=lambda b: b, response_deserializer=pb.GenerateResponse.FromString
            )
            gate = asyncio.Semaphore(8)

            async def one(data: bytes) -> tuple[grpc.StatusCode, str]:
                async with gate:
                    try:
                        async for _ in call(data, timeout=10):
                            pass
                    except grpc.aio.AioRpcError as e:
                        return e.code(), e.details()
                    return grpc.StatusCode.OK, ""

            return await asyncio.gather(*map(one, inputs))

    results = asyncio.run(run())
    bad = [
        (data[:40], code, details) for data, (code, details) in zip(inputs, results, strict=True) if code not in ALLOWED
    ]
    assert not bad, bad[:5]
    assert proc.poll() is None, log.read_text()
    assert wait_for(lambda: all_blocks_free(client), 60), client.cluster_status()
    assert client.health() == "SERVING"


# ---- shutdown (last: it stops the server) --------------------------------------------------


def test_shutdown_ends_running_streams_with_an_abort_and_their_usage(probed):
    proc, client, log = probed
    stream = client.generate_stream(token_ids=[9, 8, 7], max_tokens=CONTEXT - 10, ignore_eos=True)
    chunks = [next(stream)]
    proc.send_signal(signal.SIGTERM)  # (GRACE_S: the stream cannot finish in time)
    chunks += list(stream)
    last = chunks[-1]
    assert last.finished and last.finish_reason == pb.FINISH_REASON_ABORT
    generated = sum(len(c.token_ids) for c in chunks)
    assert 0 < generated < CONTEXT - 10
    assert last.usage.completion_tokens == generated and last.usage.prompt_tokens == 3
    assert proc.wait(60) == 0, log.read_text()
