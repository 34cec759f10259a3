"""Bounds on what the HTTP door holds for a request's head (its request line and headers), in
uvicorn's httptools protocol, below the app: httptools (llhttp) keeps a header line however long
and counts no headers, and uvicorn times out only an idle kept-alive connection, never one still
sending its head. Without these bounds a client holds memory and a connection for free, with no
key: a 1 MB header line, 20,000 header lines, or an unterminated 32 MiB header.

A head over `max_bytes` is answered 431 and one with more than `max_count` headers 431 too; a
head not complete within `timeout_s` of its first byte (of the connection's start, for its first
request) is answered 408 (a connection that sent nothing is closed). Each closes the connection,
and is counted in the door's errors as HTTP_431 or HTTP_408.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.door.openai_protocol import error_body


@dataclass(frozen=True)
class HeaderLimits:
    """How large a request's head may be, and how long it may take to arrive (`ServeConfig`'s
    `http_headers`). The defaults are far above what any client of the API sends (a key and a
    few headers: well under 4 KiB) and near common servers' (nginx: 4 x 8 KiB buffers; Node:
    16 KiB)."""

    max_bytes: int = 64 * 1024  # the request line and every header line, together
    max_count: int = 100  # header lines
    timeout_s: float = 10.0  # from the head's first byte to its end

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_count"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"http_headers.{name} must be a positive integer, got {value!r}")
        if not (isinstance(self.timeout_s, int | float) and self.timeout_s > 0):
            raise ValueError(f"http_headers.timeout_s must be > 0, got {self.timeout_s!r}")


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with `HeaderLimits` on each request's head. `observe` counts
    a refusal by its code name (`HttpDoor.observe_error`)."""

    def __init__(self, *args, limits: HeaderLimits, observe: Callable[[str], None], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits, self.observe = limits, observe
        self.in_head = True  # receiving a request's head (the connection's first, at first)
        self.head_bytes = 0
        self.head_count = 0
        self.head_timer = None
        self.refusal: tuple[int, str] | None = None  # set by a parser callback that refuses

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._start_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feed the parser at most what the head may still take; the body goes on as uvicorn
        takes it (its flow control bounds what it holds)."""
        while data and not self.transport.is_closing():
            if not self.in_head:
                return super().data_received(data)
            room = self.limits.max_bytes - self.head_bytes
            if room <= 0:
                return self.refuse(431, f"the request's headers are over {self.limits.max_bytes} bytes")
            part, data = data[:room], data[room:]
            self.head_bytes += len(part)
            super().data_received(part)

    # ---- parser callbacks -------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.in_head, self.head_count = True, 0
        self._start_head_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_count += 1
        if self.head_count > self.limits.max_count:
            self.refusal = (431, f"the request has over {self.limits.max_count} headers")
            raise ValueError(self.refusal[1])  # stops the parser: uvicorn sends its 400 (below)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self.in_head = False
        self._stop_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.in_head, self.head_bytes = True, 0  # the next request's head (timed from its start)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a parser error, which a refusal of ours raised to stop it."""
        self.refuse(*(self.refusal or (400, msg)))

    # ---- refusals ---------------------------------------------------------------------------
    def refuse(self, status: int, message: str) -> None:
        """Answer `status` with OpenAI's error body and close the connection."""
        self._stop_head_timer()
        if self.transport.is_closing():
            return
        self.observe(f"HTTP_{status}")
        body = json.dumps(error_body(grpc.StatusCode.INVALID_ARGUMENT, message)).encode()
        reason = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (status, reason, len(body), body)
        )
        self.transport.close()

    def _on_head_timeout(self) -> None:
        self.head_timer = None
        if self.head_bytes == 0:  # nothing sent: nothing to answer
            self.transport.close()
        else:
            self.refuse(408, f"the request's headers did not arrive within {self.limits.timeout_s:g} s")

    def _start_head_timer(self) -> None:
        if self.head_timer is None:
            self.head_timer = self.loop.call_later(self.limits.timeout_s, self._on_head_timeout)

    def _stop_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
