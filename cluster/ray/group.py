"""A router's handle on a tensor-parallel worker group placed on Ray.

    RayGroup (a router) --Ray: requests in, outputs streamed out--> RankActor rank 0

The group's ranks (a placement group, one `RankActor` per device) are placed, started and
watched by a `RankSet` (cluster/ray/ranks.py): by the supervisor (cluster/ray/supervisor.py) in
a cluster, where groups outlive any router, or by this handle itself in an embedded server
(`RayGroup(config, ...)` places a group and owns it). `RayGroup.attach` is a handle on a group
that the supervisor placed.

Requests go in with one actor call each (`submit`); outputs come back on this router's own Ray
streaming generator (`outputs(subscriber)`), a batch of its requests' outputs per engine step,
which a thread routes to the callers' asyncio queues (a generator per request would carry one
Ray object per token, and far fewer tokens/s). Each output travels as a delta
(cluster/ray/output_delta.py), so rank 0's cost per step does not grow with the outputs' length.
Leaving a stream early aborts the request on the engine; a router that goes away has its
requests aborted by rank 0.

Prefix index: a group that publishes to Redis does so from rank 0 itself. A group whose index
lives in this process (an embedded server's) puts its KV events into this handle's stream,
ahead of the outputs of the step that made them, and the handle feeds them to a
`GroupPublisher` before routing the outputs; so when a caller sees a request finish, the index
already holds its blocks. While idle, rank 0 sends an empty batch every half heartbeat.

Status: every batch carries rank 0's engine stats (draining included), so `status()` answers
from the latest batch and never waits on a rank: the router calls it for every group on every
decision, where a call per group would cost a round trip each.

Health: a watcher thread checks the group every heartbeat: through its `RankSet` when this
handle owns it (a rank's loop ended, rank 0 does not answer), by a stats call to rank 0
otherwise; the output stream failing also marks it dead. In-flight streams then fail with
`EngineDeadError` (the router resumes them elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from cluster.group import GroupHandle, GroupStatus, for_group, status_from_stats
from cluster.index import GroupPublisher, IndexWriter
from cluster.ray.config import RayGroupConfig
from cluster.ray.output_delta import OutputAssembler
from cluster.ray.rank_actor import OWNER, IndexTarget, KVEvents, RequestFailed, describe_error
from cluster.ray.ranks import RankSet
from cluster.ray.runtime import ray
from worker.config import EngineConfig
from worker.engine.async_engine import hand_over
from worker.outputs import RequestOutput
from worker.protocol import EngineDeadError, GenerationRequest

log = logging.getLogger(__name__)
_group_ids = itertools.count()


class RayGroup(GroupHandle):
    """A router's handle on one group on Ray; see the module docstring."""

    tells_changes = True

    def __init__(
        self,
        config: EngineConfig,
        group_config: RayGroupConfig | None = None,
        group_id: str | None = None,
        wait: bool = True,
        index: IndexWriter | Sequence[IndexWriter] | None = None,
    ) -> None:
        """Place a group of `group_config.tensor_parallel_size` devices, owned by this process.
        `index`: where its KV events and load go, through this handle (one index or several;
        None: nowhere)."""
        gc = group_config or RayGroupConfig()
        if group_id is not None:  # (a disk tier of its own under an id a restart keeps)
            config = for_group(config, group_id)
        group_id = group_id or f"ray-group-{next(_group_ids)}-{uuid.uuid4().hex[:6]}"
        target = None if index is None else IndexTarget(group_id, subscriber=OWNER)
        ranks = RankSet(config, gc, target)
        self._setup(group_id, ranks.rank0, gc, OWNER, index)
        self.ranks_owned: RankSet | None = ranks
        if wait:
            self.wait_ready()

    @classmethod
    def attach(
        cls,
        group_id: str,
        rank0,
        group_config: RayGroupConfig,
        ranks: Sequence[dict],
        subscriber: str,
        index: IndexWriter | Sequence[IndexWriter] | None = None,
    ) -> RayGroup:
        """A handle on a group that another process placed and watches (the supervisor):
        `rank0` its rank 0 actor, `ranks` the ranks' descriptions, `subscriber` this router's
        name for its own output stream (unique per router). `index`: only when the group
        streams its KV events to this subscriber."""
        self = cls.__new__(cls)
        self._setup(group_id, rank0, group_config, subscriber, index)
        self.ranks_owned = None
        self._ranks = [dict(r) for r in ranks]
        self._started()
        return self

    def _setup(self, group_id, rank0, gc: RayGroupConfig, subscriber: str, index) -> None:
        self.group_id, self.group_config, self.tp = group_id, gc, gc.tensor_parallel_size
        self._rank0, self._subscriber, self.index = rank0, subscriber, index
        self._error: str | None = None
        self._closed = False
        self._ranks: list[dict] = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._assembler = OutputAssembler()  # full outputs rebuilt from rank 0's deltas
        self.publisher: GroupPublisher | None = None  # owned by the output thread once started
        self._pump_thread: threading.Thread | None = None
        self._stream = None
        self._stats: dict = {}  # rank 0's engine stats, from the latest batch of the stream
        self._stats_version = 0  # + 1 each time _stats is replaced
        self._status: GroupStatus | None = None  # built from the stats of _status_version
        self._status_version = -1
        self._stopped = threading.Event()  # set by shutdown: the watcher leaves
        self.generation = 0  # the supervisor's generation of the group (0: not supervised)
        self.restarts = 0

    def wait_ready(self) -> None:
        """Block until every rank of an owned group has its shard and pool and the engine runs;
        on failure tear the group down and raise the first rank's error."""
        try:
            self._ranks = self.ranks_owned.wait_ready()
        except BaseException:
            self._closed = True
            raise
        self._started()

    def _started(self) -> None:
        gc = self.group_config
        try:
            self._stats = ray.get(self._rank0.stats.remote(), timeout=gc.start_timeout_s)
            self._stats_version += 1
            if self.index is not None:
                self.publisher = GroupPublisher(self.index, self.group_id, self._inventory)
        except BaseException:
            self.shutdown()
            raise
        self._status_changed()
        heartbeat_s = gc.heartbeat_s if self.publisher is None else self.publisher.config.heartbeat_interval_s
        self._stream = self._rank0.outputs.remote(self._subscriber, heartbeat_s / 2)
        self._pump_thread = threading.Thread(
            target=self._pump, args=(self._stream,), name="pagefleet-outputs", daemon=True
        )
        self._pump_thread.start()
        threading.Thread(target=self._watch, name="pagefleet-watch", daemon=True).start()

    def _inventory(self) -> dict[str, list[bytes]]:
        timeout = self.group_config.collective_timeout_s  # (between two steps of rank 0)
        return ray.get(self._rank0.tier_hashes.remote(), timeout=timeout)

    # ---- GroupHandle -------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        if self._error is not None or self._closed:
            raise EngineDeadError(f"group {self.group_id} is dead: {self._error or 'shut down'}")
        if self._stream is None:
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
            await self._rank0.submit.remote(request, self._subscriber)
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
                self._stats_version += 1
                if stats.get("error"):
                    self._error = self._error or stats["error"]
                self._publish(batch)
                routed = []  # handed to the callers' loops together (`hand_over`)
                for item in batch:
                    if isinstance(item, KVEvents):
                        continue
                    if isinstance(item, RequestFailed):
                        self._assembler.drop(item.request_id)
                        routed.append((item.request_id, self._as_error(item.error)))
                    elif (out := self._assembler.apply(item)) is not None:
                        routed.append((item.request_id, out))
                self._route_all(routed)
                self._status_changed()  # new stats, and maybe an error
        except Exception as e:  # rank 0 died
            error = f"rank 0's output stream failed: {describe_error(e)}"
        if not self._closed:
            self._error = self._error or error or "rank 0's output stream ended"
        self._status_changed()
        reason = self._error or "shut down"
        self._route_all(
            [(rid, EngineDeadError(f"group {self.group_id} is dead: {reason}")) for rid in list(self._queues)]
        )
        if self.publisher is not None:
            self.publisher.close()  # a dead or stopped group's blocks leave the index at once

    def _publish(self, batch: list) -> None:
        """Driver thread: a batch's KV events to the index, before the batch's outputs reach
        their callers. Index trouble never fails the group."""
        if self.publisher is None:
            return
        try:
            events = [e for item in batch if isinstance(item, KVEvents) for e in item.events]
            self.publisher.publish_step(events)
        except Exception:  # e.g. rank 0 gone while the publisher fetched the inventory
            log.exception("group %s: publishing to the prefix index failed", self.group_id)

    def _route_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Each (request id, output or error) to its caller's queue, a loop's all at once."""
        queues = self._queues
        hand_over(
            (target[0], target[1].put_nowait, item) for rid, item in items if (target := queues.get(rid)) is not None
        )

    def _as_error(self, e: BaseException) -> BaseException:
        if isinstance(e, EngineDeadError):
            self._error = self._error or str(e)
            return EngineDeadError(f"group {self.group_id}: {e}")
        return e

    def abort(self, request_id: str) -> None:
        if not self._closed:
            self._rank0.abort.remote(request_id)

    def unpin(self, document_id: str) -> None:
        if not self._closed:
            self._rank0.unpin.remote(document_id)

    async def pull_from(self, holder: GroupHandle, block_hashes: Sequence[bytes], timeout_s: float) -> int:
        """From another group on Ray: this group's rank 0 asks the holder's for an export (each
        holder rank copies its shard between two steps), every rank r fetches rank r's shard
        through the object store, and rank 0 writes them into the host tiers between two steps
        (cluster/ray/rank_actor.py: `pull`). A holder that is gone, slow or of another format
        brings 0: the request recomputes."""
        if not isinstance(holder, RayGroup) or holder is self or self._closed or holder._closed:
            return 0
        hashes = tuple(block_hashes)
        try:
            return await asyncio.wait_for(self._rank0.pull.remote(holder._rank0, hashes, timeout_s), timeout_s)
        except Exception as e:  # (TimeoutError, RayActorError, KVTransferError): recompute instead
            log.warning(
                "group %s: pulling %d blocks from %s failed (%s)", self.group_id, len(hashes), holder.group_id, e
            )
            return 0

    async def pull_from_disk(self, group_id: str, block_hashes: Sequence[bytes], timeout_s: float) -> int:
        """Every rank reads rank r's files that `group_id`'s disk tier left on this node, and
        rank 0 writes the blocks all of them read into the host tiers between two steps
        (cluster/ray/rank_actor.py: `pull_disk`)."""
        if self._closed:
            return 0
        hashes = tuple(block_hashes)
        try:
            return await asyncio.wait_for(self._rank0.pull_disk.remote(group_id, hashes), timeout_s)
        except Exception as e:  # (TimeoutError, RayActorError, KVTransferError): recompute instead
            log.warning(
                "group %s: reading %d blocks of %s's disk tier failed (%s)", self.group_id, len(hashes), group_id, e
            )
            return 0

    def status(self) -> GroupStatus:
        """Load as of rank 0's latest batch and liveness as the watcher last saw it; never
        waits on a rank (see the module docstring)."""
        stats, alive, error = self._stats, self._error is None and not self._closed, self._error
        version, s = self._stats_version, self._status
        if s is None or s.alive != alive or s.error != error or self._status_version != version:
            s = status_from_stats(
                self.group_id,
                stats if alive else {},
                alive=alive,
                tp=self.tp,
                devices=self.devices,
                error=error,
            )
            if self.generation:
                state = ("draining" if s.draining else "serving") if alive else "dead"
                s = replace(s, state=state, generation=self.generation, restarts=self.restarts)
            self._status, self._status_version = s, version
        return s

    def shutdown(self) -> None:
        """Stop following the group; an owned group's ranks are stopped too."""
        if self._closed and self._stopped.is_set():
            return
        self._closed = True
        self._stopped.set()
        self._status_changed()
        if self.ranks_owned is not None:
            self.ranks_owned.shutdown()  # ends the stream as well
        elif self._stream is not None:
            with contextlib.suppress(Exception):
                ray.cancel(self._stream)  # rank 0 aborts this router's requests
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
        """Per rank: node id, device, GPU ids, pid, KV bytes per token of its pool."""
        return [dict(r) for r in self._ranks]

    @property
    def _actors(self) -> list:
        return self.ranks_owned.actors if self.ranks_owned is not None else [self._rank0]

    def engine_stats(self) -> dict:
        return ray.get(self._rank0.stats.remote(), timeout=self.group_config.status_timeout_s)

    def timings(self) -> list[list[tuple[int, float, tuple[float, ...]]]]:
        """Per rank, (scheduled requests, seconds from decision to forward, its parts) of
        recent steps."""
        return ray.get([a.timings.remote() for a in self._actors])

    def probe_broadcast(self, rounds: int = 100) -> float:
        return ray.get(self._rank0.probe_broadcast.remote(rounds))

    def _watch(self) -> None:
        """Watcher thread: every heartbeat, is the group alive (see the module docstring)? The
        first failure marks it dead."""
        gc = self.group_config
        while not self._stopped.is_set() and self._error is None:
            if self.ranks_owned is not None:
                self.ranks_owned.wait_any_loop_ended(gc.heartbeat_s)
            else:
                self._stopped.wait(gc.heartbeat_s)
            if self._stopped.is_set():
                return
            error = self._failure()
            if error is not None and not self._closed:
                self._error = self._error or error
                self._status_changed()

    def _failure(self) -> str | None:
        if self.ranks_owned is not None:
            return self.ranks_owned.failure()
        try:
            stats = ray.get(self._rank0.stats.remote(), timeout=self.group_config.status_timeout_s)
        except Exception as e:  # (rank 0 dead or hung)
            return f"rank 0 does not answer: {describe_error(e)}"
        return stats.get("error")


__all__ = ["RayGroup", "RayGroupConfig"]
