"""`pagefleet serve`: build the cluster from a `ServeConfig` and serve it over gRPC and the
OpenAI-compatible HTTP API.

The embedded default (no flags) is one TP=1 group on this machine's CPU, the in-process prefix
index, SmolLM2-135M-Instruct, gRPC on 127.0.0.1:50151, HTTP on 127.0.0.1:8000 and metrics on
127.0.0.1:9151. Both doors take the same API keys (one tenant per key) and TLS files; without
a key they bind loopback only unless told otherwise (`door_security`). That
group runs in this process: a local Ray runtime and a Ray-placed group would add tens of
seconds to start-up on a small CPU host (`ray` opts in). The same config with `model`, `tp`, `groups`,
`redis` and `address` is the multi-node deployment: with `ray`, `tp > 1`, `groups > 1` or a Ray
`address`, groups are Ray-placed (`cluster/ray/group.py`), on the cluster at `address` or on a
local runtime, and publish their KV events and load to the index like in-process groups. All
groups and the router share one cluster secret (PAGEFLEET_CLUSTER_SECRET, or a random one).

Start-up order, so that "ready" means ready: bind both doors (health NOT_SERVING), load the
groups on a thread, run one tiny generation through every group, start the metrics endpoint,
then report SERVING. SIGTERM or SIGINT: NOT_SERVING, drain in-flight calls for `grace_s`, stop.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from router.door.doors import Doors, door_security
from router.door.http import DEFAULT_HTTP_PORT
from router.door.http_limits import HeaderLimits
from router.door.server import DEFAULT_PORT, MAX_MESSAGE_BYTES
from worker.heap import settle_heap
from worker.model_source import check_model_name

log = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9151
# The router's event loop shares the GIL with its background threads (the pending-placement
# writer, the index mirror's follower, in-process engines); a decision waiting on one of them
# gets the GIL back after this, not after the default 5 ms (the decision's p99: RESULTS.md).
ROUTER_SWITCH_INTERVAL_S = 0.0005


class ServeError(RuntimeError):
    """The server cannot start as configured; the message tells the operator what to change."""


@dataclass(frozen=True)
class ServeConfig:
    """What `pagefleet serve` builds; flags and the YAML `--config` use these names."""

    model: str | None = None  # model dir or .gguf; None: the default model; "builtin": random
    tp: int = 1  # devices per group (tensor parallel)
    groups: int = 1
    redis: str | None = None  # redis://host:port for the shared prefix index
    address: str | None = None  # Ray address ("auto", "ray://head:10001"); None: see `ray`
    ray: bool = False  # Ray-placed groups on a local runtime even for one TP=1 group
    host: str = "127.0.0.1"  # both doors; not loopback needs a key or allow_unauthenticated
    port: int = DEFAULT_PORT
    http_port: int | None = DEFAULT_HTTP_PORT  # the OpenAI-compatible door; None: none
    api_key: str | None = None  # one key, of the tenant "default"
    api_key_file: str | None = None  # one `TENANT KEY` per line (router/door/auth.py)
    allow_unauthenticated: bool = False  # serve without keys on a non-loopback host
    tls_cert: str | None = None  # PEM certificate chain of both doors
    tls_key: str | None = None
    tls_client_ca: str | None = None  # mutual TLS: clients need a certificate from this CA
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = DEFAULT_METRICS_PORT  # None: no metrics endpoint
    device: str = "cpu"  # "cuda" gives group i device cuda:i (in-process groups)
    policy: str = "prefix_aware"
    # prefix_aware's PrefixAwareConfig fields, e.g. {"load_slack": 0.2}; YAML only
    policy_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    cluster: str = "pagefleet"  # the prefix index's namespace, and the Ray namespace's name
    # "all": this process runs the router and its groups (in-process, or on Ray with a
    # supervisor of its own); "router": a router over the groups of `cluster`, which
    # `pagefleet groups start` placed (needs `address` and `redis`)
    role: str = "all"
    grace_s: float = 30.0  # SIGTERM: how long in-flight calls may finish
    max_message_bytes: int = MAX_MESSAGE_BYTES
    # the HTTP door's bounds on a request's headers: HeaderLimits' fields, e.g.
    # {"max_bytes": 65536, "max_count": 100, "timeout_s": 10}; YAML only
    http_headers: Mapping[str, Any] = field(default_factory=dict, hash=False)
    engine: Mapping[str, Any] = field(default_factory=dict, hash=False)  # num_blocks, ...

    def __post_init__(self) -> None:
        for name in ("tp", "groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("port", "metrics_port", "http_port"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value < 65536):
                raise ValueError(f"{name} must be a port number in [0, 65535], got {value!r}")
        if not self.grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s!r}")
        check_model_name(self.model)
        if not isinstance(self.engine, Mapping):
            raise ValueError(f"engine must be a mapping of engine options, got {self.engine!r}")
        if not isinstance(self.http_headers, Mapping):
            raise ValueError(f"http_headers must be a mapping, got {self.http_headers!r}")
        _ = self.header_limits  # (its ValueError names the field)
        if not isinstance(self.policy_options, Mapping):
            raise ValueError(f"policy_options must be a mapping, got {self.policy_options!r}")
        if self.role not in ("all", "router"):
            raise ValueError(f"role must be 'all' or 'router', got {self.role!r}")
        if self.role == "router" and (self.address is None or self.redis is None):
            raise ValueError("role 'router' needs address (the Ray cluster) and redis (its index)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")

    @property
    def header_limits(self) -> HeaderLimits:
        try:
            return HeaderLimits(**self.http_headers)
        except TypeError:
            raise ValueError(
                f"http_headers: known fields are max_bytes, max_count, timeout_s; got {sorted(self.http_headers)}"
            ) from None

    @property
    def uses_ray(self) -> bool:
        return self.ray or self.tp > 1 or self.groups > 1 or self.address is not None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ServeConfig:
        """From a YAML mapping or flags; keys may use dashes (`metrics-port`)."""
        known = {f.name for f in fields(cls)}
        normal = {str(k).replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(normal) - known)
        if unknown:
            raise ValueError(f"unknown serve option(s) {unknown}; known: {sorted(known)}")
        return cls(**normal)


def load_config(path: str | None, overrides: Mapping[str, Any]) -> ServeConfig:
    """The YAML file at `path` (if any), with `overrides` (flags the user gave) on top."""
    values: dict[str, Any] = {}
    if path is not None:
        import yaml

        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"--config {path}: {e}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"--config {path}: expected a mapping of serve options")
        values.update(loaded)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ServeConfig.from_mapping(values)


@dataclass
class Indexes:
    """The prefix index of one serve process: what its groups write to, what its router
    reads."""

    local: Any  # cluster.index.InMemoryPrefixIndex: this process's own
    shared: Any  # cluster.index.RedisPrefixIndex, the groups' side of Redis; None without it
    reader: Any  # cluster.index.IndexReader

    @property
    def writers(self) -> tuple:
        """What a group of this process publishes to: one publisher each."""
        return (self.local,) if self.shared is None else (self.local, self.shared)

    def close(self) -> None:
        self.reader.close()
        for writer in self.writers:
            writer.close()


@dataclass
class Cluster:
    """What `build_cluster` made: the router, its groups and the index."""

    router: Any  # router.router.Router
    groups: list
    index: Indexes
    metrics: Any  # router.door.metrics.ServerMetrics
    ray_groups: Any = None  # router.ray_groups.RayGroups, when the groups live on Ray

    def follow(self, loop) -> None:
        """Follow groups coming and going (on Ray) from now on, on the router's loop."""
        if self.ray_groups is not None:
            self.ray_groups.follow(self.router, loop)

    def shutdown(self) -> None:
        if self.ray_groups is not None:
            self.ray_groups.shutdown()  # (its own groups, when this process placed them)
        else:
            for group in self.groups:
                group.shutdown()
        self.index.close()


