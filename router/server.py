"""The gRPC front door: `pagefleet.v1.PageFleet` over a `Router`, with health and reflection.

The server binds its port before the cluster loads (health answers NOT_SERVING meanwhile and
the API answers UNAVAILABLE), and reports SERVING only once `set_ready` hands it a router whose
groups have loaded and warmed up. This module imports neither torch nor the router at import
time, so `pagefleet serve` answers within a second or two of starting.

Cancellation is an abort: when a client cancels a Generate stream or its deadline passes,
gRPC cancels the handler; the handler stops consuming, closes the router's stream (whose
`finally` aborts the request in its group) and aborts by id as well, so the request's blocks
are freed at once. `stop(grace)` reports NOT_SERVING, refuses new calls, lets in-flight calls
finish for `grace` seconds, then cancels the rest (which aborts them the same way).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.pagefleet.v1 import pagefleet_pb2 as pb
from protos.pagefleet.v1 import pagefleet_pb2_grpc as pb_grpc
from router.api import Reject, model_info_message, response_message, route_request, status_message
from router.metrics import ServerMetrics

if TYPE_CHECKING:
    from router.router import Router

log = logging.getLogger(__name__)

DEFAULT_PORT = 50151  # gRPC; `pagefleet serve --port`
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # per message, both ways: ~500k token ids or 4 MB of text
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PageFleet"].full_name  # "pagefleet.v1.PageFleet"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class PageFleetServicer(pb_grpc.PageFleetServicer):
    """The API over a router; UNAVAILABLE until `router` is set."""

    def __init__(self) -> None:
        self.router: Router | None = None
        self.metrics: ServerMetrics | None = None

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        t0 = time.perf_counter()
        router = await self._router(context)
        try:
            route, kind = route_request(request, router, f"pf-{uuid.uuid4().hex[:16]}")
        except Reject as r:
            await self._abort(context, r.code, r.message)
        rid, first = route.request_id, True
        try:
            async with contextlib.aclosing(router.generate(route)) as stream:
                async for out in stream:
                    record = router.records.get(rid) if first else None
                    if record is not None and self.metrics is not None:
                        self.metrics.observe_placement(
                            record.group_id, record.reason, record.decision_seconds
                        )
                    if out.finished and self.metrics is not None:
                        self.metrics.observe_finished(out, time.perf_counter() - t0)
                    if kind == pb.OUTPUT_KIND_FINAL_ONLY and not out.finished:
                        continue
                    yield response_message(out, kind, record, time.perf_counter() - t0)
                    first = False
        except asyncio.CancelledError:  # the client cancelled or its deadline passed
            router.abort(rid)  # the stream's `finally` aborted already; this is idempotent
            if self.metrics is not None:
                left = context.time_remaining()
                expired = left is not None and left <= 0
                self.metrics.observe_error("DEADLINE_EXCEEDED" if expired else "CANCELLED")
            raise
        except Exception as e:
            code, message = _status_for(e, rid)
            await self._abort(context, code, message)

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        router = await self._router(context)
        from router.router import RouteRequest

        text = request.text if request.HasField("text") else None
        messages = [{"role": m.role, "content": m.content} for m in request.messages] or None
        try:
            ids = router.tokenize(RouteRequest(prompt=text, messages=messages))
        except ValueError as e:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, _proto_names(str(e)))
        return pb.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        return model_info_message((await self._router(context)).model_info)

    async def GetClusterStatus(self, request, context) -> pb.ClusterStatus:
        router = await self._router(context)
        return pb.ClusterStatus(groups=[status_message(s) for s in router.cluster_status()])

    async def _router(self, context) -> Router:
        if self.router is None:
            await self._abort(
                context, grpc.StatusCode.UNAVAILABLE, "the server is starting: groups are loading"
            )
        return self.router

    async def _abort(self, context, code: grpc.StatusCode, message: str):
        if self.metrics is not None:
            self.metrics.observe_error(code.name)
        await context.abort(code, message)


def _status_for(e: Exception, request_id: str) -> tuple[grpc.StatusCode, str]:
    """A gRPC status for an error from the router or a group; never a traceback."""
    from cluster.prefix_index import PrefixIndexError
    from router.router import NoGroupAvailableError
    from worker.async_engine import EngineDeadError
    from worker.scheduler import QueueFullError

    if isinstance(e, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, _proto_names(str(e))
    if isinstance(e, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e} (request {request_id})"
    if isinstance(e, NoGroupAvailableError):
        return grpc.StatusCode.UNAVAILABLE, f"{e}; retry later (request {request_id})"
    if isinstance(e, EngineDeadError | PrefixIndexError):
        return grpc.StatusCode.UNAVAILABLE, f"request {request_id} failed: {e}; retry"
    log.exception("internal error serving request %s", request_id)
    return (
        grpc.StatusCode.INTERNAL,
        f"internal error while serving request {request_id}; the server log has the details",
    )


def _proto_names(message: str) -> str:
    """Engine messages name SamplingParams fields; callers know them as `sampling.*`."""
    return message.replace("SamplingParams.", "sampling.").replace(
        "prompt token id", "token_ids: token id"
    )


class FrontDoor:
    """A grpc.aio server with the PageFleet API, health and reflection."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {port}")
        if max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {max_message_bytes}")
        self.address = f"{host}:{port}"
        self.max_message_bytes = max_message_bytes
        self.servicer = PageFleetServicer()
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None

    async def start(self) -> int:
        """Bind and start answering (health NOT_SERVING); returns the bound port."""
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.so_reuseport", 0),  # a port in use is an error, not a shared port
            ]
        )
        pb_grpc.add_PageFleetServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        services = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
        reflection.enable_server_reflection((*services, reflection.SERVICE_NAME), self.server)
        for service in ("", SERVICE_NAME):
            await self.health.set(service, _NOT_SERVING)
        self.port = self.server.add_insecure_port(self.address)
        if self.port == 0:
            raise ValueError(f"cannot bind {self.address} (in use?)")
        await self.server.start()
        return self.port

    async def set_ready(self, router: Router, metrics: ServerMetrics | None = None) -> None:
        """Serve `router` (its groups loaded and warmed up) and report SERVING."""
        self.servicer.metrics = metrics
        self.servicer.router = router
        for service in ("", SERVICE_NAME):
            await self.health.set(service, _SERVING)

    async def stop(self, grace: float) -> None:
        """NOT_SERVING, refuse new calls, drain in-flight ones for `grace` seconds, stop."""
        await self.health.enter_graceful_shutdown()
        if self.server is not None:
            await self.server.stop(grace)
