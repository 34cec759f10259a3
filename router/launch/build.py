"""The parts of a server, built from a `ServeConfig`: the doors, the prefix index, the groups,
the router, the metrics and the tenants' limiter.

The embedded default is one TP=1 group in this process (router/launch/local.py: the one part
that loads torch): a local Ray runtime and a Ray-placed group would add tens of seconds to
start-up on a small CPU host (`ray` opts in). With `ray`, `tp > 1`, `groups > 1` or a Ray
`address`, the groups are Ray-placed (cluster/ray/), on the cluster at `address` or on a local
runtime, kept by a supervisor of this process's own; a router of a cluster (`role` "router")
follows the groups `pagefleet groups start` placed. All groups and the router share one
cluster secret (worker/config.py: take_cluster_secret).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import redis

from cluster.group import GroupHandle
from cluster.index import (
    FailoverReader,
    IndexReader,
    IndexWriter,
    InMemoryPrefixIndex,
    MirroredPrefixIndex,
    RedisPrefixIndex,
    check_name,
)
from cluster.ray.config import RayGroupConfig
from cluster.ray.runtime import RayStartError, cluster_namespace, ensure_ray
from cluster.ray.supervisor import GroupsSpec
from router.door.auth import ApiKeys, TlsFiles, is_loopback
from router.door.doors import Doors
from router.door.limits import Limiter, LocalLimiter, RedisLimiter
from router.door.metrics import ServerMetrics
from router.launch.config import ServeConfig, ServeError
from router.placement import make_policy
from router.placement.policy import Policy
from router.ray_groups import GroupsFailedError, RayGroups
from router.router import ModelInfo, Router
from worker.config import EngineConfig, cluster_secret, take_cluster_secret
from worker.hashing import BlockHasher
from worker.protocol import ModelFacts


@dataclass
class Indexes:
    """The prefix index of one serve process: what its groups write to, what its router reads."""

    local: InMemoryPrefixIndex  # this process's own
    shared: RedisPrefixIndex | None  # the groups' side of Redis; None without it
    reader: IndexReader  # the local index, or a mirror of Redis failing over to it

    @property
    def writers(self) -> tuple[IndexWriter, ...]:
        """What a group of this process publishes to: one publisher each."""
        return (self.local,) if self.shared is None else (self.local, self.shared)

    def close(self) -> None:
        self.reader.close()
        for writer in self.writers:
            writer.close()


@dataclass
class Cluster:
    """What `build_cluster` made: the router, its groups, the index, metrics and limits."""

    router: Router
    groups: list[GroupHandle]
    index: Indexes
    metrics: ServerMetrics
    limiter: Limiter | None = None  # None: no tenant has a limit
    ray_groups: RayGroups | None = None  # when the groups live on Ray

    def follow(self, loop) -> None:
        """Follow groups coming and going (on Ray) from now on, on the router's loop."""
        if self.ray_groups is not None:
            self.ray_groups.follow(self.router, loop)

    def shutdown(self) -> None:
        shutdown_groups(self.groups, self.ray_groups)
        self.index.close()


def shutdown_groups(groups: list[GroupHandle], ray_groups: RayGroups | None) -> None:
    """Stop the groups this process placed (a cluster's are left to their supervisor)."""
    if ray_groups is not None:
        ray_groups.shutdown()  # (its own groups, when this process placed them)
        return
    for group in groups:
        group.shutdown()


def door_security(config: ServeConfig) -> tuple[ApiKeys | None, TlsFiles | None]:
    """The doors' keys and TLS files. Without a key, the doors bind loopback only unless the
    operator says `allow_unauthenticated`: anyone who reaches an open door may use it, and read
    what its cache holds."""
    sec, host = config.security, config.doors.host
    keys = ApiKeys.load(sec.api_key, sec.api_key_file)
    tls = None if sec.tls_cert is None else TlsFiles(sec.tls_cert, sec.tls_key, sec.tls_client_ca)
    if keys is None and not sec.allow_unauthenticated and not is_loopback(host):
        raise ValueError(
            f"host {host} is not a loopback address and no API key is configured: give "
            "--api-key-file (or --api-key), or --allow-unauthenticated to serve anyone who "
            "reaches the port"
        )
    return keys, tls


