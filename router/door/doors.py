"""Both doors of one server: gRPC always, the OpenAI-compatible HTTP door unless its port is
None, with the same API keys and TLS files, started, made ready and stopped together."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from router.door.auth import ApiKeys, TlsFiles
from router.door.http import HttpDoor
from router.door.http_limits import HeaderLimits
from router.door.server import FrontDoor

if TYPE_CHECKING:
    from router.door.limits import Limiter
    from router.door.metrics import ServerMetrics
    from router.router import Router


class Doors:
    """`FrontDoor` and, with `http_port`, `HttpDoor` (its heads bounded by `header_limits`), on
    one host."""

    def __init__(
        self,
        host: str,
        port: int,
        http_port: int | None,
        max_message_bytes: int,
        keys: ApiKeys | None = None,
        tls: TlsFiles | None = None,
        header_limits: HeaderLimits | None = None,
    ) -> None:
        self.host = host
        self.grpc = FrontDoor(host, port, max_message_bytes, keys, tls)
        self.http = None
        if http_port is not None:
            self.http = HttpDoor(host, http_port, max_message_bytes, keys, tls, header_limits)

    async def start(self) -> str:
        """Bind both (health NOT_SERVING, the APIs UNAVAILABLE / 503); returns where, as
        "gRPC on HOST:PORT, HTTP on HOST:PORT"."""
        port = await self.grpc.start()
        where = f"gRPC on {self.host}:{port}"
        if self.http is not None:
            try:
                where += f", HTTP on {self.host}:{await self.http.start()}"
            except BaseException:
                await self.grpc.stop(0)
                raise
        return where

    async def set_ready(
        self, router: Router, metrics: ServerMetrics | None = None, limiter: Limiter | None = None
    ) -> None:
        """Serve `router` through both doors, observed by `metrics`, under the tenants' limits
        of `limiter` (router/door/limits.py; None: none)."""
        if self.http is not None:
            self.http.set_ready(router, metrics, limiter)
        await self.grpc.set_ready(router, metrics, limiter)

    async def stop(self, grace: float) -> None:
        """Both at once: each lets its requests finish for `grace`, then aborts the rest."""
        stops = [self.grpc.stop(grace)] + ([] if self.http is None else [self.http.stop(grace)])
        await asyncio.gather(*stops)
