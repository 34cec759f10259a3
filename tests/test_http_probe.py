"""The HTTP door of a running `pagefleet serve`, probed as a careless or hostile client would
(as tests/test_door_probe.py probes the gRPC door): bodies over the limit, declared or chunked,
bytes that are not JSON, wrong types and unknown fields, prompts that cannot fit, clients that
vanish mid-stream or mid-wait, random mutations of valid bodies, and a shutdown with a stream
still running. Every answer is OpenAI's error body with a status a client can act on; nothing
leaks; health keeps answering.

One server for the module (a 512-token context, a 0.25 s grace period, a 1 MiB body limit); the
shutdown test comes last and stops it. Its request heads may take HEAD_TIMEOUT_S to arrive.
"""

from __future__ import annotations

import asyncio
import json
import random
import select
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.redis_server import free_port
from tests.serve_process import (
    all_blocks_free,
    builtin_model_flags,
    mutated,
    start_serve,
    wait_for,
)

CONTEXT = 512
START_TIMEOUT_S = 240
BODY_LIMIT = 1 << 20
HEAD_TIMEOUT_S = 1.5
# The shutdown test's stream must outlast it: the built-in model decodes its ~500 tokens in
# about 1 s on a 2-core CPU (a 1 s grace let the stream finish first there).
GRACE_S = 0.25


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """(process, gRPC client, httpx client on the HTTP door, model name)."""
    tmp = tmp_path_factory.mktemp("http-probe")
    port = free_port()
    flags = [
        *builtin_model_flags(),
        f"--http-port={port}",
        "--no-metrics",
        f"--grace={GRACE_S}",
        f"--max-model-len={CONTEXT}",
        "--num-blocks=256",
        "--max-num-seqs=4",
        "--max-waiting=64",
    ]
    (tmp / "serve.yaml").write_text(f"max_message_bytes: {BODY_LIMIT}\nhttp_headers: {{timeout_s: {HEAD_TIMEOUT_S}}}\n")
    flags.append(f"--config={tmp / 'serve.yaml'}")
    proc, client = start_serve(flags, free_port(), tmp / "serve.log", START_TIMEOUT_S)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        yield proc, client, http, client.model_info().model
    finally:
        http.close()
        client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and len(error["message"]) < 300
    return error


# ---- bodies -------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_413_declared_or_chunked(probed):
    _, _, http, model = probed
    big = json.dumps({"model": model, "prompt": "a" * (BODY_LIMIT + 10)}).encode()
    error = error_of(http.post("/v1/completions", content=big), 413)
    assert f"over {BODY_LIMIT} bytes" in error["message"]

    def chunks():  # no Content-Length: the limit counts the bytes as they come
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    error_of(http.post("/v1/completions", content=chunks()), 413)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (b"{bad", None, "not valid JSON"),
        (b"[1, 2]", None, "must be a JSON object"),
        (b'{"model": "M", "prompt": "x", "temperature": "hot"}', "temperature", "valid number"),
        (b'{"model": "M", "prompt": "x", "max_tokens": 1.5}', "max_tokens", "valid integer"),
        (b'{"model": "M", "prompt": "x", "n": true}', "n", "valid integer"),
        (b'{"model": "M", "prompt": {"a": 1}}', "prompt", "a string, an array of strings"),
        (b'{"model": "M", "prompt": "x", "max_token": 5}', "max_token", "Unrecognized"),
        (b'{"prompt": "x"}', "model", "model is required"),
        (b'{"model": "M", "prompt": "x", "stop": ["x", 5]}', "stop", "a string or an array"),
        (b'{"model": "M", "prompt": "x", "seed": 100000000000000000000}', "seed", "less than"),
        (b'{"model": "M", "prompt": "x", "n": 1000}', "n", "less than or equal to 64"),
        (b'{"model": "M", "prompt": [], "max_tokens": 1}', "prompt", "prompt is empty"),
        (b'{"model": "M", "prompt": [3, -1]}', "prompt", "prompt[1] = -1 is outside"),
        (b'{"model": "M", "prompt": "x", "echo": true}', "echo", "not supported"),
        (
            b'{"model": "M", "prompt": "x", "stream_options": {"include_usage": true}}',
            "stream_options",
            "only allowed with stream",
        ),
    ],
)
def test_a_malformed_body_is_400_naming_the_field(probed, body, param, words):
    _, _, http, model = probed
    body = body.replace(b'"M"', json.dumps(model).encode())
    response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    error = error_of(response, 400)
    assert error["param"] == param and words in error["message"], error


