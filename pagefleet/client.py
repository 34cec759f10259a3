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
import itertools
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
_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


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
    # those by tier ("device", "host", "disk", "pull"); empty when the server did not say
    cached_tiers: dict[str, int] = field(default_factory=dict)
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
        add_chunk(done, r)
    return done


def add_chunk(done: Completion, r: pb.GenerateResponse) -> None:
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
        done.cached_tokens, done.ttft_seconds, done.e2e_seconds = (u.cached_tokens, u.ttft_seconds, u.e2e_seconds)
        if u.HasField("cached_tiers"):
            done.cached_tiers = {f.name: getattr(u.cached_tiers, f.name) for f in u.cached_tiers.DESCRIPTOR.fields}


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
        credentials = grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)
        return grpc_module.secure_channel(target, credentials, options=options)


def _health_name(status: int) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def targets_of(target: str | Sequence[str]) -> list[str]:
    """Router addresses from "host:port", "a:1,b:2" or a list of them."""
    parts = [target] if isinstance(target, str) else list(target)
    out = [t.strip() for part in parts for t in part.split(",") if t.strip()]
    if not out:
        raise ValueError("give at least one server address (host:port)")
    return out


class _Routers:
    """A client's router addresses, one channel each (made on first use), and the one in use:
    a call that finds it UNAVAILABLE moves on to the next."""

    def __init__(self, target: str | Sequence[str], make_channel) -> None:
        self.targets = targets_of(target)
        self._make_channel = make_channel
        self._channels: dict[str, object] = {}
        self.current = 0

    @property
    def target(self) -> str:
        return self.targets[self.current]

    def channel(self):
        target = self.target
        if target not in self._channels:
            self._channels[target] = self._make_channel(target)
        return self._channels[target]

    def stub(self) -> tuple[str, pb_grpc.PageFleetStub]:
        """The router in use and a stub of it."""
        target = self.target
        return target, pb_grpc.PageFleetStub(self.channel())

    def move_on(self, error: grpc.RpcError, attempt: int, target: str) -> bool:
        """Whether to try again after `error` from `target` on attempt `attempt` (0-based):
        on UNAVAILABLE, with the next router (unless another call has already moved away from
        `target`), at most once per router."""
        if error.code() != grpc.StatusCode.UNAVAILABLE or attempt + 1 >= len(self.targets):
            return False
        if self.target == target:
            self.current = (self.current + 1) % len(self.targets)
        return True

    def channels(self) -> list:
        return list(self._channels.values())


class _Delivered:
    """What one stream has delivered so far, so that a router going away mid-stream does not
    end it: the request goes to the next router with `resume` set to the tokens, their text's
    length and their logprobs (the router continues it with none repeated or missing; a
    seeded request draws what it would have). Before any token the request is sent again as
    it was."""

    def __init__(self, request: pb.GenerateRequest) -> None:
        self._request = request
        self._resume = pb.ResumeFrom()
        self._resume.CopyFrom(request.resume)  # a request may itself continue a stream

    def add(self, response: pb.GenerateResponse) -> None:
        self._resume.token_ids.extend(response.token_ids)
        self._resume.text_chars += len(response.text)
        self._resume.logprobs.extend(response.logprobs)

    def request(self) -> pb.GenerateRequest:
        if not self._resume.token_ids:
            return self._request
        request = pb.GenerateRequest()
        request.CopyFrom(self._request)
        request.resume.CopyFrom(self._resume)
        return request


