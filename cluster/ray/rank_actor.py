"""The Ray actor that hosts one rank of a tensor-parallel group; cluster/ray/ranks.py places
the actors, cluster/ray/group.py is a router's handle on rank 0.

    RankActor rank 0: LLMEngine(executor=TPExecutor) inside an AsyncEngine
    RankActor rank r: TPWorker loop; steps arrive from rank 0 over torch.distributed (gloo)

Rank 0 names a store file on its node for the rendezvous (`store_path`); every rank joins the
group in `start`, bound to its cores if the group names them. Each rank > 0 runs its step loop
inside one long-lived call (`serve`).

Rank 0 serves any number of subscribers (routers): each opens its own output stream
(`outputs(subscriber)`) and sends requests one call each (`submit(request, subscriber)`); every
request's outputs, as deltas (cluster/ray/output_delta.py), and failures (`RequestFailed`) go
into its subscriber's outbox, streamed a batch per wake-up with the engine's stats; while idle,
an empty batch every `idle_s`. A subscriber whose stream ends (its router left or died) has its
requests aborted.

The group's KV events reach the prefix index by the ways its `IndexTarget` names (`start(...,
index=)`): with a Redis URL rank 0 publishes them itself, handing each step from its engine
thread to a publisher thread (cluster/index/publish_thread.py), so that a hung Redis never
pauses the engine; with a subscriber they also go into that subscriber's stream (`KVEvents`,
ahead of the outputs of the step that made them), for a router that keeps an index in its own
process. Calls that read engine state (`cached_hashes`, `probe_broadcast`) run
on the engine thread between steps. `set_draining` marks the group as draining in its stats:
routers place nothing new there.

A rank ends its own process when it no longer serves: when its node is gone (its raylet died, or
the GCS declared the node dead: cluster/ray/node_watch.py), Ray can no longer kill it; when a
newer registration of its group fenced rank 0 off in the index, a replacement serves instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import sys
import uuid
from dataclasses import dataclass, replace

from cluster.ray.node_watch import NodeWatch
from cluster.ray.output_delta import OutputDelta
from cluster.ray.runtime import ray
from worker.config import EngineConfig
from worker.heap import settle_heap
from worker.kv_events import DEVICE
from worker.kv_transfer import BlockExport
from worker.outputs import RequestOutput
from worker.protocol import GenerationRequest

log = logging.getLogger(__name__)

OWNER = ""  # the subscriber of the process that placed the group (and of `submit` by default)


@dataclass(frozen=True)
class IndexTarget:
    """Where a group's KV events and load go: published by rank 0 to the Redis index at
    `redis_url` (in `cluster`, for `model`), or streamed to `subscriber` for its process's
    index."""

    group_id: str
    redis_url: str | None = None
    cluster: str = "pagefleet"
    model: str = "model"
    subscriber: str | None = None


ENGINE_SWITCH_INTERVAL_S = 0.0002


def bind_process(cores: frozenset[int]) -> None:
    """Bind this process's threads, present and future, to `cores` (Linux)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(tid), cores)