def test_chat_fields_are_checked_by_name(probed):
    _, _, http, model = probed
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    for messages, param in (
        ([{"role": "user", "content": image}], "messages[0].content"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "", "content": "x"}], "messages[0].role"),
        ([], "messages"),
    ):
        response = http.post("/v1/chat/completions", json={"model": model, "messages": messages})
        assert error_of(response, 400)["param"] == param
    response = http.post(
        "/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    )
    assert error_of(response, 400)["param"] == "top_logprobs"


LONE = "\\ud800"  # JSON's escape of a lone surrogate, as the body's bytes carry it


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", '{"model": M, "prompt": "a%s"}', "prompt"),
        ("/v1/completions", '{"model": M, "prompt": ["x", "%s"]}', "prompt"),
        ("/v1/completions", '{"model": "m%s", "prompt": "x"}', "model"),
        ("/v1/completions", '{"model": M, "prompt": "x", "stop": ["%s"]}', "stop"),
        (
            "/v1/chat/completions",
            '{"model": M, "messages": [{"role": "user", "content": "%s"}]}',
            "messages[0].content",
        ),
        ("/v1/chat/completions", '{"model": M, "messages": [{"role": "%s", "content": "x"}]}', "messages[0].role"),
        (
            "/v1/chat/completions",
            '{"model": M, "messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}',
            "messages[0].content",
        ),
        ("/tokenize", '{"prompt": "%s"}', "prompt"),
        ("/v1/completions", '{"model": M, "prompt": "x", "%s": 1}', None),
    ],
    ids=["prompt", "prompt list", "model", "stop", "content", "role", "text part", "tokenize", "field name"],
)
def test_a_lone_surrogate_is_400_naming_the_field(probed, path, body, param):
    _, _, http, model = probed
    data = body.replace("M", json.dumps(model)).replace("%s", LONE).encode()
    response = http.post(path, content=data, headers={"content-type": "application/json"})
    error = error_of(response, 400)
    assert error["param"] == param and "not valid Unicode" in error["message"], error


# ---- request heads: bounded in size, count and time ----------------------------------------


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def answer_to_head(port: int, head: bytes, piece: int = 16384) -> bytes:
    """What the server answers to `head`, sent piece by piece until it answers, and read until
    it closes the connection (socket.timeout if it does not)."""
    with socket.create_connection(("127.0.0.1", port), timeout=HEAD_TIMEOUT_S + 5) as sock:
        for i in range(0, len(head), piece):
            if select.select([sock], [], [], 0)[0]:
                break  # answered (or closed): stop sending
            try:
                sock.sendall(head[i : i + piece])
            except OSError:
                break
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:  # (the server closed with our bytes unread: after its answer)
            pass
        return received


def status_and_error(answer: bytes) -> tuple[int, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower(), answer[:300]
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]["message"]


@pytest.mark.parametrize(
    ("head", "words"),
    [
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_000_000 + b"\r\n\r\n", "over 65536 bytes"),
        (b"GET /health HTTP/1.1\r\n" + b"X-A: b\r\n" * 20_000 + b"\r\n", "over 100 headers"),
        (b"GET /" + b"a" * 1_000_000 + b" HTTP/1.1\r\n\r\n", "over 65536 bytes"),
    ],
    ids=["a 1 MB header line", "20,000 header lines", "a 1 MB path"],
)
def test_a_head_over_the_limits_is_431_and_closed(probed, head, words):
    _, _, http, _ = probed
    status, message = status_and_error(answer_to_head(http.base_url.port, head))
    assert status == 431 and words in message, message
    assert http.get("/health").status_code == 200


def test_unterminated_huge_headers_hold_no_memory(probed):
    proc, _, http, _ = probed
    head = b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * (32 << 20)  # never ends
    before = rss_bytes(proc.pid)
    threads = [
        threading.Thread(target=lambda: answers.append(answer_to_head(http.base_url.port, head))) for _ in range(4)
    ]
    answers: list[bytes] = []
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [status_and_error(a)[0] for a in answers] == [431] * 4
    assert rss_bytes(proc.pid) - before < 16 << 20, (before, rss_bytes(proc.pid))


def test_a_head_that_does_not_arrive_in_time_is_408_and_an_idle_connection_closed(probed):
    _, _, http, _ = probed
    port = http.base_url.port
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=HEAD_TIMEOUT_S + 5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and the rest never comes
        status, message = status_and_error(sock.recv(65536))
    assert status == 408 and "did not arrive" in message
    assert HEAD_TIMEOUT_S - 0.1 < time.monotonic() - start < HEAD_TIMEOUT_S + 2
    with socket.create_connection(("127.0.0.1", port), timeout=HEAD_TIMEOUT_S + 5) as sock:
        assert sock.recv(1) == b""  # nothing sent: closed without an answer
    assert time.monotonic() - start < 2 * HEAD_TIMEOUT_S + 3