class Client:
    """A blocking client of one or several routers (`target`: "host:port", "a:1,b:2" or a
    list): a call that finds its router UNAVAILABLE moves on to the next, before its first
    token or mid-stream (the stream continues there from what it had delivered: see
    `_Delivered`; one whose group dies is resumed by the router itself). Thread-safe like
    gRPC channels are."""

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        timeout: float | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        **security,
    ) -> None:
        """`security`: the fields of `Security` (api_key, tls, root_certificates, ...)."""
        self.timeout = timeout  # default deadline of each call, seconds
        self.security = Security(**security)
        self._md = self.security.metadata
        options = _options(max_message_bytes)
        self.routers = _Routers(target, lambda t: self.security.channel(grpc, t, options))

    @property
    def target(self) -> str:
        """The router in use."""
        return self.routers.target

    @property
    def channel(self) -> grpc.Channel:
        return self.routers.channel()

    @property
    def stub(self) -> pb_grpc.PageFleetStub:
        return pb_grpc.PageFleetStub(self.channel)

    def _unary(self, method: str, request):
        """One call on the router in use, moving on while routers are UNAVAILABLE."""
        for attempt in itertools.count():
            try:
                target, stub = self.routers.stub()
                return getattr(stub, method)(request, timeout=self.timeout, metadata=self._md)
            except grpc.RpcError as e:
                if not self.routers.move_on(e, attempt, target):
                    raise

    def generate_stream(
        self, prompt: str | None = None, *, timeout: float | None = None, **options
    ) -> Iterator[pb.GenerateResponse]:
        """Stream GenerateResponses; closing the iterator early cancels the request."""
        delivered = _Delivered(build_request(prompt, **options))
        for attempt in itertools.count():
            request = delivered.request()
            target, stub = self.routers.stub()
            call = stub.Generate(request, timeout=timeout or self.timeout, metadata=self._md)
            try:
                for response in call:
                    delivered.add(response)
                    yield response
                return
            except grpc.RpcError as e:
                if not self.routers.move_on(e, attempt, target):
                    raise
            finally:
                call.cancel()  # a no-op once the stream has ended

    def generate(self, prompt: str | None = None, **options) -> Completion:
        return collect(self.generate_stream(prompt, **options))

    def tokenize(self, text: str | None = None, *, messages=None) -> list[int]:
        request = build_request(text, messages=messages)
        tok = pb.TokenizeRequest(messages=request.messages)
        if text is not None:
            tok.text = text
        return list(self._unary("Tokenize", tok).token_ids)

    def model_info(self) -> pb.ModelInfo:
        return self._unary("GetModelInfo", pb.GetModelInfoRequest())

    def cluster_status(self) -> list[pb.GroupStatus]:
        return list(self._unary("GetClusterStatus", pb.GetClusterStatusRequest()).groups)

    def health(self, service: str = "", timeout: float = 5.0) -> str:
        """ "SERVING", "NOT_SERVING", ... of the router in use (or one of its services)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
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
        for channel in self.routers.channels():
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """The asyncio client: the same calls, awaited, over one or several routers (see
    `Client`). Create it inside a running loop."""

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        timeout: float | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        **security,
    ) -> None:
        self.timeout = timeout
        self.security = Security(**security)
        self._md = self.security.metadata
        options = _options(max_message_bytes)
        self.routers = _Routers(target, lambda t: self.security.channel(grpc.aio, t, options))

    @property
    def target(self) -> str:
        return self.routers.target

    @property
    def channel(self) -> grpc.aio.Channel:
        return self.routers.channel()

    @property
    def stub(self) -> pb_grpc.PageFleetStub:
        return pb_grpc.PageFleetStub(self.channel)

    async def _unary(self, method: str, request):
        for attempt in itertools.count():
            try:
                target, stub = self.routers.stub()
                return await getattr(stub, method)(request, timeout=self.timeout, metadata=self._md)
            except grpc.RpcError as e:
                if not self.routers.move_on(e, attempt, target):
                    raise

    async def generate_stream(
        self, prompt: str | None = None, *, timeout: float | None = None, **options
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream GenerateResponses; leaving the loop early cancels the request."""
        delivered = _Delivered(build_request(prompt, **options))
        for attempt in itertools.count():
            request = delivered.request()
            target, stub = self.routers.stub()
            call = stub.Generate(request, timeout=timeout or self.timeout, metadata=self._md)
            try:
                async for response in call:
                    delivered.add(response)
                    yield response
                return
            except grpc.RpcError as e:
                if not self.routers.move_on(e, attempt, target):
                    raise
            finally:
                call.cancel()

    async def generate(self, prompt: str | None = None, **options) -> Completion:
        done = Completion(request_id="", text="", token_ids=[], finish_reason=None)
        async for r in self.generate_stream(prompt, **options):
            add_chunk(done, r)
        return done

    async def tokenize(self, text: str | None = None, *, messages=None) -> list[int]:
        request = build_request(text, messages=messages)
        tok = pb.TokenizeRequest(messages=request.messages)
        if text is not None:
            tok.text = text
        return list((await self._unary("Tokenize", tok)).token_ids)

    async def model_info(self) -> pb.ModelInfo:
        return await self._unary("GetModelInfo", pb.GetModelInfoRequest())

    async def cluster_status(self) -> list[pb.GroupStatus]:
        return list((await self._unary("GetClusterStatus", pb.GetClusterStatusRequest())).groups)

    async def health(self, service: str = "", timeout: float = 5.0) -> str:
        stub = health_pb2_grpc.HealthStub(self.channel)
        request = health_pb2.HealthCheckRequest(service=service)
        return _health_name((await stub.Check(request, timeout=timeout)).status)

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
        for channel in self.routers.channels():
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