@ray.remote
class RankActor:
    """One device of a group. Rank 0 hosts the engine; the others run the step loop."""

    def __init__(self) -> None:
        # Load torch and the model code while the other ranks start.
        import worker.exec.executor  # noqa: F401

        self.engine = None  # rank 0: AsyncEngine
        self.facts = None  # rank 0: its model for routers (worker/protocol.py: ModelFacts)
        self.executor = None  # rank 0: TPExecutor
        self.worker = None  # rank > 0: TPWorker
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # work for rank 0's engine thread
        self._streams: dict[str, str] = {}  # rank 0: request id -> its subscriber
        self._subscribers: dict[str, _Outbox] = {}  # rank 0: outputs not yet streamed
        self._events_to: str | None = None  # the subscriber whose stream carries KV events
        self._publisher = None  # rank 0 publishing to Redis itself: a GroupPublisher
        self._draining = False
        self._closing = False
        self._description: dict = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the actor's event loop
        self._node_watch: NodeWatch | None = None
        self._peers: list = []  # rank 0: the other ranks' actors, rank 1 first (for KV pulls)
        self._kv_format = None  # rank 0: what another group must share to exchange KV blocks

    def store_path(self) -> str:
        """A fresh store file on this node for the group's rendezvous (worker/exec/distributed.py:
        the ranks share this node)."""
        from worker.exec.distributed import Rendezvous

        return Rendezvous.new_store_path()

    async def start(
        self,
        config: EngineConfig,
        rank: int,
        rendezvous,
        heartbeat_s: float,
        index: IndexTarget | None = None,
        cores: frozenset[int] | None = None,
    ) -> dict:
        """Join the group; rank 0 builds the engine, its KV events going to `index` (None:
        nowhere). `cores`: bind this rank's process to them first."""
        self._loop = asyncio.get_running_loop()
        node_id = ray.get_runtime_context().get_node_id()
        self._node_watch = NodeWatch(node_id, lambda why: end_process(f"its node is gone: {why}"))
        if cores is not None:
            bind_process(cores)
        return await asyncio.to_thread(self._start, config, rank, rendezvous, heartbeat_s, index)

    def _start(self, config, rank: int, rendezvous, heartbeat_s: float, index) -> dict:
        import torch

        from worker.engine.async_engine import AsyncEngine
        from worker.engine.llm_engine import LLMEngine
        from worker.exec.distributed import init_group
        from worker.exec.tp_executor import TPExecutor
        from worker.exec.tp_worker import TPWorker

        if config.device.startswith("cuda"):
            config = replace(config, device="cuda:0")  # Ray shows this actor its own GPU only
        comm, channel = init_group(rendezvous, rank, torch.device(config.device))
        if rank == 0:
            # The engine thread shares the GIL with the output streams (the actor's event
            # loop); after each collective it must get the GIL back quickly, not after the
            # default 5 ms switch interval.
            sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
            self.executor = TPExecutor(config, comm, channel, heartbeat_s)
            engine = LLMEngine(config, executor=self.executor)
            if index is not None and index.redis_url is not None:
                self._publish_to_redis(engine, index)
            if index is not None and index.subscriber is not None:
                self._events_to = index.subscriber
            if self._publisher is not None or self._events_to is not None:
                engine.on_kv_events = self._kv_events
            self.facts = engine.facts()  # (before the engine thread uses the tokenizer)
            self._inventory = engine.tier_hashes  # (called between steps, on its thread)
            self._kv_format = engine.kv_format()
            self.engine = AsyncEngine(engine, self._tick)
            layout = self.executor.layout
        else:
            self.worker = TPWorker(config, comm, channel)
            self.worker.init_pool()
            layout = self.worker.layout
        # What is built by now (model, pool, tokenizer) lives as long as the rank: hidden from
        # the garbage collector, a full collection no longer walks it (it would pause a step;
        # benchmarks/RESULTS.md, "Engine time per step"), and young collections are rarer.
        settle_heap()
        ctx = ray.get_runtime_context()
        self._description = {
            "rank": rank,
            "node_id": ctx.get_node_id(),
            "device": config.device,
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "pid": os.getpid(),
            "kv_bytes_per_token": layout.bytes_per_token,
        }
        return self._description

    async def describe(self) -> dict:
        """This rank's description, as `start` returned it (also a liveness check: it answers
        from the actor's event loop whatever its engine or step loop is doing)."""
        return self._description

    # ---- rank > 0 ----------------------------------------------------------------------
    async def serve(self) -> int:
        """Run the step loop until rank 0 says shutdown (returns the steps run) or the group
        fails (raises)."""
        return await asyncio.to_thread(self.worker.run)

    # ---- rank 0 ------------------------------------------------------------------------
    def _publish_to_redis(self, engine, index: IndexTarget) -> None:
        from cluster.index import GroupPublisher, RedisPrefixIndex

        redis = RedisPrefixIndex.from_url(index.redis_url, index.cluster, index.model)
        fenced = f"a newer registration of group {index.group_id} fenced rank 0 off"
        self._publisher = GroupPublisher(
            redis,
            index.group_id,
            engine.tier_hashes,
            on_fenced=lambda: end_process(fenced),
        )

    async def submit(self, request: GenerationRequest, subscriber: str = OWNER) -> None:
        """Start a request; its outputs join `subscriber`'s output stream as deltas (only what
        changed crosses Ray). The engine hands a step's outputs to this loop at once, each to
        the request's relay (a callback, not a task woken per output, which lengthened the
        engine's steps: benchmarks/RESULTS.md)."""
        rid = request.request_id
        send_prompt = isinstance(request.prompt, str)  # ids given: the router has them

        def relay(item: RequestOutput | BaseException) -> None:
            nonlocal send_prompt
            if rid not in self._streams:
                return  # failed here before (the engine's final output of its abort)
            try:
                if isinstance(item, BaseException):  # bad input, a full queue, a dead engine
                    raise item
                delta = OutputDelta.of(item, send_prompt)
            except Exception as e:  # the caller's error; the request ends here
                del self._streams[rid]
                if not isinstance(item, BaseException):
                    self.engine.abort(rid)
                self._emit(subscriber, RequestFailed(rid, e))
                return
            send_prompt = False
            if item.finished:
                del self._streams[rid]
            self._emit(subscriber, delta)

        self._streams[rid] = subscriber
        try:
            self.engine.submit(request, relay)
        except Exception as e:  # a dead engine, an id in use
            self._streams.pop(rid, None)
            self._emit(subscriber, RequestFailed(rid, e))

    def _emit(self, subscriber: str, item) -> None:
        box = self._subscribers.get(subscriber)
        if box is None:
            box = self._subscribers[subscriber] = _Outbox()
        box.items.append(item)
        box.ready.set()

    def _kv_events(self, events: list) -> None:
        # Engine thread, during a step. Redis: published after the step (`_tick`). A router's
        # index: queued on the event loop ahead of the step's outputs (they reach the outbox one
        # hop later, through the requests' followers).
        if self._publisher is not None:
            self._publisher.collect(events)
        if self._events_to is not None:
            self._loop.call_soon_threadsafe(self._emit, self._events_to, KVEvents(events))

    async def outputs(self, subscriber: str = OWNER, idle_s: float | None = None):
        """`subscriber`'s output stream: (batch, engine stats) with every output (or failure)
        of its requests (and the KV-event batches, for the subscriber that publishes them), a
        batch per wake-up, so that Ray carries one object per step rather than one per token.
        With `idle_s`, an empty batch at least that often (a heartbeat). When the stream ends,
        the subscriber's requests are aborted."""
        box = self._subscribers.setdefault(subscriber, _Outbox())
        try:
            while not self._closing:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(box.ready.wait(), idle_s)
                box.ready.clear()
                batch, box.items = box.items, []
                if batch or idle_s is not None:
                    yield batch, self.stats()
        finally:
            if self._subscribers.get(subscriber) is box:
                del self._subscribers[subscriber]
            for rid, owner in list(self._streams.items()):
                if owner == subscriber and self.engine is not None:
                    self.engine.abort(rid)

    async def abort(self, request_id: str) -> None:
        """Stop the request; its final output ("abort") follows in the output stream."""
        if request_id in self._streams:
            self.engine.abort(request_id)

    async def unpin(self, document_id: str) -> None:
        """Release a document's pinned blocks (worker/protocol.py: Pin)."""
        if self.engine is not None:
            self.engine.unpin(document_id)

    def stats(self) -> dict:
        if self.engine is None:
            return {"error": "rank 0 has not started its engine", "draining": self._draining}
        dead = self.engine.dead
        error = None if dead is None else describe_error(dead)
        return {**self.engine.stats(), "error": error, "draining": self._draining}

    def model_facts(self):
        """The model as routers of other processes need it (worker/protocol.py: ModelFacts)."""
        if self.facts is None:
            raise RuntimeError("rank 0 has not started its engine")
        return self.facts

    def set_draining(self, draining: bool = True) -> None:
        """Routers place no new request on a draining group; those in flight finish."""
        self._draining = draining

    def timings(self) -> list[tuple[int, float, tuple[float, ...]]]:
        """(scheduled requests, seconds from decision to forward, its parts) of recent steps,
        this rank (worker/exec/tp_executor.py and worker/exec/tp_worker.py name the parts)."""
        source = self.executor if self.executor is not None else self.worker
        return list(source.timings)

    async def probe_broadcast(self, rounds: int) -> float:
        """One small broadcast's latency on the step channel, measured on the engine thread
        between steps."""
        return await self._between_steps(lambda: self.executor.probe_broadcast(rounds))

    async def cached_hashes(self) -> list[bytes]:
        """Every block hash in the engine's prefix cache on the device."""
        return (await self._between_steps(self._inventory))[DEVICE]

    async def tier_hashes(self) -> dict[str, list[bytes]]:
        """Every block hash of every tier of the engine, by medium (the group's index inventory)."""
        return await self._between_steps(self._inventory)

    async def _between_steps(self, fn):
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, done))
        return await asyncio.wrap_future(done)

    # ---- KV blocks moved between groups (worker/kv_transfer.py) --------------------------
    def set_peers(self, peers: list) -> None:
        """Rank 0: the actors of ranks 1.. of this group, whose KV shards travel on their own."""
        self._peers = list(peers)

    async def export_blocks(self, block_hashes: tuple[bytes, ...], timeout_s: float) -> BlockExport:
        """Rank 0 of a holder: the leading blocks of the chain it has, copied between two steps
        on every rank; each rank's shard as an ObjectRef (rank 0's put in the object store now,
        rank r's the result of its `take_export`), so that the puller's rank r fetches rank r's."""
        export = await asyncio.wrap_future(self.engine.call(lambda e: e.export_blocks(block_hashes)))
        if export.num_blocks:
            rest = [p.take_export.remote(export.export_id, timeout_s) for p in self._peers]
            export.shards = [ray.put(export.shards[0]), *rest]
        return export

    async def take_export(self, export_id: bytes, timeout_s: float) -> list:
        """Rank r > 0 of a holder: its shard of an export (waiting for rank 0's message)."""
        shard = await asyncio.to_thread(self.worker.stash.take, export_id, timeout_s)
        if shard is None:
            raise TimeoutError(f"rank {self._description.get('rank')}: no KV shard for export {export_id.hex()}")
        return shard

    async def stage(self, import_id: bytes, shard_ref: list) -> None:
        """Rank r > 0 of a puller: fetch rank r's shard from the holder's rank r (the object
        store moves it, across nodes if need be), kept for rank 0's IMPORT message."""
        self.worker.stash.put(import_id, await shard_ref[0])

    async def pull(self, holder_rank0, block_hashes: tuple[bytes, ...], timeout_s: float) -> int:
        """Rank 0 of a puller: the holder's leading blocks of the chain into this group's host
        tier (every rank its own shard); returns how many were written. Raises when the holder
        is gone, has another format, or a shard does not come within `timeout_s`."""
        export = await holder_rank0.export_blocks.remote(block_hashes, timeout_s)
        if not export.num_blocks:
            return 0
        self._kv_format.check_compatible(export.format)  # (before a byte is copied)
        import_id = uuid.uuid4().bytes
        staged = [p.stage.remote(import_id, [ref]) for p, ref in zip(self._peers, export.shards[1:], strict=True)]
        shard = await export.shards[0]
        await asyncio.gather(*staged)
        return await asyncio.wrap_future(self.engine.call(lambda e: e.import_blocks(export, shard, import_id)))

    async def stage_disk(self, import_id: bytes, group: str, block_hashes: tuple[bytes, ...]) -> int:
        """Rank r > 0 of a puller: read rank r's files that `group`'s disk tier left on this
        node, kept for rank 0's IMPORT message; returns how many leading blocks were whole."""
        shard = await asyncio.to_thread(self.worker.worker.sibling_shard, group, block_hashes)
        self.worker.stash.put(import_id, shard)
        return shard[0].shape[0] if shard else 0

    async def pull_disk(self, group: str, block_hashes: tuple[bytes, ...]) -> int:
        """Rank 0 of a puller: the leading blocks of the chain that every rank found whole in
        `group`'s disk directory of this node, into this group's host tier; returns how many
        were written."""
        import_id = uuid.uuid4().bytes
        staged = [p.stage_disk.remote(import_id, group, block_hashes) for p in self._peers]
        shard = await asyncio.to_thread(self.executor.sibling_shard, group, block_hashes)
        n = min([shard[0].shape[0] if shard else 0, *await asyncio.gather(*staged)])
        if not n:
            return 0
        return await asyncio.wrap_future(
            self.engine.call(lambda e: e.import_from_disk(group, block_hashes[:n], shard, import_id))
        )

    async def shutdown(self) -> None:
        self._closing = True
        if self._node_watch is not None:
            self._node_watch.stop()
        for box in self._subscribers.values():
            box.ready.set()  # ends the output streams
        # (the executor is torn down only when the engine thread ended, not stuck in a collective)
        if self.engine is not None and await asyncio.to_thread(self.engine.shutdown):
            self.executor.shutdown()
        if self._publisher is not None:
            self._publisher.close()  # the group's blocks leave the index at once

    def _tick(self, engine) -> None:
        """Rank 0's engine thread, after every step and while idle."""
        if self._publisher is not None:
            self._publisher.after_step()
        while not self._calls.empty():
            fn, done = self._calls.get()
            try:
                done.set_result(fn())
            except BaseException as e:  # (the caller gets it)
                done.set_exception(e)
        self.executor.keepalive()


class _Outbox:
    """One subscriber's outputs not yet streamed, and the event that wakes its stream."""

    def __init__(self) -> None:
        self.items: list = []
        self.ready = asyncio.Event()


@dataclass
class KVEvents:
    """One engine step's KV events, travelling in the output stream ahead of its outputs."""

    events: list


@dataclass
class RequestFailed:
    """A request's error, travelling in the output stream in place of its next output."""

    request_id: str
    error: BaseException


def end_process(reason: str) -> None:
    """End this rank's process now (any thread): it no longer serves its group, and nothing
    else will end it. No cleanup: its node or its registration is gone already."""
    log.error("rank %d ending its process: %s", os.getpid(), reason)
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    os._exit(1)


def describe_error(e: BaseException) -> str:
    """An error as one line for the group's status: its type and message (a task's own error
    for a failed actor call, not Ray's wrapper with the remote traceback)."""
    cause = getattr(e, "cause", None)
    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(cause, BaseException):
        e = cause
    return f"{type(e).__name__}: {e}"


__all__ = [
    "OWNER",
    "IndexTarget",
    "KVEvents",
    "RankActor",
    "RequestFailed",
    "bind_process",
    "describe_error",
]
