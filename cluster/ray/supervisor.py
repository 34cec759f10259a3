"""The supervisor: a Ray actor that keeps a cluster's declared worker groups alive.

It places each group (a `RankSet`: placement group and rank actors, named `{group}.g{gen}` in
the cluster's namespace, detached when the supervisor is), watches it every heartbeat, and when
a group dies starts a replacement under the same group id and a new generation (its index
registration gets a new epoch, so the old one's entries never match). Restarts back off
(`RestartPolicy`) and stop after a limit within a window: the group is then "failed", which
`groups()` and the routers' status report. `drain(group)` stops new placements on a group,
waits for its in-flight requests to finish and retires it.

Routers find the supervisor by name (`SUPERVISOR_NAME` in the cluster's namespace) and read
`groups()` about once a second: every group's id, generation, state, rank 0 actor and ranks
(cluster/ray/directory.py). A detached supervisor outlives the process that started it and is
restarted by Ray if it dies (`max_restarts=-1`); a restarted one adopts the groups it finds by
name, so groups keep serving meanwhile.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field, replace

from cluster.group import for_group
from cluster.ray.config import RayGroupConfig
from cluster.ray.rank_actor import IndexTarget
from cluster.ray.ranks import RankSet
from cluster.ray.runtime import ray
from worker.config import EngineConfig

log = logging.getLogger(__name__)

HEAD_NODE = "node:__internal_head__"  # the resource only the head node has
SUPERVISOR_NAME = "pagefleet-supervisor"
STATES = ("starting", "serving", "draining", "restarting", "failed", "retired")


@dataclass(frozen=True)
class RestartPolicy:
    """How a dead group is replaced: after `initial_s`, doubling up to `max_s` for each restart
    within `window_s`; after `max_restarts` of them in the window, no more (the group has
    failed: something other than chance kills it)."""

    initial_s: float = 1.0
    max_s: float = 30.0
    max_restarts: int = 5
    window_s: float = 600.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"restart waits must satisfy 0 < initial_s <= max_s, got {self}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")


@dataclass(frozen=True)
class GroupsSpec:
    """What a supervisor keeps alive: `groups` groups (ids `group-0`, ...) of
    `group_config.tensor_parallel_size` devices running `engine`, publishing their KV events to
    the Redis index at `redis_url` (cluster `cluster`, model `model`), or, without Redis, to the
    router subscribed as `events_to` (an embedded server's)."""

    engine: EngineConfig
    group_config: RayGroupConfig = field(default_factory=RayGroupConfig)
    groups: int = 1
    cluster: str = "pagefleet"
    model: str = "model"
    redis_url: str | None = None
    events_to: str | None = None
    restart: RestartPolicy = field(default_factory=RestartPolicy)

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ValueError(f"groups must be >= 1, got {self.groups}")

    @property
    def group_ids(self) -> list[str]:
        return [f"group-{i}" for i in range(self.groups)]


@dataclass(frozen=True)
class GroupInfo:
    """One group as the supervisor sees it (what routers read)."""

    group_id: str
    generation: int
    state: str  # one of STATES
    rank0: object | None  # the rank 0 actor, while the group runs
    ranks: tuple[dict, ...] = ()  # the ranks' descriptions (node, device, pid, ...)
    error: str | None = None  # why the last generation died
    restarts: int = 0  # replacements so far
    events_to: str | None = None  # the subscriber its KV events stream to (no Redis)


class _Slot:
    """One declared group: its current generation and history (the supervisor's thread)."""

    def __init__(self, group_id: str) -> None:
        self.group_id = group_id
        self.generation = 0
        self.ranks: RankSet | None = None
        self.state = "starting"
        self.error: str | None = None
        self.restarts: list[float] = []  # when each restart happened
        self.restart_at = 0.0
        self.placing = False  # a thread is placing its next generation
        self.placing_ranks: RankSet | None = None  # what it is placing (stop removes it)


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=16)
class Supervisor:
    """Keeps the declared groups alive; see the module docstring."""

    def __init__(self, spec: GroupsSpec, detached: bool = False) -> None:
        logging.basicConfig(level=logging.INFO)
        self.spec, self.detached = spec, detached
        self._slots = {gid: _Slot(gid) for gid in spec.group_ids}
        self._lock = threading.Lock()
        self._stopping = False
        self._adopt()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()

    # ---- what routers and operators call ------------------------------------------------
    def groups(self) -> list[GroupInfo]:
        with self._lock:
            return [self._info(s) for s in self._slots.values()]

    def spec_of(self) -> GroupsSpec:
        return self.spec

    def drain(self, group_id: str, timeout_s: float = 300.0) -> GroupInfo:
        """Stop new placements on the group, wait (up to `timeout_s`) for its in-flight
        requests to finish, then retire it (its blocks leave the index). Blocks until then."""
        with self._lock:
            slot = self._slots.get(group_id)
            if slot is None:
                raise ValueError(f"group {group_id!r} is unknown; groups: {sorted(self._slots)}")
            if slot.state != "serving" or slot.ranks is None:
                raise ValueError(f"group {group_id} is {slot.state}, not serving: cannot drain it")
            slot.state, ranks = "draining", slot.ranks
        ray.get(ranks.rank0.set_draining.remote(True), timeout=10)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = ray.get(ranks.rank0.stats.remote(), timeout=10)
            if stats.get("running", 0) == 0 and stats.get("waiting", 0) == 0:
                break
            time.sleep(0.2)
        with self._lock:
            slot.state, slot.ranks = "retired", None
        ranks.shutdown()
        return self._info(slot)

    def stop(self) -> None:
        """Stop every group and the watch; the supervisor can then be killed."""
        self._stopping = True
        self._thread.join(timeout=30)
        with self._lock:
            ranks = [s.ranks for s in self._slots.values() if s.ranks is not None]
            ranks += [s.placing_ranks for s in self._slots.values() if s.placing_ranks is not None]
            for s in self._slots.values():
                s.ranks, s.state = None, "retired"
        for r in ranks:  # (a placement still waiting for resources is removed too)
            r.shutdown()
        for gid, gens in _placement_generations().items():  # any other left behind (a
            if gid in self._slots:  # supervisor that died while placing it, say)
                for gen in gens:
                    _remove_placement(f"{gid}.g{gen}.pg")

    # ---- the watch --------------------------------------------------------------------------
    def _run(self) -> None:
        hb = self.spec.group_config.heartbeat_s
        while not self._stopping:
            for slot in list(self._slots.values()):
                if self._stopping:
                    return
                try:
                    self._tend(slot)
                except Exception:  # noqa: BLE001  (the watch must outlive any one group's fault)
                    log.exception("supervisor: tending %s failed", slot.group_id)
            time.sleep(hb)

    def _tend(self, slot: _Slot) -> None:
        if slot.state in ("starting", "restarting") and time.monotonic() >= slot.restart_at:
            if not slot.placing:  # placed on a thread of its own: others are tended meanwhile
                slot.placing = True
                threading.Thread(target=self._start, args=(slot,), daemon=True).start()
        elif slot.state == "serving" and slot.ranks is not None:
            error = slot.ranks.failure()
            if error is not None:
                self._died(slot, error)

    def _start(self, slot: _Slot) -> None:
        try:
            self._place(slot)
        finally:
            slot.placing = False

    def _place(self, slot: _Slot) -> None:
        spec = self.spec
        slot.generation += 1
        name = f"{slot.group_id}.g{slot.generation}"
        index = IndexTarget(slot.group_id, spec.redis_url, spec.cluster, spec.model, spec.events_to)
        try:
            engine = for_group(spec.engine, slot.group_id)
            ranks = slot.placing_ranks = RankSet(engine, spec.group_config, index, name, self.detached)
            ranks.wait_ready()
        except Exception as e:  # noqa: BLE001  (placement or start-up failed: a restart)
            if not self._stopping:
                self._died(slot, f"could not start: {type(e).__name__}: {e}")
            return
        finally:
            slot.placing_ranks = None
        with self._lock:
            if self._stopping:  # (stop came while it started: it goes too)
                ranks.shutdown()
                return
            slot.ranks, slot.state = ranks, "serving"
        log.info("supervisor: %s serving (generation %d)", slot.group_id, slot.generation)

    def _died(self, slot: _Slot, error: str) -> None:
        policy, now = self.spec.restart, time.monotonic()
        with self._lock:
            ranks, slot.ranks, slot.error = slot.ranks, None, error
            slot.restarts = [t for t in slot.restarts if now - t < policy.window_s]
            if len(slot.restarts) >= policy.max_restarts:
                slot.state = "failed"
            else:
                wait = min(policy.max_s, policy.initial_s * 2 ** len(slot.restarts))
                slot.restarts.append(now)
                slot.state, slot.restart_at = "restarting", now + wait
        log.warning("supervisor: %s died (%s); %s", slot.group_id, error, slot.state)
        if ranks is not None:
            ranks.shutdown()

    def _adopt(self) -> None:
        """After a restart of this actor: take over the groups still running (found by name),
        remove the placement groups of generations that are not (a dead group's, or one being
        placed when the old supervisor died) and go on counting generations after them."""
        placed = _placement_generations()
        for slot in self._slots.values():
            found = RankSet.find(slot.group_id, self.spec.engine, self.spec.group_config)
            if found is not None:
                slot.generation, slot.ranks = found
                slot.state = "serving"
            for gen in placed.get(slot.group_id, ()):
                slot.generation = max(slot.generation, gen)
                if found is None or gen != found[0]:
                    _remove_placement(f"{slot.group_id}.g{gen}.pg")

    def _info(self, slot: _Slot) -> GroupInfo:
        ranks = slot.ranks
        return GroupInfo(
            slot.group_id,
            slot.generation,
            slot.state,
            None if ranks is None else ranks.rank0,
            () if ranks is None else tuple(ranks.ranks),
            slot.error,
            len(slot.restarts),
            self.spec.events_to,
        )


