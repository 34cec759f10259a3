"""The OpenAI-compatible HTTP door end to end: a real `pagefleet serve` with both doors and API
keys for two tenants, driven by the official `openai` package and, for the same requests, by the
gRPC client.

One server for the module: the built-in model, a 512-token context, at most 2 running and 2
waiting requests per group (so that a full queue is cheap to reach).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
import urllib.request

import grpc
import httpx
import openai
import pytest

from tests.redis_server import free_port
from tests.serve_process import all_blocks_free, builtin_model_flags, start_serve, wait_for

START_TIMEOUT_S = 240
METRICS: dict[str, str] = {}  # the module server's /metrics URL
KEYS = {"acme": "acme-key-0123456789", "globex": "globex-key-9876543210"}
DOCUMENT = (
    "The old mill stood by the river for two hundred years. It ground wheat for the town "
    "until the river moved north after the great flood, and the mill wheel stopped. The "
    "stone bridge was built by the miller's family so that carts could reach the market."
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(process, gRPC client as acme, HTTP base URL, model name)."""
    tmp = tmp_path_factory.mktemp("http-door")
    key_file = tmp / "keys"
    key_file.write_text("".join(f"{t} {k}\n" for t, k in KEYS.items()))
    http_port, metrics_port = free_port(), free_port()
    flags = [
        *builtin_model_flags(),
        f"--http-port={http_port}",
        f"--api-key-file={key_file}",
        f"--metrics-port={metrics_port}",
        "--grace=1",
        "--max-model-len=512",
        "--num-blocks=256",
        "--max-num-seqs=2",
        "--max-waiting=2",
    ]
    proc, client = start_serve(flags, free_port(), tmp / "serve.log", START_TIMEOUT_S, api_key=KEYS["acme"])
    METRICS["url"] = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        yield proc, client, f"http://127.0.0.1:{http_port}/v1", client.model_info().model
    finally:
        client.close()
        proc.terminate()
        proc.wait(60)


def sdk(served, tenant: str = "acme", key: str | None = None) -> openai.OpenAI:
    _, _, url, _ = served
    return openai.OpenAI(base_url=url, api_key=key or KEYS[tenant], max_retries=0, timeout=60)


# ---- completions and chat, whole and streamed ---------------------------------------------


def test_models_lists_the_served_model(served):
    *_, model = served
    (listed,) = sdk(served).models.list().data
    assert listed.id == model and listed.object == "model"


def test_completion_whole_and_streamed_are_the_same_tokens(served):
    _, _, _, model = served
    api = sdk(served)
    kw = dict(model=model, prompt="The baker starts work", max_tokens=8, temperature=0.0)
    whole = api.completions.create(**kw, extra_body={"return_token_ids": True})
    (choice,) = whole.choices
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 8
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 8
    chunks = list(api.completions.create(**kw, stream=True, extra_body={"return_token_ids": True}))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert sum((c.choices[0].token_ids for c in chunks), []) == choice.token_ids
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_whole_and_streamed_with_usage(served):
    _, _, _, model = served
    api = sdk(served)
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": "Who built the bridge?"}],
        max_completion_tokens=6,
        temperature=0.0,
    )
    whole = api.chat.completions.create(**kw)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    chunks = list(api.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_n_2_with_a_seed_gives_two_samples_and_the_same_two_again(served):
    _, _, _, model = served
    api = sdk(served)
    kw = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=1.5, top_p=1.0, n=2, seed=1234)
    first = api.completions.create(**kw)
    again = api.completions.create(**kw)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1] and texts[0] != texts[1]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    other = api.completions.create(**{**kw, "seed": 99})
    assert [c.text for c in other.choices] != texts
    # the prompt counted once; both choices' tokens
    assert first.usage.completion_tokens == 24
    streamed = list(api.completions.create(**kw, stream=True))
    by_index = {0: "", 1: ""}
    for chunk in streamed:
        by_index[chunk.choices[0].index] += chunk.choices[0].text
    assert [by_index[0], by_index[1]] == texts


def test_stop_strings_end_the_output_before_them(served):
    _, _, _, model = served
    api = sdk(served)
    kw = dict(model=model, prompt="The baker starts work", max_tokens=30, temperature=0.0)
    free = api.completions.create(**kw).choices[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    assert stop.strip(), free  # a stop string that occurs mid-output
    done = api.completions.create(**kw, stop=[stop]).choices[0]
    assert done.finish_reason == "stop" and done.text == free[: free.index(stop)]


def test_logprobs_completions_and_chat(served):
    _, client, _, model = served
    api = sdk(served)
    done = api.completions.create(model=model, prompt=[5, 6, 7], max_tokens=4, temperature=0.0, logprobs=3)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    ref = client.generate(token_ids=[5, 6, 7], max_tokens=4, temperature=0.0, logprobs=3)
    assert lp.token_logprobs == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-6)
    assert all(max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    assert lp.text_offset[0] == 0
    chat = api.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)