def build_cluster(config: ServeConfig, make_engine_config: Callable[..., Any], secret: str | None = None) -> Cluster:
    """Load the groups and build the router (blocking: minutes for a large model).

    `make_engine_config(model, **options)` is `pagefleet.llm.engine_config`: the face owns
    how flat options become an `EngineConfig`. `secret`: the cluster secret (None: from the
    environment, see `take_cluster_secret`). With Ray-placed groups, call `start_ray` on the
    main thread first. A router of a cluster (`role` "router") takes the model, the engine's
    options and the secret from the cluster's supervisor."""
    from router.door.metrics import ServerMetrics
    from router.placement import make_policy
    from router.router import Router

    ray_groups = None
    if config.role == "router":
        ray_groups = _joined_groups()
        probe = ray_groups.spec.engine
    else:
        secret = secret or take_cluster_secret()
        engine_options = {"cluster_secret": secret, **config.engine}
        probe = make_engine_config(config.model, **engine_options)  # resolves the default
    name = model_name(probe.model)
    policy = make_policy(  # before groups start: bad options fail at once
        config.policy,
        probe.cache.block_size,
        probe.scheduler.max_num_batched_tokens,
        config.policy_options,
    )
    index = make_index(config, name)
    try:
        if ray_groups is None and config.uses_ray:
            ray_groups = _embedded_groups(config, make_engine_config, engine_options, name, index)
        groups = (
            ray_groups.handles
            if ray_groups is not None
            else _local_groups(config, make_engine_config, engine_options, index.writers)
        )
    except BaseException:
        index.close()
        raise
    try:
        if config.role == "router":  # from the groups: this process loads no torch
            hasher, tokenizer, info = router_side_of(ray_groups.model_facts(), probe, name)
        else:
            hasher, tokenizer, info = router_side(probe, name)
        metrics = ServerMetrics(name, info.max_model_len)
        reader = metrics.timed_index(index.reader)
        router = Router(groups, reader, hasher, info, tokenizer=tokenizer, policy=policy)
        metrics.watch_groups(router.cluster_status)
        metrics.watch_index(reader)
    except BaseException:  # the groups started: stop them rather than leave them behind
        Cluster(None, groups, index, None, ray_groups).shutdown()
        raise
    return Cluster(router, groups, index, metrics, ray_groups)


