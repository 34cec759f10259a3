"""Both doors of one server: gRPC always, the OpenAI-compatible HTTP door unless its port is
None, with the same API keys and TLS files, started, made ready and stopped together."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from router.door.auth import ApiKeys, TlsFiles, is_loopback
from router.door.http import HttpDoor
from router.door.http_limits import HeaderLimits
from router.door.server import FrontDoor

if TYPE_CHECKING:
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

    async def set_ready(self, router: Router, metrics: ServerMetrics | None = None) -> None:
        if self.http is not None:
            self.http.set_ready(router, metrics)
        await self.grpc.set_ready(router, metrics)

    async def stop(self, grace: float) -> None:
        """Both at once: each lets its requests finish for `grace`, then aborts the rest."""
        stops = [self.grpc.stop(grace)] + ([] if self.http is None else [self.http.stop(grace)])
        await asyncio.gather(*stops)


def door_security(config) -> tuple[ApiKeys | None, TlsFiles | None]:
    """The doors' keys and TLS files from a `ServeConfig`. Without a key, the doors bind
    loopback only unless the operator says `allow_unauthenticated`: anyone who reaches an open
    door may use it, and read what its cache holds."""
    keys = ApiKeys.load(config.api_key, config.api_key_file)
    tls = None
    if config.tls_cert is not None:
        tls = TlsFiles(config.tls_cert, config.tls_key, config.tls_client_ca)
    if keys is None and not config.allow_unauthenticated and not is_loopback(config.host):
        raise ValueError(
            f"host {config.host} is not a loopback address and no API key is configured: give "
            "--api-key-file (or --api-key), or --allow-unauthenticated to serve anyone who "
            "reaches the port"
        )
    return keys, tls
