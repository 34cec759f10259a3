"""The gRPC front door: `pagefleet.v1.PageFleet` over a `Router`, with health and reflection.

The server binds its port before the cluster loads (health answers NOT_SERVING meanwhile and
the API answers UNAVAILABLE), and reports SERVING only once `set_ready` hands it a router whose
groups have loaded and warmed up, and NOT_SERVING again while no group is alive: a readiness
check. The health service "liveness" is SERVING from the bind to the stop, whatever the groups
do: a liveness check (a router is not restarted for its groups' sake), answered by the event
loop, so a loop that stalls fails it. This module
imports neither torch nor the router at import time, so `pagefleet serve` answers within a
second or two of starting.

The event loop serves every call, health checks included, so nothing slow runs on it: text is
tokenized on a worker thread, after checks that refuse at once what cannot fit the context.
A request whose bytes do not parse is answered INVALID_ARGUMENT (see `lenient_parser`).
The checks, the router's stream, aborts and metrics are router/door/serving.py's, shared with
the HTTP door. With API keys, a call without a valid `authorization: Bearer KEY` is refused
UNAUTHENTICATED (health and reflection stay open, for load balancers' probes).

Cancellation is an abort: when a client cancels a Generate stream or its deadline passes,
gRPC cancels the handler; the handler stops consuming, closes the router's stream (whose
`finally` aborts the request in its group) and aborts by id as well, so the request's blocks
are freed at once. `stop(grace)` reports NOT_SERVING, refuses new calls, lets in-flight calls
finish for `grace` seconds, then aborts the rest in their groups, so that each stream ends with
its usage and FINISH_REASON_ABORT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.pagefleet.v1 import pagefleet_pb2 as pb
from protos.pagefleet.v1 import pagefleet_pb2_grpc as pb_grpc
from router.door import documents
from router.door.api import (
    constraint_named,
    model_info_message,
    response_message,
    route_request,
    status_message,
    tokenized,
)
from router.door.auth import ApiKeys, TlsFiles
from router.door.limits import Limiter
from router.door.metrics import ServerMetrics
from router.door.serving import (
    RETRY_AFTER_S,
    InFlight,
    Reject,
    check_context,
    outputs,
    status_for,
)

if TYPE_CHECKING:
    from router.router import Router

log = logging.getLogger(__name__)

DEFAULT_PORT = 50151  # gRPC; `pagefleet serve --port`
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # per message, both ways: ~500k token ids or 4 MB of text
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PageFleet"].full_name  # "pagefleet.v1.PageFleet"
LIVENESS_SERVICE = "liveness"  # grpc.health.v1 service name of the liveness check
DEADLINE_SLACK_S = 0.1  # see deadline_passed
HEALTH_INTERVAL_S = 1.0  # how often health looks for a live group
ABORT_FLUSH_S = 5.0  # after the grace period, how long aborted streams have to send their end
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class PageFleetServicer(pb_grpc.PageFleetServicer):
    """The API over a router; UNAVAILABLE until `router` is set. With `keys`, every call needs
    `authorization: Bearer KEY` metadata, and the key's tenant keys the request's cache."""

    def __init__(self, keys: ApiKeys | None = None) -> None:
        self.router: Router | None = None
        self.metrics: ServerMetrics | None = None
        self.keys = keys
        self.in_flight = InFlight()
        self.limiter: Limiter | None = None  # tenants' limits (router/door/limits.py)

    async def Generate(self, request: pb.GenerateRequest | Unparsed, context):
        t0 = time.perf_counter()
        router, tenant = await self._ready(request, context)
        budget = context.time_remaining()
        rid = f"pf-{uuid.uuid4().hex[:16]}"
        try:
            route, kind = await route_request(request, router, rid, tenant)
        except Reject as r:
            await self._abort(context, r.code, r.message)
        rid = route.request_id

        def cancelled_code() -> str:  # the client cancelled, or its deadline passed
            expired = deadline_passed(context.time_remaining(), budget)
            return "DEADLINE_EXCEEDED" if expired else "CANCELLED"

        stream = outputs(router, route, self.metrics, self.in_flight, t0, cancelled_code, self.limiter)
        try:
            async with contextlib.aclosing(stream):
                placed = None  # the request's record: a resume updates it
                async for out, record in stream:
                    placed = placed or record
                    if kind == pb.OUTPUT_KIND_FINAL_ONLY and not out.finished:
                        continue
                    resumes = placed.resumes if placed is not None and out.finished else 0
                    yield response_message(out, kind, record, time.perf_counter() - t0, resumes)
        except Exception as e:  # (the stream counted it)
            code, message = status_for(e, rid)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # when to try again
                wait = e.retry_after if isinstance(e, Reject) and e.retry_after is not None else RETRY_AFTER_S
                context.set_trailing_metadata(retry_after(wait))
            await context.abort(code, _proto_names(message))

    async def Tokenize(self, request: pb.TokenizeRequest | Unparsed, context):
        router, _ = await self._ready(request, context)
        if request.HasField("text") == bool(request.messages):
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "give exactly one of text or messages")
        try:
            ids = await tokenized(request, router)
            check_context(len(ids), None, router.model_info.max_model_len)
        except Reject as r:
            await self._abort(context, r.code, r.message)
        return pb.TokenizeResponse(token_ids=ids.tolist())

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        router, _ = await self._ready(request, context)
        return model_info_message(router.model_info)

    async def GetClusterStatus(self, request, context) -> pb.ClusterStatus:
        router, _ = await self._ready(request, context)
        return pb.ClusterStatus(groups=[status_message(s) for s in router.cluster_status()])

    async def PutDocument(self, request, context) -> pb.Document:
        return await documents.grpc_put(self, request, context)

    async def GetDocument(self, request, context) -> pb.Document:
        return await documents.grpc_get(self, request, context)

    async def DeleteDocument(self, request, context) -> pb.DeleteDocumentResponse:
        return await documents.grpc_get(self, request, context, delete=True)

    async def _ready(self, request, context) -> tuple[Router, str | None]:
        """The router and the caller's tenant (None without keys), once the caller has shown a
        key (when keys are configured), the request has parsed and the server is ready."""
        tenant = None
        if self.keys is not None:
            given = dict(context.invocation_metadata()).get("authorization")
            tenant = self.keys.tenant(given)
            if tenant is None:
                what = "no API key" if given is None else "an API key that is not valid"
                await self._abort(
                    context,
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"the call has {what}; send 'authorization: Bearer KEY' metadata",
                )
        if isinstance(request, Unparsed):
            await self._abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request does not parse as {request.message_name}",
            )
        if self.router is None:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, "the server is starting: groups are loading")
        return self.router, tenant

    async def _abort(self, context, code: grpc.StatusCode, message: str):
        """Refuse a call before it reached the router (counted here)."""
        if self.metrics is not None:
            self.metrics.observe_error(code.name)
        await context.abort(code, message)

    async def finish_or_abort(self, grace: float) -> None:
        """Let Generate calls in flight finish for up to `grace` seconds, then abort the rest
        in their groups: each stream then ends with its tokens so far, usage and
        FINISH_REASON_ABORT, rather than being cut off."""
        await self.in_flight.finish_or_abort(self.router, grace)


class Unparsed:
    """A request whose bytes do not parse; the handler answers INVALID_ARGUMENT."""

    def __init__(self, message_name: str) -> None:
        self.message_name = message_name


def lenient_parser(message_class) -> Callable[[bytes], object]:
    """`message_class.FromString`, but an undecodable request becomes `Unparsed` instead of an
    exception that gRPC would answer as UNKNOWN with the parser's internals."""
    name = message_class.DESCRIPTOR.full_name

    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError:
            return Unparsed(name)

    return parse


