"""A group's ranks on Ray, as the process that places them sees them: one placement group (one
bundle per device: a GPU bundle when the engine runs on CUDA, a CPU bundle otherwise,
STRICT_PACK so that all ranks share a node) and one `RankActor` per device.

`RankSet` creates them, starts them (the rendezvous: rank 0 names a store file on its node, the
ranks talk over the node's loopback interface), watches them (each rank > 0 runs its loop
inside one long-lived call that resolves only when the loop ends; rank 0 must answer a stats
call) and stops them. The supervisor (cluster/ray/supervisor.py) places groups this way as
named, detached actors that outlive any router; an embedded server places its own. A router
talks to rank 0 through a `RayGroup` (cluster/ray/group.py).
"""

from __future__ import annotations

import re
import time

from cluster.ray.config import RayGroupConfig, check_tensor_parallel, parse_cpu_binding
from cluster.ray.rank_actor import IndexTarget, RankActor, describe_error
from cluster.ray.runtime import ensure_ray, ray
from worker.config import EngineConfig


class RankSet:
    """The placement group and rank actors of one group (one generation of it)."""

    def __init__(
        self,
        config: EngineConfig,
        group_config: RayGroupConfig,
        index: IndexTarget | None = None,
        name: str | None = None,
        detached: bool = False,
    ) -> None:
        """`name`: the actors are named `{name}.rank{r}` in the job's namespace (routers find
        rank 0 by name); `detached`: they and the placement group outlive the process that
        placed them."""
        self.config, self.group_config, self.index = config, group_config, index
        self.name, self.tp = name, group_config.tensor_parallel_size
        check_tensor_parallel(config.model, self.tp)
        ensure_ray()
        self._use_gpu = config.device.startswith("cuda")
        self.ranks: list[dict] = []  # per rank, once started: node, device, pid, ...
        self._serve_refs: list = []
        self._closed = False
        lifetime = "detached" if detached else None
        self.pg = ray.util.placement_group(
            [self._bundle() for _ in range(self.tp)],
            strategy="STRICT_PACK",
            lifetime=lifetime,
            name=f"{name}.pg" if name else "",
        )
        self.actors = [self._actor(i, lifetime) for i in range(self.tp)]

    @classmethod
    def find(cls, group_id: str, config: EngineConfig, group_config: RayGroupConfig) -> tuple[int, RankSet] | None:
        """(generation, ranks) of the latest generation of `group_id` running under its names
        in this namespace (what a restarted supervisor adopts), or None."""
        names = [a["name"] if isinstance(a, dict) else a for a in ray.util.list_named_actors()]
        gens = [int(m.group(1)) for n in names if (m := re.fullmatch(rf"{re.escape(group_id)}\.g(\d+)\.rank0", n))]
        if not gens:
            return None
        name = f"{group_id}.g{max(gens)}"
        self = cls.__new__(cls)
        self.config, self.group_config, self.index = config, group_config, None
        self.name, self.tp = name, group_config.tensor_parallel_size
        self._use_gpu, self._serve_refs, self._closed = config.device.startswith("cuda"), [], False
        try:
            self.actors = [ray.get_actor(f"{name}.rank{r}") for r in range(self.tp)]
            self.pg = ray.util.get_placement_group(f"{name}.pg")
            self.ranks = ray.get([a.describe.remote() for a in self.actors], timeout=10)
        except Exception:  # noqa: BLE001  (half gone: not adoptable; the supervisor replaces it)
            return None
        if not all(self.ranks):  # placed but never started (its starter died): not adoptable
            return None
        return max(gens), self

    @property
    def rank0(self):
        return self.actors[0]

    def _bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.group_config.cpus_per_rank, **self.group_config.bundle_resources}
        if self._use_gpu:
            bundle["GPU"] = 1.0
        return bundle

    def _actor(self, index: int, lifetime: str | None):
        strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=index
        )
        named = {"name": f"{self.name}.rank{index}"} if self.name else {}
        return RankActor.options(
            num_cpus=self.group_config.cpus_per_rank,
            num_gpus=1 if self._use_gpu else 0,
            resources=dict(self.group_config.bundle_resources),
            scheduling_strategy=strategy,
            max_concurrency=1000,  # streams of rank 0; all real work is on its engine thread
            lifetime=lifetime,
            **named,
        ).remote()

    def wait_ready(self) -> list[dict]:
        """Block until every rank has its shard and pool and the engine runs; returns the
        ranks' descriptions. On failure the ranks are stopped and the first rank's error
        raised."""
        from worker.exec.distributed import Rendezvous

        gc = self.group_config
        try:
            ray.get(self.pg.ready(), timeout=gc.start_timeout_s)
            path = ray.get(self.rank0.store_path.remote(), timeout=gc.start_timeout_s)
            rdv = Rendezvous(path, self.tp, gc.rendezvous_host, gc.collective_timeout_s, gc.start_timeout_s)
            cores = parse_cpu_binding(gc.cpu_binding, self.tp) if gc.cpu_binding else None
            refs = [
                a.start.remote(self.config, rank, rdv, gc.heartbeat_s, self.index, cores and cores[rank])
                for rank, a in enumerate(self.actors)
            ]
            self.ranks = _first_error(refs, gc.start_timeout_s)
            if self.tp > 1:  # (rank 0 hands its peers' KV shards to another group's)
                ray.get(self.rank0.set_peers.remote(self.actors[1:]), timeout=gc.start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._serve_refs = [a.serve.remote() for a in self.actors[1:]]
        return self.ranks

    def wait_any_loop_ended(self, timeout_s: float) -> None:
        """Return when a rank's loop ended or after `timeout_s` (a watcher's wait)."""
        if self._serve_refs:
            ray.wait(self._serve_refs, num_returns=1, timeout=timeout_s)
        else:
            time.sleep(timeout_s)

    def failure(self) -> str | None:
        """Why the group is dead (a rank's loop ended without shutdown, rank 0 does not answer
        within `status_timeout_s` or its engine failed), or None while it lives."""
        if self._closed:
            return "shut down"
        if not self._serve_refs and self.tp > 1:  # adopted: ask every rank instead
            try:
                ray.get([a.describe.remote() for a in self.actors[1:]], timeout=self.group_config.status_timeout_s)
            except Exception as e:
                return f"a rank does not answer: {describe_error(e)}"
        done, _ = ray.wait(self._serve_refs, num_returns=len(self._serve_refs), timeout=0)
        for ref in done:  # a loop ended without shutdown: its rank died or lost the group
            try:
                ray.get(ref)
                return "a rank left the group"
            except Exception as e:
                return describe_error(e)
        try:
            stats = ray.get(self.rank0.stats.remote(), timeout=self.group_config.status_timeout_s)
        except Exception as e:  # (rank 0 dead or hung)
            return f"rank 0 does not answer: {describe_error(e)}"
        return stats.get("error")

    def shutdown(self) -> None:
        """Stop the engine and the loops, kill the actors, remove the placement group."""
        if self._closed:
            return
        self._closed = True
        try:
            ray.get(self.rank0.shutdown.remote(), timeout=10)
            ray.wait(self._serve_refs, num_returns=len(self._serve_refs), timeout=5)
        except Exception:  # (a dead group: kill it below all the same)
            pass
        for a in self.actors:
            ray.kill(a, no_restart=True)
        ray.util.remove_placement_group(self.pg)


def _first_error(refs: list, timeout: float) -> list:
    """ray.get of all refs in order, raising the root cause of the first one to fail (the
    other ranks are then stuck in a collective: do not wait for them)."""
    pending, deadline = list(refs), time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        done, pending = ray.wait(pending, num_returns=1, timeout=max(left, 0))
        if not done:
            raise TimeoutError(f"the group did not start within {timeout} s")
        try:
            ray.get(done[0])
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            raise (cause if isinstance(cause, Exception) else e) from None
    return ray.get(refs)