# ---- prompts that cannot fit; health answers meanwhile -----------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "The river runs past the old mill. " * 28_000},  # 0.95 MB of text
        {"messages": [{"role": "user", "content": "hi"}] * 30_000},
    ],
    ids=["0.95 MB of text", "30k chat messages"],
)
def test_a_prompt_that_cannot_fit_is_refused_at_once_and_health_answers(probed, body):
    _, _, http, model = probed
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    latencies, done = [], threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=http.base_url, timeout=10) as h:
            while not done.is_set():
                start = time.monotonic()
                assert h.get("/health").status_code == 200
                latencies.append(time.monotonic() - start)

    thread = threading.Thread(target=probe)
    thread.start()
    assert wait_for(lambda: latencies)  # health answers before the request too
    try:
        response = http.post(path, json={"model": model, **body})
    finally:
        done.set()
        thread.join()
    assert error_of(response, 400)["code"] == "context_length_exceeded"
    assert latencies and max(latencies) < 1.0, max(latencies)


# ---- clients that vanish -------------------------------------------------------------------


def raw_request(port: int, body: dict) -> socket.socket:
    """A POST /v1/completions sent on a plain socket, left open."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


@pytest.mark.parametrize("stream", [True, False], ids=["mid-stream", "waiting for the whole"])
def test_a_client_that_vanishes_aborts_its_request(probed, stream):
    _, client, http, model = probed
    assert wait_for(lambda: all_blocks_free(client))
    body = {
        "model": model,
        "prompt": list(range(1, 90)),
        "max_tokens": CONTEXT - 100,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    sock = raw_request(http.base_url.port, body)
    if stream:
        received = b""
        while b"data: " not in received:  # the headers, then the first event
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
    else:
        assert wait_for(lambda: client.cluster_status()[0].running == 1)
    sock.close()
    assert wait_for(lambda: all_blocks_free(client), 10), client.cluster_status()


# ---- fuzz --------------------------------------------------------------------------------

FUZZ_CASES = 200
ALLOWED = {200, 400, 404, 413, 429}


def mutations(rng: random.Random, model: str, n: int) -> list[tuple[str, bytes]]:
    """Byte-level mutations (flips, cuts, insertions, repeats) of valid bodies."""
    seeds = [
        (
            "/v1/completions",
            {
                "model": model,
                "prompt": "The baker",
                "max_tokens": 6,
                "n": 2,
                "stop": ["x"],
                "logprobs": 2,
                "seed": 3,
                "stream": True,
            },
        ),
        (
            "/v1/chat/completions",
            {
                "model": model,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "logprobs": True,
                "top_logprobs": 1,
            },
        ),
        ("/v1/completions", {"model": model, "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0.5}),
    ]
    values = [-1, 0, 1, 1.5, 2**70, "x", "a" * 300, None, True, [], [1, "a"], {}, {"a": 1}]
    out = []
    for i in range(n):
        path, body = rng.choice(seeds)
        if i % 3 == 2:  # one field set to a value of another type or range
            body = {**body, rng.choice([*body, "top_k", "n", "stop", "cache_salt"]): rng.choice(values)}
            out.append((path, json.dumps(body).encode()))
            continue
        out.append((path, mutated(rng, json.dumps(body).encode())))
    return out


def test_fuzzed_bodies_get_clean_statuses_and_leak_nothing(probed):
    proc, client, http, model = probed
    inputs = mutations(random.Random(0), model, FUZZ_CASES)

    async def run() -> list[tuple[int, str]]:
        async with httpx.AsyncClient(base_url=http.base_url, timeout=60) as h:
            gate = asyncio.Semaphore(8)

            async def one(path: str, data: bytes) -> tuple[int, str]:
                async with gate:
                    r = await h.post(path, content=data, headers={"content-type": "application/json"})
                    if r.status_code != 200:
                        error_of(r, r.status_code)  # OpenAI's error body, whatever the status
                    return r.status_code, r.text[:200]

            return await asyncio.gather(*(one(p, d) for p, d in inputs))

    results = asyncio.run(run())
    bad = [(d[:60], s, t) for (_, d), (s, t) in zip(inputs, results, strict=True) if s not in ALLOWED]
    assert not bad, bad[:5]
    assert sum(s == 200 for s, _ in results) > 10  # some requests stay valid
    assert sum(s == 400 for s, _ in results) > 50
    assert proc.poll() is None
    assert wait_for(lambda: all_blocks_free(client), 60), client.cluster_status()


# ---- shutdown (last: it stops the server) --------------------------------------------------


def test_shutdown_ends_a_running_stream_with_an_abort_and_done(probed):
    proc, _, http, model = probed
    body = {
        "model": model,
        "prompt": [9, 8, 7],
        "max_tokens": CONTEXT - 10,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        events = [next(lines)]
        proc.send_signal(signal.SIGTERM)  # (GRACE_S: the stream cannot finish in time)
        events += list(lines)
    data = [e.removeprefix("data: ") for e in events if e.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    finished = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f["finish_reason"] for f in finished] == ["abort"]
    usage = chunks[-1]["usage"]
    assert 0 < usage["completion_tokens"] < CONTEXT - 10 and usage["prompt_tokens"] == 3
    assert proc.wait(60) == 0