def make_doors(config: ServeConfig, keys: ApiKeys | None, tls: TlsFiles | None) -> Doors:
    """Both doors, unbound."""
    d = config.doors
    return Doors(d.host, d.port, d.http_port, d.max_message_bytes, keys, tls, d.http_headers)


def build_cluster(config: ServeConfig, secret: str | None = None) -> Cluster:
    """Load the groups and build the router (blocking: minutes for a large model).

    `secret`: the cluster secret (None: from the environment, see `take_cluster_secret`). With
    Ray-placed groups, call `start_ray` on the main thread first. A router of a cluster (`role`
    "router") takes the model, the engine's options and the secret from the cluster's
    supervisor, and loads no torch."""
    if config.cluster.role == "router":
        return _router_of_cluster(config)
    secret = secret or take_cluster_secret()
    probe = engine_config(config, secret)  # resolves the default model
    name = model_name(probe.model)
    policy = make_policy_for(config, probe)  # before groups start: bad options fail at once
    index = make_index(config, name)
    try:
        if config.cluster.uses_ray:
            ray_groups = _embedded_groups(config, secret, name, index)
            groups = ray_groups.handles
        else:
            ray_groups = None
            groups = _local().local_groups(config, secret, index.writers)
    except BaseException:
        index.close()
        raise
    try:
        hasher, tokenizer, info = _local().router_side(probe, name)
        return _assemble(config, groups, index, ray_groups, policy, hasher, tokenizer, info)
    except BaseException:  # the groups started: stop them rather than leave them behind
        shutdown_groups(groups, ray_groups)
        index.close()
        raise


def _router_of_cluster(config: ServeConfig) -> Cluster:
    """A router over the groups of the cluster this process joined, from their `ModelFacts`."""
    ray_groups = _joined_groups()
    probe = ray_groups.spec.engine
    name = model_name(probe.model)
    policy = make_policy_for(config, probe)
    index = make_index(config, name)
    try:
        hasher, tokenizer, info = router_side_of(ray_groups.model_facts(), probe, name)
        return _assemble(config, ray_groups.handles, index, ray_groups, policy, hasher, tokenizer, info)
    except BaseException:
        ray_groups.shutdown()
        index.close()
        raise


def _assemble(config, groups, index, ray_groups, policy, hasher, tokenizer, info: ModelInfo) -> Cluster:
    metrics = ServerMetrics(info.model, info.max_model_len)
    metrics.tenants = config.tenants.names
    reader = metrics.timed_index(index.reader)
    router = Router(groups, reader, hasher, info, tokenizer=tokenizer, policy=policy)
    router.documents.max_documents = config.tenants.max_documents
    if config.cluster.redis is not None:  # every router replica knows every document
        router.documents.share(redis.Redis.from_url(config.cluster.redis), config.cluster.name)
    metrics.watch_groups(router.cluster_status)
    metrics.watch_index(reader)
    metrics.watch_documents(router.documents.by_tenant)
    return Cluster(router, groups, index, metrics, make_limiter(config), ray_groups)


def engine_config(config: ServeConfig, secret: str, **extra) -> EngineConfig:
    """The groups' engine config: the configured options, the cluster secret and the tenants'
    weights in the fair share (SchedulerConfig.tenant_weights) and KV quotas
    (CacheConfig.tenant_kv_quotas)."""
    return config.engine.engine_config(cluster_secret=secret, **config.tenants.engine_options(), **extra)


def make_policy_for(config: ServeConfig, probe: EngineConfig) -> Policy:
    """The placement policy for the groups' blocks and token budget (bad options: ValueError)."""
    c = config.cluster
    return make_policy(c.policy, probe.cache.block_size, probe.scheduler.max_num_batched_tokens, c.policy_options)