def make_index(config: ServeConfig, model: str) -> Indexes:
    """The prefix index of one serve process: in-process without `redis`. With it, groups
    publish to Redis and to an in-process index; the router matches on a local mirror of Redis
    (cluster/index/mirror.py: no round trip per decision) while Redis answers, and on the
    in-process index otherwise (cluster/index/failover.py): serving goes on when Redis is down
    at start or later, and each group republishes its inventory to Redis once it is back."""
    from cluster.index import (
        FailoverReader,
        InMemoryPrefixIndex,
        MirroredPrefixIndex,
        RedisPrefixIndex,
        check_name,
    )

    check_name("cluster", config.cluster)
    check_name("model", model)
    local = InMemoryPrefixIndex()
    if config.redis is None:
        return Indexes(local=local, shared=None, reader=local)
    shared = RedisPrefixIndex.from_url(config.redis, config.cluster, model)
    mirror = MirroredPrefixIndex(RedisPrefixIndex.from_url(config.redis, config.cluster, model))
    return Indexes(local=local, shared=shared, reader=FailoverReader(mirror, local))


def take_cluster_secret() -> str:
    """PAGEFLEET_CLUSTER_SECRET, removed from this process's environment so that no process
    started from here (a local Ray runtime and its workers) inherits it; a random one when it
    is not set. Groups get it in their EngineConfig."""
    from worker.config import CLUSTER_SECRET_ENV

    return os.environ.pop(CLUSTER_SECRET_ENV, None) or os.urandom(32).hex()


