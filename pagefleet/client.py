"""Python clients of the pagefleet gRPC API: `Client` (blocking) and `AsyncClient` (asyncio).

    with Client("127.0.0.1:50151") as client:
        client.wait_ready()
        for chunk in client.generate_stream("Hello", max_tokens=16, temperature=0):
            print(chunk.text, end="")
        done = client.generate("Hello", max_tokens=16)  # a Completion: text, usage, ...

Keyword arguments of `generate*` are the fields of `pagefleet.v1.SamplingParams` (temperature,
top_p, max_tokens, stop, logprobs, ...) plus request fields (request_id, cache_salt, tenant,
priority). Server errors raise `grpc.RpcError` (`.code()`, `.details()`). Leaving a stream early
cancels the call, which aborts the request in the server and frees its blocks.

A server with API keys needs `api_key` (sent as `authorization: Bearer KEY` metadata); one with
TLS needs `tls=True` (the system's roots) or `root_certificates`, and with mutual TLS
`certificate_chain` and `private_key` (PEM bytes) as well.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.pagefleet.v1 import pagefleet_pb2 as pb
from protos.pagefleet.v1 import pagefleet_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:50151"
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
_SAMPLING = set(pb.SamplingParams.DESCRIPTOR.fields_by_name)
_REQUEST = {"request_id", "cache_salt", "tenant", "priority", "output_kind"}
_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
           pb.FINISH_REASON_ABORT: "abort"}  # fmt: skip


@dataclass
class Completion:
    """A whole generation, assembled from its stream."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    ttft_seconds: float = 0.0
    e2e_seconds: float = 0.0
    group_id: str = ""
    placement_reason: str = ""
    logprobs: list = field(default_factory=list)  # pb.TokenLogprob per token, when asked


def build_request(
    prompt: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    messages: Iterable[dict | tuple[str, str]] | None = None,
    **options,
) -> pb.GenerateRequest:
    """A GenerateRequest from a prompt (text, token ids or chat messages) and options."""
    unknown = sorted(set(options) - _SAMPLING - _REQUEST)
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}; known: {sorted(_SAMPLING | _REQUEST)}")
    sampling = {k: v for k, v in options.items() if k in _SAMPLING and v is not None}
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    request = pb.GenerateRequest(
        sampling=pb.SamplingParams(**sampling),
        **{k: v for k, v in options.items() if k in _REQUEST and v is not None},
    )
    if prompt is not None:
        request.text = prompt
    if token_ids is not None:
        request.token_ids.extend(token_ids)
    for m in messages or ():
        role, content = (m["role"], m["content"]) if isinstance(m, dict) else m
        request.messages.add(role=role, content=content)
    return request


def collect(responses: Iterable[pb.GenerateResponse]) -> Completion:
    """Assemble a stream (delta or final-only) into a `Completion`."""
    done = Completion(request_id="", text="", token_ids=[], finish_reason=None)
    for r in responses:
        _add(done, r)
    return done


def _add(done: Completion, r: pb.GenerateResponse) -> None:
    done.request_id = r.request_id
    done.text += r.text
    done.token_ids.extend(r.token_ids)
    done.logprobs.extend(r.logprobs)
    if r.HasField("placement"):
        done.group_id, done.placement_reason = r.placement.group_id, r.placement.reason
    if r.finished:
        u = r.usage
        done.finish_reason = _FINISH.get(r.finish_reason)
        done.prompt_tokens, done.completion_tokens = u.prompt_tokens, u.completion_tokens
        done.cached_tokens, done.ttft_seconds, done.e2e_seconds = (
            u.cached_tokens, u.ttft_seconds, u.e2e_seconds
        )  # fmt: skip


def _options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


@dataclass(frozen=True)
class Security:
    """How a client reaches a server with keys or TLS (see the module docstring)."""

    api_key: str | None = None
    tls: bool = False
    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return None if self.api_key is None else (("authorization", f"Bearer {self.api_key}"),)

    def channel(self, grpc_module, target: str, options):
        """A channel from `grpc` or `grpc.aio`: secure with TLS, else insecure."""
        if not (self.tls or self.root_certificates or self.certificate_chain):
            return grpc_module.insecure_channel(target, options=options)
        credentials = grpc.ssl_channel_credentials(
            self.root_certificates, self.private_key, self.certificate_chain
        )
        return grpc_module.secure_channel(target, credentials, options=options)