def add_servicer(servicer: PageFleetServicer, server: grpc.aio.Server) -> None:
    """The PageFleet service's handlers, as the generated `add_PageFleetServicer_to_server`
    makes them, with lenient request parsers."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["PageFleet"].methods:
        request_class = getattr(pb, method.input_type.name)
        response_class = getattr(pb, method.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=lenient_parser(request_class),
            response_serializer=response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def retry_after(seconds: float) -> tuple[tuple[str, str], ...]:
    """Trailing metadata that tells a refused client when to try again: gRPC's retry pushback
    (what a retry policy honours) and the HTTP-style header."""
    return (("grpc-retry-pushback-ms", str(int(seconds * 1000))), ("retry-after", f"{seconds:g}"))


def deadline_passed(left: float | None, budget: float | None) -> bool:
    """Whether a call cancelled with `left` seconds of its deadline (`budget` at its start)
    was cancelled by that deadline: the client's own timer fires first and its reset reaches
    the server while the server's copy (set on receipt) still has a moment left."""
    if left is None or budget is None:
        return False
    return left <= DEADLINE_SLACK_S + 0.01 * budget


def _proto_names(message: str) -> str:
    """Engine messages name SamplingParams fields; callers know them as `sampling.*` (a
    structured output's as `sampling.structured_output.*`)."""
    message = constraint_named(message)
    return message.replace("SamplingParams.", "sampling.").replace("prompt token id", "token_ids: token id")