def make_limiter(config: ServeConfig) -> Limiter | None:
    """The tenants' limits at the door: in Redis when the cluster has one (every router replica
    shares the windows), in this process otherwise; None when no tenant is limited."""
    if not config.tenants.limited:
        return None
    if config.cluster.redis is None:
        return LocalLimiter(config.tenants.limits)
    client = redis.Redis.from_url(config.cluster.redis)
    return RedisLimiter(client, config.cluster.name, config.tenants.limits)


def make_index(config: ServeConfig, model: str) -> Indexes:
    """The prefix index of one serve process: in-process without `redis`. With it, groups
    publish to Redis and to an in-process index; the router matches on a local mirror of Redis
    (cluster/index/mirror.py: no round trip per decision) while Redis answers, and on the
    in-process index otherwise (cluster/index/failover.py): serving goes on when Redis is down
    at start or later, and each group republishes its inventory to Redis once it is back."""
    cluster, url = config.cluster.name, config.cluster.redis
    check_name("cluster", cluster)
    check_name("model", model)
    local = InMemoryPrefixIndex()
    if url is None:
        return Indexes(local=local, shared=None, reader=local)
    shared = RedisPrefixIndex.from_url(url, cluster, model)
    mirror = MirroredPrefixIndex(RedisPrefixIndex.from_url(url, cluster, model))
    return Indexes(local=local, shared=shared, reader=FailoverReader(mirror, local))


def start_ray(config: ServeConfig) -> None:
    """Join the Ray cluster at `address`, or start a local runtime declaring enough CPUs for
    every rank (a rank's thread is light). Must run on the main thread when it starts a local
    runtime (cluster/ray/runtime.py says why); a no-op once connected."""
    c = config.cluster
    cpus = None if c.address else max(os.cpu_count() or 1, c.groups * c.tp)
    try:
        ensure_ray(c.address, num_cpus=cpus, namespace=cluster_namespace(c.name))
    except RayStartError as e:
        raise ServeError(str(e)) from None


def router_side_of(facts: ModelFacts, probe: EngineConfig, name: str) -> tuple[BlockHasher, object, ModelInfo]:
    """The router's hasher, tokenizer and ModelInfo from a group's `ModelFacts` (a router of a
    cluster: the same fingerprint and tokenizer as the group's, without torch)."""
    hasher = BlockHasher(cluster_secret(probe.cluster_secret), facts.fingerprint)
    return hasher, facts.tokenizer(), ModelInfo.of(name, facts)


def _embedded_groups(config: ServeConfig, secret: str, name: str, index: Indexes) -> RayGroups:
    """This server's own groups on Ray, kept by a supervisor of its own: `groups` groups of `tp`
    devices. With Redis, each group's rank 0 publishes to it; every group also streams its KV
    events to this router for the in-process index."""
    c = config.cluster
    start_ray(config)  # (connected already when `serve` started it on the main thread)
    group_config = RayGroupConfig(tensor_parallel_size=c.tp)
    device = {} if "device" in config.engine.options else {"device": c.device}  # (an engine option wins)
    spec = GroupsSpec(engine_config(config, secret, **device), group_config, c.groups, c.name, name, c.redis)
    try:
        return RayGroups.embedded(spec, (index.local,), group_config.start_timeout_s)
    except GroupsFailedError as e:
        raise ServeError(str(e)) from None


def _joined_groups() -> RayGroups:
    """The groups of the cluster this process joined (`start_ray` on the main thread first)."""
    try:
        return RayGroups.join()
    except GroupsFailedError as e:
        raise ServeError(str(e)) from None


def model_name(model_dir: str) -> str:
    """A label-safe model name: the model directory's name."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", Path(model_dir).name)[:128] or "model"


def _local():
    """router/launch/local.py, which loads torch (seconds): imported on the loading thread by a
    process that runs its groups or reads a model directory, never by a router of a cluster."""
    from router.launch import local

    return local
