"""Worker groups as the router sees them: a handle to submit, stream, abort and inspect.

A group is one engine over `tensor_parallel_size` devices. `LocalGroup` (cluster/local_group.py)
runs a TP=1 engine in this process (the embedded default and tests); a Ray-placed group
(cluster/ray/group.py) and a simulated one (cluster/sim_group.py) implement the same interface.
Each group publishes its KV events to the prefix index through a `GroupPublisher`, so the
routers' index knows which blocks it holds; its load reaches a router as its `GroupStatus`. This module loads no engine (no torch): a
router needs only the handle.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

from worker.config import EngineConfig, check_disk_group
from worker.outputs import RequestOutput
from worker.protocol import GenerationRequest

_versions = itertools.count(1)


def for_group(config: EngineConfig, group_id: str) -> EngineConfig:
    """`config` as the group `group_id` runs it: a disk tier in the group's own subdirectory
    of kv_disk_dir (`CacheConfig.kv_disk_group`), so that the groups of one node can share a
    --kv-disk-dir, a replacement under the same id reopens its predecessor's blocks, and a
    group of the node can read those of a group that is gone. Unchanged without a disk tier
    or with a subdirectory already named. (A group given no id, as `pagefleet.LLM`'s, keeps
    kv_disk_dir itself: one such group a directory.)"""
    cache = config.cache
    if not cache.kv_disk_dir or cache.kv_disk_group:
        return config
    return replace(config, cache=replace(cache, kv_disk_group=check_disk_group(group_id)))


@dataclass(frozen=True)
class GroupStatus:
    """A snapshot of one group, for the router's policy and for GetClusterStatus."""

    group_id: str
    alive: bool
    tensor_parallel_size: int
    devices: tuple[str, ...]  # e.g. ("cpu",) or ("cuda:0", "cuda:1"), with the node where known
    blocks_total: int
    blocks_free: int
    blocks_cached: int
    running: int
    waiting: int
    pending_prefill_tokens: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    loading: int = 0  # requests waiting for their prefix's blocks from the disk tier
    error: str | None = None
    draining: bool = False  # alive, but taking no new request (its in-flight ones finish)
    state: str = ""  # the supervisor's view (cluster/ray/supervisor.py); "" for a local group
    generation: int = 0
    restarts: int = 0
    pinned: dict[str, int] = field(default_factory=dict, compare=False)  # document id -> blocks pinned
    # the KV tiers' figures: the engine's `kv_*` stats (worker/engine/llm_engine.py), for the
    # metrics (router/door/cluster_metrics.py)
    tiers: dict = field(default_factory=dict, compare=False)
    # with KV quotas: tenant -> its "blocks" cached on the device, their "bytes", and the cached
    # blocks its requests evicted ("evictions_caused") and it lost ("evictions_suffered")
    tenant_kv: dict[str, dict[str, int]] = field(default_factory=dict, compare=False)
    # unique to this snapshot (a new one, `replace`d ones included, gets the next): what a
    # cache of figures worked out from a status compares to know it is stale
    version: int = field(default_factory=lambda: next(_versions), init=False, compare=False)

    def to_dict(self) -> dict:
        out = asdict(self)
        del out["version"]  # (this process's own counter: it means nothing to another)
        return out


def status_from_stats(
    group_id: str,
    stats: dict,
    alive: bool,
    tp: int,
    devices: tuple[str, ...],
    error: str | None = None,
) -> GroupStatus:
    return GroupStatus(
        group_id=group_id,
        alive=alive,
        tensor_parallel_size=tp,
        devices=devices,
        blocks_total=stats.get("blocks_total", 0),
        blocks_free=stats.get("blocks_free", 0),
        blocks_cached=stats.get("blocks_cached", 0),
        running=stats.get("running", 0),
        waiting=stats.get("waiting", 0),
        pending_prefill_tokens=stats.get("pending_prefill_tokens", 0),
        prefix_cache_queries=stats.get("prefix_cache_queries", 0),
        prefix_cache_hits=stats.get("prefix_cache_hits", 0),
        preemptions=stats.get("preemptions", 0),
        loading=stats.get("loading", 0),
        error=error,
        draining=bool(stats.get("draining", False)),
        pinned=dict(stats.get("pinned", {})),
        tiers={k: v for k, v in stats.items() if k.startswith("kv_")},
        tenant_kv=tenant_kv_of(stats),
    )


def tenant_kv_of(stats: dict) -> dict[str, dict[str, int]]:
    """The engine's per-tenant KV figures (worker/engine/llm_engine.py `stats`), by tenant: on
    the device (`blocks`, `bytes`, `evictions_caused`, `evictions_suffered`) and, for a tier
    with KV quotas, the same prefixed by its medium (`host_blocks`, `disk_bytes`, ...)."""
    block_bytes = stats.get("kv_block_bytes", 0)
    out: dict[str, dict[str, int]] = {}
    for prefix, key in (("", "tenant_kv_"), ("host_", "tenant_kv_host_"), ("disk_", "tenant_kv_disk_")):
        if f"{key}blocks" not in stats and prefix:
            continue  # (a tier without quotas, or none)
        blocks = stats.get(f"{key}blocks", {})
        caused = stats.get(f"{key}evictions_caused", {})
        suffered = stats.get(f"{key}evictions_suffered", {})
        for t in {*blocks, *caused, *suffered}:
            into = out.setdefault(t, {})
            into[f"{prefix}blocks"] = blocks.get(t, 0)
            into[f"{prefix}bytes"] = blocks.get(t, 0) * block_bytes
            into[f"{prefix}evictions_caused"] = caused.get(t, 0)
            into[f"{prefix}evictions_suffered"] = suffered.get(t, 0)
    return out


class GroupHandle(ABC):
    """What the router needs from a worker group."""

    group_id: str
    tells_changes = False  # whether it calls `_status_changed` on every change of its status
    _watchers: tuple[Callable[[str], None], ...] = ()

    def watch(self, changed: Callable[[str], None]) -> bool:
        """Ask to be told, `changed(group_id)` from any thread, whenever `status()` may answer
        differently; False if this handle cannot tell (its status is then read every time)."""
        if self.tells_changes:
            self._watchers = (*self._watchers, changed)
        return self.tells_changes

    def _status_changed(self) -> None:
        for changed in self._watchers:
            changed(self.group_id)

    @abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; leaving the stream early aborts the request."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed at once."""

    @abstractmethod
    def status(self) -> GroupStatus:
        """Latest load and liveness."""

    def unpin(self, document_id: str) -> None:  # noqa: B027  (a group without pins ignores it)
        """Release a document's pinned blocks (worker/protocol.py: Pin); no answer is awaited:
        the group's status stops listing it."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the group and release its devices."""

    async def pull_from(self, holder: GroupHandle, block_hashes: Sequence[bytes], timeout_s: float) -> int:
        """Copy the leading blocks of the chain that `holder` has into this group's host tier,
        where the next request's lookup finds them; returns how many came. Never raises: a
        pull that fails or takes longer than `timeout_s` brings 0, and the request recomputes
        what did not come. A handle that cannot pull from `holder` brings 0."""
        return 0

    async def pull_from_disk(self, group_id: str, block_hashes: Sequence[bytes], timeout_s: float) -> int:
        """Copy the leading blocks of the chain that the disk tier of `group_id`, a group of
        this group's node that is gone, left in its directory (the node's shared --kv-disk-dir)
        into this group's host tier; returns how many came. Never raises: nothing there, a
        failure or a timeout brings 0, and the request recomputes. A handle without a disk
        tier (or off that node, where the directory is not) brings 0."""
        return 0