class FrontDoor:
    """A grpc.aio server with the PageFleet API, health and reflection; over TLS with `tls`
    (mutual with its `client_ca`), and with `keys`, the API (not health) needs a key."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        keys: ApiKeys | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {port}")
        if max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {max_message_bytes}")
        self.address = f"{host}:{port}"
        self.max_message_bytes = max_message_bytes
        self.tls = tls
        self.servicer = PageFleetServicer(keys)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self._watcher: asyncio.Future | None = None  # health follows the groups' liveness

    async def start(self) -> int:
        """Bind and start answering (health NOT_SERVING); returns the bound port."""
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.so_reuseport", 0),  # a port in use is an error, not a shared port
            ]
        )
        add_servicer(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        services = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
        reflection.enable_server_reflection((*services, reflection.SERVICE_NAME), self.server)
        await self._set_health(_NOT_SERVING)
        await self.health.set(LIVENESS_SERVICE, _SERVING)
        if self.tls is None:
            self.port = self.server.add_insecure_port(self.address)
        else:
            self.port = self.server.add_secure_port(self.address, self.tls.grpc_credentials())
        if self.port == 0:
            raise ValueError(f"cannot bind {self.address} (in use?)")
        await self.server.start()
        return self.port

    async def set_ready(
        self, router: Router, metrics: ServerMetrics | None = None, limiter: Limiter | None = None
    ) -> None:
        """Serve `router` (its groups loaded and warmed up) and report SERVING, and from then
        on NOT_SERVING whenever no group is alive. `limiter`: the tenants' limits."""
        self.servicer.metrics = metrics
        self.servicer.limiter = limiter
        self.servicer.router = router
        await self._set_health(_SERVING)
        self._watcher = asyncio.ensure_future(self._follow_groups(router))

    async def _follow_groups(self, router: Router) -> None:
        serving = True
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            alive = any(s.alive for s in router.cluster_status())
            if alive != serving:
                serving = alive
                log.warning("health: %s", "SERVING" if alive else "NOT_SERVING: no live group")
                await self._set_health(_SERVING if alive else _NOT_SERVING)

    async def _set_health(self, status) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def stop(self, grace: float) -> None:
        """NOT_SERVING, refuse new calls, let in-flight ones finish for `grace` seconds, then
        end the rest with FINISH_REASON_ABORT (see `finish_or_abort`), and stop."""
        await self.health.enter_graceful_shutdown()
        if self._watcher is not None:
            self._watcher.cancel()
        if self.server is not None:
            stopped = asyncio.ensure_future(self.server.stop(grace + ABORT_FLUSH_S))
            await self.servicer.finish_or_abort(grace)
            await stopped