def _health_name(status: int) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


class Client:
    """A blocking client over one channel; thread-safe like gRPC channels are."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        timeout: float | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        **security,
    ) -> None:
        """`security`: the fields of `Security` (api_key, tls, root_certificates, ...)."""
        self.target = target
        self.timeout = timeout  # default deadline of each call, seconds
        self.security = Security(**security)
        self._md = self.security.metadata
        self.channel = self.security.channel(grpc, target, _options(max_message_bytes))
        self.stub = pb_grpc.PageFleetStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def generate_stream(
        self, prompt: str | None = None, *, timeout: float | None = None, **options
    ) -> Iterator[pb.GenerateResponse]:
        """Stream GenerateResponses; closing the iterator early cancels the request."""
        call = self.stub.Generate(
            build_request(prompt, **options), timeout=timeout or self.timeout, metadata=self._md
        )
        try:
            yield from call
        finally:
            call.cancel()  # a no-op once the stream has ended

    def generate(self, prompt: str | None = None, **options) -> Completion:
        return collect(self.generate_stream(prompt, **options))

    def tokenize(self, text: str | None = None, *, messages=None) -> list[int]:
        request = build_request(text, messages=messages)
        tok = pb.TokenizeRequest(messages=request.messages)
        if text is not None:
            tok.text = text
        return list(self.stub.Tokenize(tok, timeout=self.timeout, metadata=self._md).token_ids)

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=self.timeout, metadata=self._md
        )

    def cluster_status(self) -> list[pb.GroupStatus]:
        return list(self.stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=self.timeout, metadata=self._md).groups)  # fmt: skip

    def health(self, service: str = "", timeout: float = 5.0) -> str:
        """ "SERVING", "NOT_SERVING", ... of the server (or one service)."""
        reply = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return _health_name(reply.status)

    def wait_ready(self, timeout: float = 120.0, poll_s: float = 0.2) -> None:
        """Block until health reports SERVING; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                last = self.health(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                if last == "SERVING":
                    return
            except grpc.RpcError as e:
                last = f"{e.code().name}: {e.details()}"
            time.sleep(poll_s)
        raise TimeoutError(f"{self.target} not SERVING after {timeout:g} s (last: {last})")

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """The asyncio client: the same calls, awaited. Create it inside a running loop."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        timeout: float | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        **security,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.security = Security(**security)
        self._md = self.security.metadata
        self.channel = self.security.channel(grpc.aio, target, _options(max_message_bytes))
        self.stub = pb_grpc.PageFleetStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    async def generate_stream(
        self, prompt: str | None = None, *, timeout: float | None = None, **options
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream GenerateResponses; leaving the loop early cancels the request."""
        call = self.stub.Generate(
            build_request(prompt, **options), timeout=timeout or self.timeout, metadata=self._md
        )
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()

    async def generate(self, prompt: str | None = None, **options) -> Completion:
        done = Completion(request_id="", text="", token_ids=[], finish_reason=None)
        async for r in self.generate_stream(prompt, **options):
            _add(done, r)
        return done

    async def tokenize(self, text: str | None = None, *, messages=None) -> list[int]:
        request = build_request(text, messages=messages)
        tok = pb.TokenizeRequest(messages=request.messages)
        if text is not None:
            tok.text = text
        return list(
            (await self.stub.Tokenize(tok, timeout=self.timeout, metadata=self._md)).token_ids
        )

    async def model_info(self) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=self.timeout, metadata=self._md
        )

    async def cluster_status(self) -> list[pb.GroupStatus]:
        reply = await self.stub.GetClusterStatus(
            pb.GetClusterStatusRequest(), timeout=self.timeout, metadata=self._md
        )
        return list(reply.groups)

    async def health(self, service: str = "", timeout: float = 5.0) -> str:
        request = health_pb2.HealthCheckRequest(service=service)
        return _health_name((await self._health.Check(request, timeout=timeout)).status)

    async def wait_ready(self, timeout: float = 120.0, poll_s: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                last = await self.health(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                if last == "SERVING":
                    return
            except grpc.RpcError as e:
                last = f"{e.code().name}: {e.details()}"
            await asyncio.sleep(poll_s)
        raise TimeoutError(f"{self.target} not SERVING after {timeout:g} s (last: {last})")

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