def _placement_generations() -> dict[str, list[int]]:
    """group id -> generations that have a live placement group in this namespace."""
    found: dict[str, list[int]] = {}
    for pg in ray.util.placement_group_table().values():
        m = re.fullmatch(r"(.+)\.g(\d+)\.pg", pg.get("name") or "")
        if m is None or pg.get("state") == "REMOVED":
            continue
        try:  # (the table spans namespaces; a name is ours if this namespace resolves it)
            ray.util.get_placement_group(pg["name"])
        except ValueError:
            continue
        found.setdefault(m.group(1), []).append(int(m.group(2)))
    return found


def _remove_placement(name: str) -> None:
    try:
        ray.util.remove_placement_group(ray.util.get_placement_group(name))
        log.info("supervisor: removed %s (a generation nobody serves)", name)
    except Exception:  # noqa: BLE001  (already gone)
        pass


def start_supervisor(spec: GroupsSpec, detached: bool, name: str = SUPERVISOR_NAME):
    """The supervisor of this job's namespace: the running one if there is one (a detached
    one started earlier), else a new one for `spec`.

    It is placed on the head node, as Ray Serve places its controller (a sliver of the head's
    own resource): losing a group's node must not take the supervisor along, or a restarted
    supervisor would race the old one, still running on a node whose raylet died."""
    try:
        return ray.get_actor(name)
    except ValueError:
        pass
    return Supervisor.options(
        name=name, lifetime="detached" if detached else None, resources={HEAD_NODE: 0.001}
    ).remote(replace(spec), detached)


