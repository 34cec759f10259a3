"""Running a server built from a `ServeConfig`, and stopping it.

Start-up order, so that "ready" means ready: bind both doors (health NOT_SERVING), load the
groups on a thread, run one tiny generation through every group, start the metrics endpoint,
then report SERVING. SIGTERM or SIGINT: NOT_SERVING, drain in-flight calls for `grace_s`, stop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TypeVar
from wsgiref.simple_server import WSGIServer

from cluster.group import GroupHandle
from cluster.ray.runtime import shutdown_ray
from router.door.doors import Doors
from router.door.metrics import ServerMetrics, serve_metrics
from router.launch.build import Cluster, build_cluster, door_security, make_doors, start_ray
from router.launch.config import ServeConfig
from worker.config import take_cluster_secret
from worker.heap import settle_heap
from worker.protocol import GenerationRequest
from worker.sampling_params import SamplingParams

# The router's event loop shares the GIL with its background threads (the pending-placement
# writer, the index mirror's follower, in-process engines); a decision waiting on one of them
# gets the GIL back after this, not after the default 5 ms (the decision's p99: RESULTS.md).
ROUTER_SWITCH_INTERVAL_S = 0.0005

T = TypeVar("T")


async def serve(config: ServeConfig) -> int:
    """Run the server until SIGTERM/SIGINT; returns the exit code."""
    keys, tls = door_security(config)
    sys.setswitchinterval(ROUTER_SWITCH_INTERVAL_S)
    doors = make_doors(config, keys, tls)
    doors_at = await doors.start()
    _say(f"{doors_at}: loading {config.cluster.groups} group(s)")
    stop = asyncio.Event()
    cluster: Cluster | None = None
    metrics_http: WSGIServer | None = None
    secret = take_cluster_secret()  # before Ray starts processes that would inherit it
    try:
        if config.cluster.uses_ray:
            where = config.cluster.address or "a local runtime on 127.0.0.1"
            _say(f"Ray: {'joining' if config.cluster.address else 'starting'} {where}")
            start_ray(config)  # on the main thread (blocks the loop for a few seconds)
        # After Ray: on the main thread, Ray installs handlers that end the process at once.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        cluster = await _until_stopped(_in_daemon_thread(build_cluster, config, secret), stop)
        if cluster is not None:
            if keys is not None:  # the keys' tenants are named in the metrics too
                cluster.metrics.tenants |= keys.tenants
            metrics_http = await _ready(config, cluster, doors)
            where = "" if metrics_http is None else f", metrics on {_metrics_url(config, metrics_http)}"
            _say(f"ready: {doors_at}{where}")
            await stop.wait()
        _say(f"stopping: draining in-flight requests for up to {config.doors.grace_s:g} s")
        await doors.stop(config.doors.grace_s)
        _say("stopped")
        return 0
    except BaseException:
        await doors.stop(0)
        raise
    finally:
        if metrics_http is not None:
            metrics_http.shutdown()
        if cluster is not None:
            cluster.shutdown()
        if config.cluster.uses_ray:  # a local runtime's processes stop with it; a cluster is left
            shutdown_ray()


async def _ready(config: ServeConfig, cluster: Cluster, doors: Doors) -> WSGIServer | None:
    """Warm the groups, follow them, start the metrics endpoint and open the doors."""
    await warm_up(cluster.groups)
    cluster.follow(asyncio.get_running_loop())
    # what is built by now (the groups, the tokenizer, the index as loaded) lives as long as
    # the server: frozen, a full collection no longer walks it, which would stall the event
    # loop noticeably at 64 groups (worker/heap.py)
    settle_heap()
    metrics_http = _serve_metrics(config, cluster.metrics)
    await doors.set_ready(cluster.router, cluster.metrics, cluster.limiter)
    return metrics_http


async def warm_up(groups: list[GroupHandle]) -> None:
    """One tiny greedy generation through every group: weights touched, kernels compiled."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for group in groups:
        rid = f"warmup-{group.group_id}-{os.urandom(4).hex()}"  # (other routers warm it too)
        async for _ in group.generate(GenerationRequest([0], params, request_id=rid)):
            pass


def _in_daemon_thread(fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
    """`fn(*args)` on a daemon thread (a load cannot be interrupted, but must not keep a
    stopped server's process alive), as a future of the running loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # delivered to the awaiting coroutine
            loop.call_soon_threadsafe(_settle, future, None, e)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    threading.Thread(target=run, name="pagefleet-load", daemon=True).start()
    return future


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def _until_stopped(task: asyncio.Future[T], stop: asyncio.Event) -> T | None:
    """`task`'s result, or None if `stop` is set first."""
    stopper = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    return task.result() if task in done else None


def _serve_metrics(config: ServeConfig, metrics: ServerMetrics) -> WSGIServer | None:
    if config.doors.metrics_port is None:
        return None
    return serve_metrics(metrics, config.doors.metrics_host, config.doors.metrics_port)


def _metrics_url(config: ServeConfig, server: WSGIServer) -> str:
    return f"http://{config.doors.metrics_host}:{server.server_port}/metrics"


def _say(message: str) -> None:
    print(f"pagefleet serve: {message}", file=sys.stdout, flush=True)
