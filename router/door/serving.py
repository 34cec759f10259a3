"""The request path both doors share: the same checks, tokenization, router stream, metrics,
aborts and error statuses, whether a request came over gRPC or HTTP.

Errors are spoken in gRPC status codes (`Reject.code`, `status_for`): the gRPC door sends them
as they are, the HTTP door maps each to its HTTP status (router/door/openai_protocol.py), and
the metrics count them under one name whichever door refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

import grpc

from cluster.index import PrefixIndexError
from router.door.limits import Limiter, RateLimited, RedisLimiter
from router.door.metrics import Unobserved
from router.router import CheckedRequest, NoGroupAvailableError, PromptTooLongError
from worker.hashing import cache_namespace
from worker.protocol import EngineDeadError, QueueFullError, Resume
from worker.sampling_params import SamplingParams
from worker.token_ids import CheckedIds

if TYPE_CHECKING:
    from router.door.metrics import ServerMetrics
    from router.router import Router, RouteRecord
    from worker.outputs import RequestOutput
    from worker.tools import Tool

log = logging.getLogger(__name__)

# What a client refused for full queues is told to wait (gRPC's retry pushback, HTTP's
# Retry-After): a group's queue drains in about that.
RETRY_AFTER_S = 1

MAX_CACHE_SALT_CHARS = 256


class Reject(Exception):
    """A request refused at the door: a status code and a message naming the field (`param`:
    the field, for the HTTP door's error body). `counted`: the error of a stream, which its
    metrics observer counted already."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        param: str | None = None,
        counted: bool = False,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.counted = counted
        self.retry_after = retry_after  # seconds, for a refusal the client may retry


def invalid(message: str, param: str | None = None) -> Reject:
    return Reject(grpc.StatusCode.INVALID_ARGUMENT, message, param)


def check_context(
    num_prompt: int, max_tokens: int | None, max_model_len: int, field: str = "sampling.max_tokens"
) -> None:
    """OUT_OF_RANGE unless the prompt, plus max_tokens when given, fits the context; `field`
    is how the caller's API names max_tokens."""
    if num_prompt >= max_model_len:
        raise Reject(
            grpc.StatusCode.OUT_OF_RANGE,
            f"prompt is {num_prompt} tokens; the model's context is {max_model_len} tokens (prompt + {field} must fit)",
        )
    if max_tokens is not None and num_prompt + max_tokens > max_model_len:
        raise Reject(
            grpc.StatusCode.OUT_OF_RANGE,
            f"{field} ({max_tokens}) plus the prompt ({num_prompt} tokens) is over the model's "
            f"context of {max_model_len} tokens; lower {field} to at most "
            f"{max_model_len - num_prompt}",
        )


def request_salt(key_tenant: str | None, cache_salt: str | None = None, tenant: str | None = None) -> str | None:
    """The salt a request's blocks are keyed by. With API keys, the key's tenant: a request may
    repeat it but not name another, nor set a raw salt. Without keys, the client's `tenant` or
    `cache_salt` (at most one), each in its own namespace (worker/hashing.py)."""
    if key_tenant is not None:
        if tenant and tenant != key_tenant:
            raise Reject(
                grpc.StatusCode.PERMISSION_DENIED,
                "tenant is not the tenant of the API key",
                "tenant",
            )
        if cache_salt:
            raise invalid(
                "cache_salt cannot be set with an API key: the key's tenant keys the cache",
                "cache_salt",
            )
        return cache_namespace(tenant=key_tenant)
    if cache_salt and tenant:
        raise invalid("give cache_salt or tenant, not both", "cache_salt")
    if cache_salt and (len(cache_salt) > MAX_CACHE_SALT_CHARS or not cache_salt.isprintable()):
        raise invalid(
            f"cache_salt must be 1-{MAX_CACHE_SALT_CHARS} printable characters, got {len(cache_salt)} characters",
            "cache_salt",
        )
    return cache_namespace(cache_salt=cache_salt, tenant=tenant)


async def tokenize(
    router: Router, text: str | None = None, messages: Sequence[dict] | None = None, tools: Sequence[Tool] | None = None
) -> CheckedIds:
    """The token ids of `text` or chat `messages` (one of them; messages counted with
    `check_message_count` before they were built), rendered with the model's chat template
    (with `tools`),
    computed on a worker thread after the checks that refuse at once what cannot fit the
    context: a long prompt must not stall the event loop, which serves every other call."""
    try:
        return (await asyncio.to_thread(router.tokenized, text, messages, tools))[1]
    except PromptTooLongError as e:
        raise Reject(grpc.StatusCode.OUT_OF_RANGE, str(e)) from None
    except ValueError as e:
        raise invalid(str(e)) from None


def checked_request(
    router: Router,
    ids: CheckedIds,
    params: SamplingParams,
    request_id: str,
    priority: int = 0,
    cache_salt: str | None = None,
    resume: Resume | None = None,
    max_tokens_field: str = "sampling.max_tokens",
    tenant: str | None = None,
) -> CheckedRequest:
    """The request the router takes, once its prompt fits the context (OUT_OF_RANGE naming
    `max_tokens_field` otherwise): every door builds its requests here. `tenant`: the caller's
    (its API key's, or the one it named without keys), whose fair share it counts against."""
    check_context(len(ids), params.max_tokens, router.model_info.max_model_len, max_tokens_field)
    return CheckedRequest(ids, params, request_id, priority, cache_salt, resume, tenant or "")


def check_message_count(count: int, context: int) -> None:
    """OUT_OF_RANGE for more chat messages than the context has tokens, before anything is
    built for each."""
    if count > context:
        raise Reject(
            grpc.StatusCode.OUT_OF_RANGE,
            f"messages has {count} entries; the model's context of {context} tokens cannot hold that many",
        )


class InFlight:
    """The requests in flight at one door, so that a stop can let them finish for a grace
    period and then abort the rest in their groups (each stream then ends with its tokens so
    far and finish reason "abort", rather than being cut off)."""

    def __init__(self) -> None:
        self.ids: dict[object, str] = {}  # one entry per stream: its request id
        self._idle = asyncio.Event()  # set while nothing is in flight
        self._idle.set()

    @contextlib.contextmanager
    def track(self, request_id: str):
        token = object()
        self.ids[token] = request_id
        self._idle.clear()
        try:
            yield
        finally:
            del self.ids[token]
            if not self.ids:
                self._idle.set()

    async def finish_or_abort(self, router: Router | None, grace: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace)
        if router is not None:
            for rid in list(self.ids.values()):
                router.abort(rid)


async def outputs(
    router: Router,
    route: CheckedRequest,
    metrics: ServerMetrics | None,
    in_flight: InFlight,
    t0: float,
    cancelled_code: Callable[[], str] = lambda: "CANCELLED",
    limiter: Limiter | None = None,
) -> AsyncIterator[tuple[RequestOutput, RouteRecord | None]]:
    """The router's stream for `route`, each output with the route's record when it is new (the
    first output's, and a resumed stream's first on its new group; None otherwise). The
    request's metrics are observed from `t0` (the door's receipt, time.perf_counter) to its end,
    once however it ends: finished, failed (the status its error maps to) or closed early
    (`cancelled_code()`: CANCELLED, or DEADLINE_EXCEEDED when the door knows the deadline
    passed). Closing or cancelling the stream aborts the request in its group (its blocks are
    freed at once). With a `limiter`, the request is admitted under its tenant's limits first
    (router/door/limits.py: RESOURCE_EXHAUSTED with when to retry, otherwise)."""
    rid = route.request_id
    seen = metrics.request(t0, route.tenant) if metrics is not None else Unobserved()
    limited = limiter is not None and limiter.applies(route.tenant)
    generated = 0
    with in_flight.track(rid):
        try:
            if limited:
                await _admit(limiter, route, metrics)
            async with contextlib.aclosing(router.stream(route)) as stream:
                async for out, placed in stream:
                    if placed is not None:  # new to this caller: the first, or a move's first
                        seen.placed(placed)
                    seen.output(out)  # (a finished output ends the request here)
                    generated += len(out.new_token_ids)
                    yield out, placed
            seen.fail("UNKNOWN")  # a stream without a finished output (never, by contract)
        except (asyncio.CancelledError, GeneratorExit):
            router.abort(rid)  # the stream's `finally` aborted already; this is idempotent
            seen.fail(cancelled_code())
            raise
        except Exception as e:
            seen.fail(error_code(e).name)
            if limited and isinstance(e, Reject) and e.retry_after is not None:
                limited = False  # (refused: never admitted, nothing to release)
            raise
        finally:
            if limited:  # off the loop: a Redis round trip must not hold it
                asyncio.get_running_loop().run_in_executor(None, limiter.finish, route.tenant, rid, generated)


async def _admit(limiter: Limiter, route: CheckedRequest, metrics: ServerMetrics | None) -> None:
    """Count the request in under its tenant's limits, or refuse it (RESOURCE_EXHAUSTED)."""
    try:
        if isinstance(limiter, RedisLimiter):
            await asyncio.to_thread(limiter.admit, route.tenant, route.request_id, len(route.ids))
        else:
            limiter.admit(route.tenant, route.request_id, len(route.ids))
    except RateLimited as e:
        if metrics is not None:
            metrics.refused(e.tenant, e.limit)
        message = f"{e}; retry after {e.retry_after_s:.3g} s"
        raise Reject(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_after=e.retry_after_s) from None


def error_code(e: Exception) -> grpc.StatusCode:
    """The status an error from the router or a group is answered with."""
    if isinstance(e, Reject):
        return e.code
    if isinstance(e, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(e, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(e, NoGroupAvailableError | EngineDeadError | PrefixIndexError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def status_for(e: Exception, request_id: str) -> tuple[grpc.StatusCode, str]:
    """A status and a message for an error from the router or a group; never a traceback."""
    code = error_code(e)
    if isinstance(e, Reject):
        return code, e.message
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return code, str(e)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return code, f"{e}; retry after {RETRY_AFTER_S:g} s (request {request_id})"
    if isinstance(e, NoGroupAvailableError):
        return code, f"{e}; retry later (request {request_id})"
    if code == grpc.StatusCode.UNAVAILABLE:
        return code, f"request {request_id} failed: {e}; retry"
    log.exception("internal error serving request %s", request_id)
    return (
        code,
        f"internal error while serving request {request_id}; the server log has the details",
    )
