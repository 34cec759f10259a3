"""A tensor-parallel worker group placed on Ray: one placement group, one actor per device.

    RayGroup (driver) --Ray: requests in, outputs streamed out, lifecycle--> RankActor x tp

Here is the driver side (`RayGroup`); its configuration and the checks made before placing
anything are cluster/ray/config.py, the actor that hosts each rank cluster/ray/rank_actor.py.

The placement group holds one bundle per device (a GPU bundle when the engine runs on CUDA, a
CPU bundle otherwise), STRICT_PACK so that all ranks share a node. Rank 0's actor names a store
file on that node for the rendezvous; the driver hands it to every rank, and the ranks talk over
the node's loopback interface (`RayGroupConfig.rendezvous_host`), so a group listens on no
network interface.

Requests go in with one actor call each (`submit`); outputs come back on one Ray streaming
generator per group (`outputs`), a batch of every request's outputs per engine step, which a
driver thread routes to the callers' asyncio queues. (A streaming generator per request was
simpler but carried one Ray object per token, and far fewer tokens/s.) Each
output travels as a delta (cluster/ray/output_delta.py): only the step's new tokens, text and
timings cross Ray, so rank 0's cost per step does not grow with the outputs' length. Leaving
a stream early aborts the request on the engine.

Prefix index: with an `index`, rank 0's engine puts its KV events into the same output stream,
ahead of the outputs of the step that made them, and every batch carries the engine's stats;
the driver thread feeds them to a `GroupPublisher` before routing the outputs. So when a
caller sees a request finish, the index already holds its blocks, whether it is in-process or
Redis. While idle, rank 0 sends an empty batch every half heartbeat, which keeps the group live
in the index.

Status: every batch carries rank 0's engine stats (an idle group sends an empty batch every
half heartbeat), so `status()` answers from the latest batch and never waits on a rank: the
router calls it for every group on every decision, where a call per group would cost a round
trip each.

Health: each rank > 0 runs its loop inside a long-lived actor call (`serve`), whose result
resolves only when the loop ends; rank 0's engine stops when a collective fails or times out.
A watcher thread waits on those calls and pings rank 0 every heartbeat (`status_timeout_s` to
answer); `status()` reports the group dead as soon as the watcher or the output stream sees a
rank gone, and in-flight streams fail with `EngineDeadError`. Within `heartbeat_s +
collective_timeout_s` of a rank dying or hanging, rank 0 has noticed too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from cluster.group import GroupHandle, GroupStatus, status_from_stats
from cluster.index import GroupPublisher, IndexWriter
from cluster.ray.config import RayGroupConfig, check_tensor_parallel, parse_cpu_binding
from cluster.ray.output_delta import OutputAssembler
from cluster.ray.rank_actor import KVEvents, RankActor, RequestFailed, bind_process, describe_error
from cluster.ray.runtime import ensure_ray, ray
from worker.async_engine import EngineDeadError, GenerationRequest
from worker.engine import EngineConfig
from worker.outputs import RequestOutput

log = logging.getLogger(__name__)
_group_ids = itertools.count()


class RayGroup(GroupHandle):
    """A group of `tensor_parallel_size` devices on one node of a Ray cluster."""

    tells_changes = True

    def __init__(
        self,
        config: EngineConfig,
        group_config: RayGroupConfig | None = None,
        group_id: str | None = None,
        wait: bool = True,
        index: IndexWriter | Sequence[IndexWriter] | None = None,
    ) -> None:
        """`index`: where the group publishes its KV events and load (one index or several;
        None: nowhere)."""
        self.config = config
        self.group_config = gc = group_config or RayGroupConfig()
        self.group_id = group_id or f"ray-group-{next(_group_ids)}-{uuid.uuid4().hex[:6]}"
        self.tp = gc.tensor_parallel_size
        check_tensor_parallel(config.model, self.tp)
        ensure_ray()
        self._use_gpu = config.device.startswith("cuda")
        self._error: str | None = None
        self._closed = False
        self._ranks: list[dict] = []
        self._serve_refs: list = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._assembler = OutputAssembler()  # full outputs rebuilt from rank 0's deltas
        self.index = index
        self.publisher: GroupPublisher | None = None  # owned by the output thread once started
        self._pump_thread: threading.Thread | None = None
        self._stats: dict = {}  # rank 0's engine stats, from the latest batch of the stream
        self._status: GroupStatus | None = None  # built from _status_of, until it changes
        self._status_of: dict | None = None
        self._stopped = threading.Event()  # set by shutdown: the watcher leaves
        self._pg = ray.util.placement_group(
            [self._bundle() for _ in range(self.tp)], strategy="STRICT_PACK"
        )
        self._actors = [self._actor(i) for i in range(self.tp)]
        if wait:
            self.wait_ready()

    def _bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.group_config.cpus_per_rank, **self.group_config.bundle_resources}
        if self._use_gpu:
            bundle["GPU"] = 1.0
        return bundle

    def _actor(self, index: int):
        strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(
            self._pg, placement_group_bundle_index=index
        )
        return RankActor.options(
            num_cpus=self.group_config.cpus_per_rank,
            num_gpus=1 if self._use_gpu else 0,
            resources=dict(self.group_config.bundle_resources),
            scheduling_strategy=strategy,
            max_concurrency=1000,  # streams of rank 0; all real work is on its engine thread
        ).remote()

    def wait_ready(self) -> None:
        """Block until every rank has its shard and pool and the engine runs; on failure tear
        the group down and raise the first rank's error."""
        from worker.distributed import Rendezvous

        gc = self.group_config
        try:
            ray.get(self._pg.ready(), timeout=gc.start_timeout_s)
            path = ray.get(self._actors[0].store_path.remote(), timeout=gc.start_timeout_s)
            rdv = Rendezvous(
                path, self.tp, gc.rendezvous_host, gc.collective_timeout_s, gc.start_timeout_s
            )
            events = self.index is not None
            cores = parse_cpu_binding(gc.cpu_binding, self.tp) if gc.cpu_binding else None
            refs = [
                a.start.remote(self.config, rank, rdv, gc.heartbeat_s, events, cores and cores[rank])
                for rank, a in enumerate(self._actors)
            ]  # fmt: skip
            self._ranks = _first_error(refs, gc.start_timeout_s)
            self._stats = ray.get(self._actors[0].stats.remote(), timeout=gc.start_timeout_s)
            self._status_changed()
            if events:
                self.publisher = GroupPublisher(self.index, self.group_id, self._inventory)
        except BaseException:
            self.shutdown()
            raise
        self._serve_refs = [a.serve.remote() for a in self._actors[1:]]
        heartbeat_s = gc.heartbeat_s if self.publisher is None else self.publisher.config.heartbeat_interval_s  # fmt: skip
        stream = self._actors[0].outputs.remote(heartbeat_s / 2)
        self._pump_thread = threading.Thread(
            target=self._pump, args=(stream,), name="pagefleet-outputs", daemon=True
        )
        self._pump_thread.start()
        threading.Thread(target=self._watch, name="pagefleet-watch", daemon=True).start()

    def _inventory(self) -> list[bytes]:
        timeout = self.group_config.collective_timeout_s  # (between two steps of rank 0)
        return ray.get(self._actors[0].cached_hashes.remote(), timeout=timeout)

    # ---- GroupHandle -------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        if self._error is not None or self._closed:
            raise EngineDeadError(f"group {self.group_id} is dead: {self._error or 'shut down'}")
        if not self._ranks:
            raise RuntimeError(f"group {self.group_id} has not started: call wait_ready() first")
        request = replace(request, request_id=request.request_id or uuid.uuid4().hex)
        rid = request.request_id
        if rid in self._queues:
            raise ValueError(f"request_id {rid!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), q)
        if not isinstance(request.prompt, str):  # rank 0 does not send back what we have
            self._assembler.expect(rid, request.prompt)
        finished = False
        try:
            await self._actors[0].submit.remote(request)
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        except ray.exceptions.RayActorError as e:
            finished = True
            raise EngineDeadError(f"group {self.group_id}: rank 0 died") from e
        finally:
            self._queues.pop(rid, None)
            self._assembler.drop(rid)
            if not finished:
                self.abort(rid)

    def _pump(self, stream) -> None:
        """Driver thread: route each batch of rank 0's output stream to the requests' queues;
        when the stream ends or fails, fail every open request."""
        error: str | None = None
        try:
            for ref in stream:
                batch, stats = ray.get(ref)
                self._stats = stats
                if stats.get("error"):
                    self._error = self._error or stats["error"]
                self._publish(batch, stats)
                for item in batch:
                    if isinstance(item, KVEvents):
                        continue
                    if isinstance(item, RequestFailed):
                        self._assembler.drop(item.request_id)
                        self._route(item.request_id, self._as_error(item.error))
                    elif (out := self._assembler.apply(item)) is not None:
                        self._route(item.request_id, out)
                self._status_changed()  # new stats, and maybe an error
        except Exception as e:  # rank 0 died
            error = f"rank 0's output stream failed: {describe_error(e)}"
        if not self._closed:
            self._error = self._error or error or "rank 0's output stream ended"
        self._status_changed()
        reason = self._error or "shut down"
        for rid in list(self._queues):
            self._route(rid, EngineDeadError(f"group {self.group_id} is dead: {reason}"))
        if self.publisher is not None:
            self.publisher.close()  # a dead or stopped group's blocks leave the index at once

    def _publish(self, batch: list, stats: dict) -> None:
        """Driver thread: a batch's KV events and the engine's load to the index, before the
        batch's outputs reach their callers. Index trouble never fails the group."""
        if self.publisher is None:
            return
        try:
            events = [e for item in batch if isinstance(item, KVEvents) for e in item.events]
            load = status_from_stats(self.group_id, stats, True, self.tp, self.devices).load()
            self.publisher.publish_step(events, load)
        except Exception:  # e.g. rank 0 gone while the publisher fetched the inventory
            log.exception("group %s: publishing to the prefix index failed", self.group_id)

    def _route(self, rid: str, item) -> None:
        target = self._queues.get(rid)
        if target is not None:
            loop, q = target
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                loop.call_soon_threadsafe(q.put_nowait, item)

    def _as_error(self, e: BaseException) -> BaseException:
        if isinstance(e, EngineDeadError):
            self._error = self._error or str(e)
            return EngineDeadError(f"group {self.group_id}: {e}")
        return e

    def abort(self, request_id: str) -> None:
        if not self._closed:
            self._actors[0].abort.remote(request_id)

    def status(self) -> GroupStatus:
        """Load as of rank 0's latest batch and liveness as the watcher last saw it; never
        waits on a rank (see the module docstring)."""
        stats, alive, error = self._stats, self._error is None and not self._closed, self._error
        s = self._status
        if s is None or s.alive != alive or s.error != error or self._status_of is not stats:
            s = status_from_stats(
                self.group_id, stats if alive else {}, alive=alive, tp=self.tp,
                devices=self.devices, error=error,
            )  # fmt: skip
            self._status, self._status_of = s, stats
        return s

    def shutdown(self) -> None:
        """Stop the engine and the loops, kill the actors, remove the placement group."""
        if self._closed:
            return
        self._closed = True
        self._stopped.set()
        self._status_changed()
        try:
            ray.get(self._actors[0].shutdown.remote(), timeout=10)
            ray.wait(self._serve_refs, num_returns=len(self._serve_refs), timeout=5)
        except Exception:  # (a dead group: kill it below all the same)
            pass
        for a in self._actors:
            ray.kill(a, no_restart=True)
        ray.util.remove_placement_group(self._pg)
        if self._pump_thread is not None:  # it deregisters the group from the index
            self._pump_thread.join(timeout=10)
        elif self.publisher is not None:
            self.publisher.close()

    # ---- introspection -----------------------------------------------------------------
    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(r["node_id"] for r in self._ranks)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(f"{r['device']}@{r['node_id']}" for r in self._ranks)

    @property
    def ranks(self) -> list[dict]:
        """Per rank: node id, device, GPU ids, KV bytes per token of its pool."""
        return [dict(r) for r in self._ranks]

    def engine_stats(self) -> dict:
        return self._poll()

    def timings(self) -> list[list[tuple[int, float, tuple[float, ...]]]]:
        """Per rank, (scheduled requests, seconds from decision to forward, its parts) of
        recent steps."""
        return ray.get([a.timings.remote() for a in self._actors])

    def probe_broadcast(self, rounds: int = 100) -> float:
        return ray.get(self._actors[0].probe_broadcast.remote(rounds))

    def _watch(self) -> None:
        """Watcher thread: every heartbeat, has a rank's loop ended (the rank died or left the
        group), and does rank 0 answer within `status_timeout_s` with a live engine? The first
        failure marks the group dead."""
        gc = self.group_config
        while not self._stopped.is_set() and self._error is None:
            if self._serve_refs:
                ray.wait(self._serve_refs, num_returns=1, timeout=gc.heartbeat_s)
            else:
                self._stopped.wait(gc.heartbeat_s)
            if self._stopped.is_set():
                return
            self._poll()
            self._status_changed()  # (when it marked the group dead)

    def _poll(self) -> dict:
        """Rank 0's stats, and the liveness of every rank (marks the group dead)."""
        if self._closed:
            return {}
        done, _ = ray.wait(self._serve_refs, num_returns=len(self._serve_refs), timeout=0)
        for ref in done:  # a loop ended without shutdown: its rank died or lost the group
            try:
                ray.get(ref)
                self._error = self._error or "a rank left the group"
            except Exception as e:
                self._error = self._error or describe_error(e)
        try:
            stats = ray.get(
                self._actors[0].stats.remote(), timeout=self.group_config.status_timeout_s
            )
        except Exception as e:  # (rank 0 dead or hung)
            self._error = self._error or f"rank 0 does not answer: {describe_error(e)}"
            return {}
        if stats.get("error"):
            self._error = self._error or stats["error"]
        return stats


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


__all__ = [
    "RayGroup",
    "RayGroupConfig",
    "bind_process",  # (cluster/ray/rank_actor.py; imported from here by callers)
    "check_tensor_parallel",
    "parse_cpu_binding",
]