def start_ray(config: ServeConfig) -> None:
    """Join the Ray cluster at `config.address`, or start a local runtime declaring enough CPUs
    for every rank (a rank's thread is light). Must run on the main thread when it starts a
    local runtime (cluster/ray/runtime.py says why); a no-op once connected."""
    from cluster.ray.runtime import RayStartError, cluster_namespace, ensure_ray

    cpus = None if config.address else max(os.cpu_count() or 1, config.groups * config.tp)
    try:
        ensure_ray(config.address, num_cpus=cpus, namespace=cluster_namespace(config.cluster))
    except RayStartError as e:
        raise ServeError(str(e)) from None


def router_side(engine_config, name: str):
    """The router's hasher, tokenizer and ModelInfo, read from the model directory without
    loading weights (groups may live in other processes); the hasher is built by the same
    function as every engine's (`worker.engine.llm_engine.block_hasher`)."""
    from router.router import ModelInfo
    from worker.engine.llm_engine import block_hasher, load_tokenizer
    from worker.model.model_loader import read_model_config
    from worker.protocol import ModelFacts

    mc = read_model_config(engine_config.model)
    hasher = block_hasher(engine_config, mc)
    max_len = mc.max_position_embeddings
    facts = ModelFacts(
        hasher.fingerprint,
        min(engine_config.max_model_len or max_len, max_len),
        mc.vocab_size,
        tuple(mc.eos_token_ids),
        tokenizer_files=None,
    )
    return hasher, load_tokenizer(engine_config.model), ModelInfo.of(name, facts)


def router_side_of(facts, engine_config, name: str):
    """The router's hasher, tokenizer and ModelInfo from a group's `ModelFacts` (a router of a
    cluster: the same fingerprint and tokenizer as the group's, without torch)."""
    from router.router import ModelInfo
    from worker.config import cluster_secret
    from worker.hashing import BlockHasher

    hasher = BlockHasher(cluster_secret(engine_config.cluster_secret), facts.fingerprint)
    return hasher, facts.tokenizer(), ModelInfo.of(name, facts)


def _local_groups(config, make_engine_config, options, index) -> list:
    """The in-process groups (TP=1), publishing to `index`."""
    from cluster.local_group import LocalGroup

    groups = []
    for i in range(config.groups):
        device = f"cuda:{i}" if config.device == "cuda" else config.device
        engine_config = make_engine_config(config.model, **{**options, "device": device})
        groups.append(LocalGroup(engine_config, index, group_id=f"group-{i}"))
    return groups


def check_deployment(config: ServeConfig) -> None:
    """Fail before binding a port when the config asks for what this installation lacks."""
    if config.uses_ray and importlib.util.find_spec("cluster.ray.group") is None:
        raise ValueError(
            "--ray, --tp > 1, --groups > 1 and --address need Ray-placed groups "
            "(cluster/ray/group.py), which this installation lacks; leave them out for one "
            "in-process group"
        )


def _embedded_groups(config, make_engine_config, options, name: str, index: Indexes):
    """This server's own groups on Ray, kept by a supervisor of its own: `config.groups` groups
    of `config.tp` devices. With Redis, each group's rank 0 publishes to it; every group also
    streams its KV events to this router for the in-process index."""
    from cluster.ray.group import RayGroupConfig
    from cluster.ray.supervisor import GroupsSpec
    from router.ray_groups import GroupsFailedError, RayGroups

    start_ray(config)  # (connected already when `serve` started it on the main thread)
    engine_config = make_engine_config(config.model, **{"device": config.device, **options})
    group_config = RayGroupConfig(tensor_parallel_size=config.tp)
    spec = GroupsSpec(engine_config, group_config, config.groups, config.cluster, name, config.redis)
    try:
        return RayGroups.embedded(spec, (index.local,), group_config.start_timeout_s)
    except GroupsFailedError as e:
        raise ServeError(str(e)) from None


