"""The OpenAI-compatible HTTP door: FastAPI on uvicorn (the stack of vLLM's and SGLang's
OpenAI servers), beside the gRPC door and over the same request path (router/door/serving.py):
the same checks, router, metrics, aborts and shutdown.

    POST /v1/completions, /v1/chat/completions   (stream: server-sent events, `data: [DONE]`)
    GET  /v1/models, /health;  POST /tokenize, /detokenize
    POST /v1/documents;  GET, DELETE /v1/documents/{id}   (router/door/documents.py)

Like the gRPC door, it binds before the cluster loads (everything but /health answers 503
until `set_ready`), takes a bearer key per tenant (`keys`, router/door/auth.py) and TLS
(`tls`). A streamed response's headers go out with the first token of every choice, so that
a refusal (a full queue, no live group) is an HTTP status, not an error event; an error after
that is an `error` event before `data: [DONE]`. A client that disconnects, mid-stream or while
waiting for a whole response, aborts its requests: their blocks are freed at once.

Before a byte of a body is read, `Gate` refuses a request without a valid key (401) and one that
declares a body over `max_body_bytes` (413; FastAPI's limit refuses a chunked one as it grows).
Bodies are parsed by `parse_body` (router/door/openai_protocol.py), a large one on a thread of
its own: parsing holds the GIL throughout, and one thread for all large bodies keeps the event
loop (health, streams) from waiting on more than one at a time.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import socket
import ssl
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from router.door.auth import ApiKeys, TlsFiles
from router.door.choices import ClientGone, Merged, until_disconnected
from router.door.documents import add_document_routes
from router.door.http_limits import BoundedHttpToolsProtocol, HeaderLimits
from router.door.limits import Limiter
from router.door.openai_format import Choice, Formatter
from router.door.openai_protocol import (
    HTTP_STATUS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    parse_body,
    validation_message,
)
from router.door.openai_routes import chat_messages, chat_routes, completion_routes
from router.door.serving import (
    RETRY_AFTER_S,
    InFlight,
    Reject,
    check_context,
    invalid,
    outputs,
    status_for,
    tokenize,
)
from worker.token_ids import first_outside

if TYPE_CHECKING:
    from router.door.metrics import ServerMetrics
    from router.router import Router

log = logging.getLogger(__name__)

DEFAULT_HTTP_PORT = 8000  # vLLM's; `pagefleet serve --http-port`
ABORT_FLUSH_S = 5.0  # after the grace period, how long aborted streams have to send their end
# Bodies up to this are parsed on the event loop (well under a millisecond); larger ones on the
# door's parser thread.
INLINE_BODY_BYTES = 64 * 1024


class HttpDoor:
    """The OpenAI-compatible API on uvicorn; see the module docstring."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_HTTP_PORT,
        max_body_bytes: int = 4 * 1024 * 1024,
        keys: ApiKeys | None = None,
        tls: TlsFiles | None = None,
        header_limits: HeaderLimits | None = None,
    ) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"http_port must be in [0, 65535], got {port}")
        self.host, self.port, self.keys, self.tls = host, port, keys, tls
        self.header_limits = header_limits or HeaderLimits()
        self.router: Router | None = None
        self.metrics: ServerMetrics | None = None
        self.in_flight = InFlight()
        self.limiter: Limiter | None = None  # tenants' limits (router/door/limits.py)
        self.stopping = False
        self.app = Gate(build_app(self, max_body_bytes), self, max_body_bytes)
        self.parser = ThreadPoolExecutor(1, thread_name_prefix="http-body")
        self._server: uvicorn.Server | None = None
        self._main: asyncio.Future | None = None

    async def start(self) -> int:
        """Bind and start answering (503 until `set_ready`); returns the bound port."""
        sock = _bind(self.host, self.port)
        protocol = functools.partial(BoundedHttpToolsProtocol, limits=self.header_limits, observe=self.observe_error)
        config = uvicorn.Config(
            self.app,
            http=protocol,
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=None,
            **(self.tls.uvicorn_options() if self.tls else {}),
        )
        try:
            config.load()
        except (ssl.SSLError, OSError) as e:
            sock.close()
            raise ValueError(f"tls_cert / tls_key / tls_client_ca: {e}") from None
        self._server = uvicorn.Server(config)
        self._server.lifespan = config.lifespan_class(config)
        await self._server.startup(sockets=[sock])
        self._main = asyncio.ensure_future(self._server.main_loop())
        self.port = sock.getsockname()[1]
        return self.port

    def set_ready(self, router: Router, metrics: ServerMetrics | None = None, limiter: Limiter | None = None) -> None:
        self.metrics = metrics
        self.limiter = limiter
        self.router = router
        decode = router.tokenizer.decode if router.tokenizer is not None else str
        self.token_text = functools.lru_cache(maxsize=1 << 16)(lambda t: decode([t]))

    async def stop(self, grace: float) -> None:
        """Refuse new connections and requests, let requests in flight finish for `grace`
        seconds, then abort the rest (each stream ends with finish reason "abort")."""
        if self._server is None:
            return
        self.stopping = True
        self._server.should_exit = True
        self._server.config.timeout_graceful_shutdown = grace + ABORT_FLUSH_S
        await self._main
        closed = asyncio.ensure_future(self._server.shutdown())
        await self.in_flight.finish_or_abort(self.router, grace)
        await closed
        self.parser.shutdown(wait=False)

    # ---- the request path ---------------------------------------------------------------
    def caller(self, request: Request) -> str | None:
        """The tenant of the request's key, as `Gate` found it (None without keys)."""
        if self.keys is None:
            return None
        tenant = request.scope.get("state", {}).get("tenant")
        return tenant if tenant is not None else self.tenant(request.headers.get("authorization"))

    def tenant(self, given: str | None) -> str:
        """The tenant of an `Authorization` header's value; 401 unless it names a key."""
        tenant = self.keys.tenant(given)
        if tenant is None:
            what = "no API key" if given is None else "an API key that is not valid"
            raise Reject(
                grpc.StatusCode.UNAUTHENTICATED,
                f"the request has {what}; send the header 'Authorization: Bearer KEY'",
            )
        return tenant

    def ready(self, model: str | None = None) -> Router:
        if self.stopping:
            raise Reject(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if self.router is None:
            raise Reject(grpc.StatusCode.UNAVAILABLE, "the server is starting: groups are loading")
        if model is not None and model != self.router.model_info.model:
            raise Reject(
                grpc.StatusCode.NOT_FOUND,
                f"The model `{model[:200]}` does not exist; this server serves "
                f"`{self.router.model_info.model}` (GET /v1/models)",
                "model",
            )
        return self.router

    async def body(self, request: Request, model: type[BaseModel]) -> BaseModel:
        """The request's body as `model` (a 400 naming the field if it is not one); a large body
        is parsed on the parser thread (module docstring)."""
        raw = await request.body()
        try:
            if len(raw) <= INLINE_BODY_BYTES:
                return parse_body(model, raw)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.parser, parse_body, model, raw)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None

    async def generate(self, request: Request, chat: bool) -> Response:
        """A completion or chat completion, whole or streamed."""
        t0 = time.perf_counter()
        tenant = self.caller(request)
        body = await self.body(request, ChatCompletionRequest if chat else CompletionRequest)
        router = self.ready(body.model)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        make = chat_routes if chat else completion_routes
        routes = await make(body, router, rid, tenant)
        streams = [outputs(router, r, self.metrics, self.in_flight, t0, limiter=self.limiter) for r in routes.routes]
        merged = Merged(streams, routes.n)
        choices = [Choice(i, i // routes.n) for i in range(len(streams))]
        fmt = Formatter(chat, rid, router.model_info.model, self.token_text, body.return_token_ids, routes.tool_calls)
        prompts = [len(p) for p in routes.prompts]
        try:
            if not body.stream:
                try:
                    await until_disconnected(request, _collect(merged, choices))
                finally:
                    await merged.aclose()
                return JSONResponse(fmt.response(choices, prompts))
            try:
                primed = await until_disconnected(request, merged.prime())
            except BaseException:
                await merged.aclose()
                raise
        except ClientGone:  # (each stream counted its own end)
            return Response(status_code=499)
        except Exception as e:
            wait = e.retry_after if isinstance(e, Reject) else None
            code, message, param = _http_status(e, rid)
            message, param = routes.named(message, param)  # (a group refused the constraint)
            raise Reject(code, message, param, counted=True, retry_after=wait) from None
        usage = body.stream_options is not None and body.stream_options.include_usage
        events = self._events(merged, primed, choices, fmt, prompts if usage else None, rid)
        return StreamingResponse(events, media_type="text/event-stream")

    async def _events(self, merged: Merged, primed, choices, fmt: Formatter, prompts, rid: str):
        """The stream's server-sent events, ending with `data: [DONE]`."""
        try:
            for i, (out, record) in primed:
                yield _sse(_step(fmt, choices[i], out, record))
            async for i, (out, record) in merged.items():
                yield _sse(_step(fmt, choices[i], out, record))
            if prompts is not None:
                yield _sse(fmt.usage_chunk(choices, prompts))
        except Exception as e:  # (each stream counts its own end)
            code, message = _http_status(e, rid)
            yield _sse(error_body(code, message))
        finally:  # the client disconnected, or a choice failed: the others end here
            merged.cancel()
        yield "data: [DONE]\n\n"

    def observe_error(self, code_name: str) -> None:
        if self.metrics is not None:
            self.metrics.observe_error(code_name)


def _step(fmt: Formatter, choice: Choice, out, record) -> dict:
    choice.last = out
    if record is not None:
        choice.record = record
    return fmt.chunk(choice, out, record)


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def _collect(merged: Merged, choices: list[Choice]) -> None:
    async for i, (out, record) in merged.items():
        choices[i].last = out
        if record is not None:
            choices[i].record = record


def _http_status(e: Exception, request_id: str) -> tuple[grpc.StatusCode, str, str | None]:
    if isinstance(e, Reject):
        return e.code, e.message, e.param
    code, message = status_for(e, request_id)
    return code, message.replace("SamplingParams.", ""), None


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port); a port in use is a ValueError, not uvicorn's exit."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ValueError(f"cannot bind {host}:{port} ({e})") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot bind {host}:{port} ({e.strerror}; in use?)") from None
    return sock


# ---- the app --------------------------------------------------------------------------------


class ErrorResponse(JSONResponse):
    """An error body in ASCII JSON: a message may echo what the client sent (a model's name, a
    field's), and what Python's strings can hold (a lone surrogate) UTF-8 cannot encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def error_response(
    code: grpc.StatusCode, message: str, param: str | None = None, retry_after: float | None = None
) -> Response:
    """OpenAI's error body for a door status, with its HTTP status (and Retry-After: whole
    seconds, at least 1)."""
    status = HTTP_STATUS.get(code, HTTP_STATUS[grpc.StatusCode.INTERNAL])[0]
    wait = RETRY_AFTER_S if retry_after is None else max(1, math.ceil(retry_after))
    headers = {"Retry-After": str(wait)} if status in (429, 503) else None
    return ErrorResponse(error_body(code, message, param), status, headers=headers)


def _plain_error(status: int, message: str) -> Response:
    """An error body for an HTTP status that no door status stands for (404, 405, 413): the
    body of an invalid argument."""
    return ErrorResponse(error_body(grpc.StatusCode.INVALID_ARGUMENT, message), status)


class Gate:
    """What the door refuses before a byte of the body is read, counted in the metrics like its
    other errors: a request without a valid key (401; every path but /health, which load
    balancers probe without one: a client without a key makes the door read nothing), and a
    Content-Length over the limit (413) or not a number (400). FastAPI's limit, inside, would
    answer the latter in plain text; a chunked body that grows past it is refused by it through
    the error handlers. The key's tenant goes on in the scope's state (`HttpDoor.caller`)."""

    def __init__(self, app, door: HttpDoor, max_bytes: int) -> None:
        self.app = app
        self.door = door
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)

    def refusal(self, scope) -> Response | None:
        headers = dict(scope["headers"])
        if self.door.keys is not None and scope["path"] != "/health":
            given = headers.get(b"authorization")
            try:
                tenant = self.door.tenant(None if given is None else given.decode("latin-1"))
            except Reject as r:
                self.door.observe_error(r.code.name)
                return error_response(r.code, r.message, r.param)
            scope.setdefault("state", {})["tenant"] = tenant
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit():
            self.door.observe_error(grpc.StatusCode.INVALID_ARGUMENT.name)
            return _plain_error(400, "the Content-Length header is not a number")
        if int(declared) > self.max_bytes:
            self.door.observe_error("HTTP_413")  # (as the handlers count FastAPI's 413)
            return _plain_error(413, f"the request body is over {self.max_bytes} bytes")
        return None


def build_app(door: HttpDoor, max_body_bytes: int) -> FastAPI:
    """The routes and the error handlers (every error in OpenAI's error body)."""
    app = FastAPI(title="pagefleet", docs_url=None, redoc_url=None, openapi_url=None, max_body_size=max_body_bytes)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await door.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await door.generate(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        door.caller(request)
        info = door.ready().model_info
        model = {
            "id": info.model,
            "object": "model",
            "created": 0,
            "owned_by": "pagefleet",
            "root": info.model,
            "max_model_len": info.max_model_len,
        }
        return {"object": "list", "data": [model]}

    @app.get("/health")
    async def health() -> Response:
        router = door.router
        alive = router is not None and not door.stopping and any(s.alive for s in router.cluster_status())
        return Response(status_code=200 if alive else 503)

    @app.post("/tokenize")
    async def tokenize_(request: Request) -> dict:
        door.caller(request)
        body = await door.body(request, TokenizeRequest)
        router = door.ready(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise invalid("give exactly one of prompt or messages", "prompt")
        context = router.model_info.max_model_len
        messages = None if body.messages is None else chat_messages(body.messages, context)
        ids = await tokenize(router, text=body.prompt, messages=messages)
        check_context(len(ids), None, router.model_info.max_model_len, "max_tokens")
        return {"count": len(ids), "max_model_len": router.model_info.max_model_len, "tokens": ids.tolist()}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        door.caller(request)
        body = await door.body(request, DetokenizeRequest)
        router = door.ready(body.model)
        vocab, tokens = router.model_info.vocab_size, body.tokens  # (n,) int64
        if (i := first_outside(tokens, vocab)) is not None:
            raise invalid(f"tokens[{i}] = {tokens[i]} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": await asyncio.to_thread(router.tokenizer.decode, tokens.tolist())}

    add_document_routes(app, door)  # (router/door/documents.py)
    _add_error_handlers(app, door, max_body_bytes)
    return app


def _add_error_handlers(app: FastAPI, door: HttpDoor, max_body_bytes: int) -> None:
    def respond(
        code: grpc.StatusCode, message: str, param: str | None, counted: bool = False, retry_after: float | None = None
    ) -> Response:
        if not counted:
            door.observe_error(code.name)
        return error_response(code, message, param, retry_after)

    @app.exception_handler(Reject)
    async def rejected(request: Request, r: Reject) -> Response:
        return respond(r.code, r.message, r.param, r.counted, r.retry_after)

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, e: RequestValidationError) -> Response:
        message, param = validation_message(e.errors())
        return respond(grpc.StatusCode.INVALID_ARGUMENT, message, param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        message = {
            413: f"the request body is over {max_body_bytes} bytes",
            404: f"no route {request.url.path}",
            405: f"method {request.method} is not allowed here",
        }.get(e.status_code, str(e.detail))
        door.observe_error(f"HTTP_{e.status_code}")
        return _plain_error(e.status_code, message)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> Response:
        code, message, param = _http_status(e, "?")
        return respond(code, message, param)