def test_a_second_question_about_the_same_document_reports_cached_tokens(served):
    _, client, _, model = served
    api = sdk(served)

    def ask(question: str):
        messages = [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": question}]
        return api.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0.0)

    first = ask("Who built the bridge?")
    second = ask("Why did the wheel stop?")
    document_tokens = len(client.tokenize(messages=[("system", DOCUMENT)]))
    block = client.model_info().block_size
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= (document_tokens // block - 1) * block > 0, (cached, document_tokens)
    extension = second.model_extra["pagefleet"]["choices"][0]
    assert extension["cached_tokens"] == cached and extension["group_id"]
    # the same by tier: a hit in the device pool (the server has no host tier)
    tiers = {"device": cached, "host": 0, "disk": 0, "pull": 0}
    assert second.usage.prompt_tokens_details.model_extra["cached_tokens_by_tier"] == tiers
    assert extension["cached_tiers"] == extension["predicted_cached_tiers"] == tiers


# ---- one request path -------------------------------------------------------------------


def test_the_same_request_through_http_and_grpc_gives_the_same_tokens(served):
    _, client, _, model = served
    api = sdk(served)
    prompt = list(range(40, 70))
    http = api.completions.create(
        model=model, prompt=prompt, max_tokens=10, temperature=0.8, seed=7, extra_body={"return_token_ids": True}
    )
    rpc = client.generate(token_ids=prompt, max_tokens=10, temperature=0.8, seed=7)
    assert http.choices[0].token_ids == rpc.token_ids and http.choices[0].text == rpc.text
    messages = [{"role": "user", "content": "Where are the letters kept?"}]
    chat = api.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0.0, extra_body={"return_token_ids": True}
    )
    rpc = client.generate(messages=messages, max_tokens=8, temperature=0.0)
    assert chat.choices[0].token_ids == rpc.token_ids
    assert chat.usage.prompt_tokens == len(client.tokenize(messages=messages))


def test_a_disconnect_mid_stream_frees_the_requests_blocks(served):
    _, client, _, model = served
    api = sdk(served)
    assert wait_for(lambda: all_blocks_free(client))
    stream = api.completions.create(
        model=model,
        prompt=list(range(1, 100)),
        max_tokens=400,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    before = scrape()
    next(iter(stream))
    busy = client.cluster_status()[0]
    assert busy.running == 1 and busy.blocks_free < busy.blocks_total
    stream.close()
    assert wait_for(lambda: all_blocks_free(client), 10), client.cluster_status()
    after = scrape()  # counted once, as cancelled
    for name, labels, grew in (
        ("request_errors_total", {"code": "CANCELLED"}, 1),
        ("request_errors_total", {}, 1),
        ("request_success_total", {}, 0),
    ):
        assert counter(after, name, **labels) - counter(before, name, **labels) == grew, name


# ---- errors as OpenAI's API raises them ------------------------------------------------------


def test_a_bad_field_is_a_bad_request_naming_it(served):
    _, _, _, model = served
    api = sdk(served)
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=model, prompt="x", top_p=2.0)
    assert err.value.status_code == 400 and err.value.body["param"] == "top_p"
    assert "top_p must be in (0, 1]" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_completion_tokens=10_000
        )
    assert err.value.code == "context_length_exceeded" and "max_completion_tokens" in err.value.message
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="gpt-4", prompt="x")


@pytest.mark.parametrize("key", [None, "not-a-key", "acme-key-012345678"], ids=["missing", "wrong", "near"])
def test_a_missing_or_wrong_key_is_refused_by_both_doors(served, key):
    _, client, url, model = served
    header = {"Authorization": openai.Omit() if key is None else f"Bearer {key}"}  # Omit: none
    api = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        api.completions.create(model=model, prompt="x", max_tokens=1, extra_headers=header)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        api.models.list(extra_headers=header)
    from pagefleet.client import Client

    with Client(client.target, timeout=30, api_key=key) as other:
        with pytest.raises(grpc.RpcError) as rpc:
            other.generate("x", max_tokens=1)
        assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert other.health() == "SERVING"  # health stays open, for load balancers


def test_a_full_queue_is_a_rate_limit_error_with_retry_after(served):
    _, client, url, model = served
    assert wait_for(lambda: all_blocks_free(client))

    async def flood():
        api = openai.AsyncOpenAI(base_url=url, api_key=KEYS["acme"], max_retries=0, timeout=120)
        kw = dict(model=model, prompt=[1, 2, 3], max_tokens=200, temperature=0.0, extra_body={"ignore_eos": True})
        return await asyncio.gather(*[api.completions.create(**kw) for _ in range(8)], return_exceptions=True)

    before = scrape()
    results = asyncio.run(flood())
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert limited and all(not isinstance(r, Exception) or r in limited for r in results), results
    assert limited[0].status_code == 429 and limited[0].response.headers["retry-after"] == "1"
    assert wait_for(lambda: all_blocks_free(client))
    after = scrape()  # each request counted once: refused, or finished
    for name, labels, grew in (
        ("request_errors_total", {"code": "RESOURCE_EXHAUSTED"}, len(limited)),
        ("request_errors_total", {}, len(limited)),
        ("request_success_total", {"finished_reason": "length"}, 8 - len(limited)),
    ):
        assert counter(after, name, **labels) - counter(before, name, **labels) == grew, name