def _joined_groups():
    """The groups of the cluster this process joined (`start_ray` on the main thread first)."""
    from router.ray_groups import GroupsFailedError, RayGroups

    try:
        return RayGroups.join()
    except GroupsFailedError as e:
        raise ServeError(str(e)) from None


def model_name(model_dir: str) -> str:
    """A label-safe model name: the model directory's name."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", Path(model_dir).name)[:128] or "model"


async def warm_up(groups) -> None:
    """One tiny greedy generation through every group: weights touched, kernels compiled."""
    from worker.protocol import GenerationRequest
    from worker.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    for group in groups:
        rid = f"warmup-{group.group_id}-{os.urandom(4).hex()}"  # (other routers warm it too)
        request = GenerationRequest([0], params, request_id=rid)
        async for _ in group.generate(request):
            pass


async def serve(config: ServeConfig, make_engine_config: Callable[..., Any]) -> int:
    """Run the server until SIGTERM/SIGINT; returns the exit code."""
    check_deployment(config)
    keys, tls = door_security(config)
    sys.setswitchinterval(ROUTER_SWITCH_INTERVAL_S)
    doors = Doors(config.host, config.port, config.http_port, config.max_message_bytes, keys, tls, config.header_limits)
    doors_at = await doors.start()
    _say(f"{doors_at}: loading {config.groups} group(s)")
    stop = asyncio.Event()
    cluster, metrics_http = None, None
    secret = take_cluster_secret()  # before Ray starts processes that would inherit it
    try:
        if config.uses_ray:
            where = config.address or "a local runtime on 127.0.0.1"
            _say(f"Ray: {'joining' if config.address else 'starting'} {where}")
            start_ray(config)  # on the main thread (blocks the loop for a few seconds)
        # After Ray: on the main thread, Ray installs handlers that end the process at once.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        cluster = await _until_stopped(_in_daemon_thread(build_cluster, config, make_engine_config, secret), stop)
        if cluster is not None:
            await warm_up(cluster.groups)
            cluster.follow(asyncio.get_running_loop())
            # what is built by now (the groups, the tokenizer, the index as loaded) lives as
            # long as the server: frozen, a full collection no longer walks it, which would
            # stall the event loop noticeably at 64 groups (worker/heap.py)
            settle_heap()
            metrics_http = _serve_metrics(config, cluster.metrics)
            await doors.set_ready(cluster.router, cluster.metrics)
            metrics_where = (
                ""
                if metrics_http is None
                else (f", metrics on http://{config.metrics_host}:{metrics_http.server_port}/metrics")
            )
            _say(f"ready: {doors_at}{metrics_where}")
            await stop.wait()
        _say(f"stopping: draining in-flight requests for up to {config.grace_s:g} s")
        await doors.stop(config.grace_s)
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
        if config.uses_ray:  # a local runtime's processes stop with it; a cluster is left
            from cluster.ray.runtime import shutdown_ray

            shutdown_ray()


def _in_daemon_thread(fn: Callable, *args) -> asyncio.Future:
    """`fn(*args)` on a daemon thread (a load cannot be interrupted, but must not keep a
    stopped server's process alive), as a future of the running loop."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # delivered to the awaiting coroutine
            loop.call_soon_threadsafe(_settle, future, None, e)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    threading.Thread(target=run, name="pagefleet-load", daemon=True).start()
    return future


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def _until_stopped(task: asyncio.Future, stop: asyncio.Event):
    """`task`'s result, or None if `stop` is set first."""
    stopper = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    return task.result() if task in done else None


def _serve_metrics(config: ServeConfig, metrics):
    if config.metrics_port is None:
        return None
    from router.door.metrics import serve_metrics

    return serve_metrics(metrics, config.metrics_host, config.metrics_port)


def _say(message: str) -> None:
    print(f"pagefleet serve: {message}", file=sys.stdout, flush=True)