__all__ = [
    "GroupInfo",
    "GroupsSpec",
    "RestartPolicy",
    "SUPERVISOR_NAME",
    "Supervisor",
    "start_supervisor",
]


# ---- what an operator does (`pagefleet groups ...`) -------------------------------------------


def start_groups(spec: GroupsSpec, timeout_s: float = 600.0) -> list[GroupInfo]:
    """Start the cluster's supervisor (detached: the groups outlive this process) and wait
    until every group serves; returns their states. A supervisor already running keeps its
    own spec. Raises RuntimeError when a group does not start."""
    supervisor = start_supervisor(spec, detached=True)
    deadline = time.monotonic() + timeout_s
    while True:
        infos = ray.get(supervisor.groups.remote(), timeout=30)
        if all(i.state == "serving" for i in infos):
            return infos
        broken = [i for i in infos if i.state in ("restarting", "failed") and i.error]
        if broken or time.monotonic() > deadline:
            why = broken[0].error if broken else f"not serving within {timeout_s} s"
            raise RuntimeError(f"the groups did not start: {why}")
        time.sleep(0.5)


def the_supervisor():
    """The cluster's supervisor in this job's namespace; RuntimeError when there is none."""
    try:
        return ray.get_actor(SUPERVISOR_NAME)
    except ValueError:
        namespace = ray.get_runtime_context().namespace
        raise RuntimeError(f"no pagefleet groups run in Ray namespace {namespace!r}") from None


def stop_groups() -> None:
    """Stop every group and the supervisor; their blocks leave the index."""
    supervisor = the_supervisor()
    ray.get(supervisor.stop.remote(), timeout=120)
    ray.kill(supervisor, no_restart=True)