# ---- tenants ----------------------------------------------------------------------------------


def test_tenants_with_the_same_document_share_no_blocks(served):
    _, client, _, model = served
    prompt = list(range(200, 264))  # four full blocks

    def cached(tenant: str, last: int) -> int:
        done = sdk(served, tenant).completions.create(
            model=model, prompt=[*prompt, last], max_tokens=1, temperature=0.0
        )
        return done.usage.prompt_tokens_details.cached_tokens

    assert cached("globex", 1) == 0
    assert cached("globex", 2) == 64  # its own blocks
    assert cached("acme", 3) == 0  # the other tenant's are out of reach
    assert cached("acme", 4) == 64


def test_a_key_cannot_name_another_tenant(served):
    _, client, _, model = served
    with pytest.raises(grpc.RpcError) as err:
        client.generate("x", max_tokens=1, tenant="globex")  # acme's key
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert client.generate("x", max_tokens=1, tenant="acme").completion_tokens == 1
    with pytest.raises(openai.BadRequestError) as http:
        sdk(served).completions.create(model=model, prompt="x", max_tokens=1, extra_body={"cache_salt": "globex"})
    assert http.value.param == "cache_salt"


# ---- one set of metrics; a door not ready ------------------------------------------------------


def counter(text: str, name: str, **labels) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"pagefleet:{name}\{{(.*)\}} (\S+)$", line)
        if m and all(w in m.group(1) for w in want):
            total += float(m.group(2))
    return total


def scrape() -> str:
    return urllib.request.urlopen(METRICS["url"], timeout=10).read().decode()


def test_both_doors_count_in_the_same_metrics(served):
    _, client, _, model = served
    before = scrape()
    sdk(served).completions.create(model=model, prompt=[1, 2], max_tokens=3)
    client.generate(token_ids=[1, 2], max_tokens=3)
    with pytest.raises(openai.AuthenticationError):
        sdk(served, key="wrong").models.list()
    after = scrape()
    for name, labels, grew in (
        ("request_success_total", {"finished_reason": "length"}, 2),
        ("generation_tokens_total", {}, 6),
        ("request_errors_total", {"code": "UNAUTHENTICATED"}, 1),
    ):
        assert counter(after, name, **labels) - counter(before, name, **labels) == grew, name


# ---- what is refused before the body is read; large bodies off the event loop ----------------

HEALTH_BOUND_S = 0.5  # /health while large bodies are parsed (one at a time, off the loop)


def head_only(port: int, key: str, length: int) -> socket.socket:
    """A POST /v1/completions whose headers declare `length` body bytes, of which none is sent."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode()
    )
    return sock


def status_of(sock: socket.socket) -> int:
    """The status of the response on `sock` (socket.timeout if none comes)."""
    head = b""
    while b"\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, head
        head += chunk
    return int(head.split(b" ", 2)[1])


def test_a_bad_key_is_refused_before_the_body_is_read(served):
    _, _, url, _ = served
    port = httpx.URL(url).port
    for key in ("not-a-key", ""):
        with head_only(port, key, 3_000_000) as sock:
            assert status_of(sock) == 401  # at once: the door waits for no body


def test_health_answers_while_large_token_id_bodies_are_posted(served):
    _, _, url, model = served
    base = url.removesuffix("/v1")
    ids = [100 + i % 100 for i in range(760_000)]  # a 3.8 MB body
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": 1}).encode()
    assert 3.5e6 < len(body) < 4 * 1024 * 1024
    latencies, done = [], threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=base, timeout=10) as h:
            while not done.is_set():
                start = time.monotonic()
                assert h.get("/health").status_code == 200
                latencies.append(time.monotonic() - start)
                time.sleep(0.01)

    async def post_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as h:
            posts = [
                h.post(
                    "/completions",
                    content=body,
                    headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
                )
                for key in (KEYS["acme"], "wrong-key") * 3
            ]
            return await asyncio.gather(*posts)

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        assert wait_for(lambda: latencies)
        responses = asyncio.run(post_all())
    finally:
        done.set()
        thread.join()
    assert [r.status_code for r in responses] == [400, 401] * 3
    assert responses[0].json()["error"]["code"] == "context_length_exceeded"
    assert max(latencies) < HEALTH_BOUND_S, sorted(latencies)[-5:]


def test_a_declared_body_over_the_limit_is_counted(served):
    _, _, url, _ = served
    before = scrape()
    for _ in range(3):
        with head_only(httpx.URL(url).port, KEYS["acme"], 5 * 1024 * 1024) as sock:
            assert status_of(sock) == 413
    after = scrape()
    name = "request_errors_total"
    assert counter(after, name, code="HTTP_413") - counter(before, name, code="HTTP_413") == 3


def test_a_door_before_its_router_answers_503_with_retry_after():
    from fastapi.testclient import TestClient

    from router.door.http import HttpDoor

    with TestClient(HttpDoor(port=0).app) as http:
        assert http.get("/health").status_code == 503
        response = http.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert "starting" in response.json()["error"]["message"]
