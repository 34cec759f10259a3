"""Simulated worker groups: the real scheduler and block manager, a cost model for the forward.

A `SimGroup` runs exactly what a group's engine runs on the CPU side
(worker/engine/scheduler.py and worker/engine/block_manager.py, with the router's block hashes),
publishes the block manager's real KV events to a prefix index, and replaces the forward pass
by a `CostModel`: seconds per step, per prefill token and per decoding sequence, calibrated from
the real engine (benchmarks/routing.py --calibrate). A `Simulation` advances simulated time from event to event
(arrivals and step ends), so 64 groups and 100k requests take minutes, not days.

Simulated groups live in simulated time: they have no asyncio stream (`generate` refuses); the
driver places each arrival itself (e.g. with `Router.place`) and hands it to `SimGroup.submit`.
A placement may name a pull (`Placed`): the group copies the leading blocks another group holds
into its host tier first, as the real import does (worker/engine/llm_engine.py `import_blocks`),
over a link that costs the cost model's `pull_seconds`; the request waits for the copy, and a
pull past its timeout, from a dead group or onto a group without a host tier brings nothing
(the request recomputes). A cold pull (`wait`) first waits for the holder to commit the prefix,
reading its inventory every `PullRules.poll_s`, as the router's wait-and-pull reads the index.
Given a `SimClock`, liveness and pending placements run in simulated time too: the publishers
and an `InMemoryPrefixIndex(clock=clock)` read the clock, which the simulation sets to each
event's time, so heartbeats and pending TTLs mean the same as in a real cluster. Without one
(e.g. over Redis, whose TTLs run on its own clock) they run on the wall clock.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from cluster.cost_model import CostModel
from cluster.group import GroupHandle, GroupStatus
from cluster.index import IndexPublisher, IndexWriter
from worker.config import SchedulerConfig
from worker.engine.block_manager import BlockManager
from worker.engine.request import Request
from worker.engine.scheduler import Scheduler
from worker.engine.tier_index import TierIndex
from worker.hashing import BlockHasher
from worker.kv_events import DEVICE, DISK, HOST, BlockStored
from worker.sampling_params import SamplingParams
from worker.step import SchedulerOutput

_SAMPLED_TOKEN = 0  # what every simulated decode "samples"; no EOS, so max_tokens ends requests


class SimClock:
    """Simulated seconds, set by the `Simulation` to the time of the event it is handling."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class SimRecord:
    """What happened to one simulated request (simulated seconds)."""

    request_id: str
    group_id: str
    arrival_s: float
    prompt_tokens: int
    cached_tokens: int = -1  # prompt tokens served from the prefix cache at admission
    first_token_s: float | None = None
    finished_s: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


@dataclass(frozen=True)
class SimGroupConfig:
    """The simulated group's pool, scheduler limits and cost model."""

    num_blocks: int
    block_size: int = 16
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cost: CostModel = field(default_factory=CostModel)
    host_blocks: int = 0  # a host tier under the pool (restores cost cost.load_block_s each)
    disk_blocks: int = 0  # a disk tier under the host's (reads cost cost.fetch_block_s each)
    # tenant -> its KV quota in blocks (worker/engine/block_manager.py); None: the global LRU
    kv_quotas: dict[str, int] | None = field(default=None, hash=False)
    same_node: bool = True  # pulls between these groups take the cost model's link within a node

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")


class SimGroup(GroupHandle):
    """One group in simulated time: real scheduling and caching, modelled step durations."""

    tells_changes = True

    def __init__(
        self,
        group_id: str,
        config: SimGroupConfig,
        hasher: BlockHasher,
        index: IndexWriter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock` drives the publisher's heartbeats: a `SimClock` for simulated liveness."""
        if hasher.block_size != config.block_size:
            raise ValueError("the hasher's block size differs from config.block_size")
        self.group_id = group_id
        self.config = config
        self.hasher = hasher
        self.publisher: IndexPublisher | None = None
        host = TierIndex(config.host_blocks, HOST) if config.host_blocks else None
        disk = TierIndex(config.disk_blocks, DISK) if config.disk_blocks and host is not None else None
        self._fetched = 0  # disk blocks read since the last step began (into its time)
        bm = BlockManager(
            config.num_blocks, config.block_size, hasher, self._on_event, host, disk, self._fetch, config.kv_quotas
        )
        self.scheduler = Scheduler(config.scheduler, bm)
        if index is not None:
            self.publisher = IndexPublisher(index, group_id, bm.tier_hashes, clock=clock)
        self.records: dict[str, SimRecord] = {}
        self.started: list[SimRecord] = []  # first tokens since the simulation last took them
        self.busy_until: float | None = None  # end of the step in flight; None when idle
        self._step: SchedulerOutput | None = None
        self._dirty = False  # KV events queued since the last flush
        # blocks the step in flight computes: cached (committed at scheduling) but not yet
        # written, so no pull can copy them before the step ends
        self._computing: set[bytes] = set()
        self.prefill_tokens = 0  # prompt tokens computed (not served from the cache)
        self.pulls = 0  # pulls that brought blocks into this group's host tier
        self.pulled_blocks = 0  # the blocks they brought
        self.pull_failures = 0  # pulls that brought nothing (no host tier, timeout, dead holder)
        self.pull_s = 0.0  # simulated seconds its requests waited on links
        self.busy_s = 0.0  # simulated seconds spent in steps
        self.alive = True
        # status() only changes when a request is queued or a step starts or ends; a router
        # asks every group for it at every arrival, and the scheduler's count is O(requests).
        self._status: GroupStatus | None = None

    # ---- the driver's side -------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        now: float,
        block_hashes: Sequence[bytes] = (),
        cache_salt: str | None = None,
        tenant: str = "",
        arrival_s: float | None = None,
    ) -> None:
        """Queue a request at simulated time `now` (`tenant`: whose fair share it counts
        against; `arrival_s`: when it reached the router, if earlier, e.g. before a pull)."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        req = Request(
            request_id,
            prompt,
            params,
            max_tokens=max_tokens,
            arrival_time=now,
            hash_root=self.hasher.root(None, cache_salt),
            block_hashes=block_hashes,
            tenant=tenant,
        )
        self.scheduler.add_request(req)
        self._stale()
        arrived = now if arrival_s is None else arrival_s
        self.records[request_id] = SimRecord(request_id, self.group_id, arrived, len(prompt))

    def start_step(self, now: float) -> float | None:
        """Schedule the next step at `now`; returns when it ends, or None with nothing to run."""
        if self.busy_until is not None or not self.scheduler.has_unfinished():
            return None
        self._computing.clear()
        out = self.scheduler.schedule()
        if out.is_empty:
            return None
        decodes = sum(1 for s in out.scheduled if s.num_tokens == 1 and not s.is_new)
        prefill = out.num_batched_tokens - decodes
        self.prefill_tokens += prefill
        for s in out.scheduled:
            rec = self.records[s.request.request_id]
            if rec.cached_tokens < 0 and s.request.num_cached_tokens >= 0:
                rec.cached_tokens = s.request.num_cached_tokens
        self._step = out
        self._stale()
        loads = len(out.moves.loads) if out.moves else 0
        seconds = self.config.cost.step_seconds(prefill, decodes, loads, self._fetched)
        self._fetched = 0
        self.busy_s += seconds
        self.busy_until = now + seconds
        return self.busy_until

    def end_step(self) -> list[SimRecord]:
        """Finish the step in flight at `busy_until`; returns the requests that finished."""
        now, out = self.busy_until, self._step
        assert now is not None and out is not None, "no step in flight"
        sampled = {s.request.request_id: _SAMPLED_TOKEN for s in out.scheduled if s.samples}
        for rid in sampled:
            rec = self.records[rid]
            if rec.first_token_s is None:
                rec.first_token_s = now
                self.started.append(rec)
        finished = self.scheduler.update_from_output(out, sampled)
        done = []
        for req in finished:
            rec = self.records.pop(req.request_id)
            rec.finished_s = now
            done.append(rec)
        self.busy_until, self._step = None, None
        self._computing.clear()
        self._stale()
        return done

    # ---- pulls ---------------------------------------------------------------------------
    def held(self, block_hashes: Sequence[bytes], computing: bool = False) -> int:
        """Leading blocks of the chain this group holds (device or host): what a pull can copy
        now, or (`computing`) once the step in flight has written the blocks it computes."""
        if not self.alive:
            return 0
        bm, n = self.scheduler.bm, 0
        for h, _ in zip(block_hashes, bm.held_chain(block_hashes), strict=False):
            if not computing and h in self._computing and (bm.host is None or h not in bm.host):
                break
            n += 1
        return n

    def start_pull(self, holder: SimGroup, block_hashes: Sequence[bytes], now: float, timeout_s: float) -> SimPull:
        """Begin copying the leading blocks of the chain that `holder` holds into this group's
        host tier; the holder's device blocks among them are pinned until `finish_pull`. A pull
        that cannot bring anything (no host tier here, nothing held, a dead holder, itself) ends
        at once; one whose link takes longer than `timeout_s` ends then, bringing nothing. Blocks
        the holder's step in flight computes (committed, so indexed, but not yet written) are
        copied once that step ends, as a holder exports between its steps."""
        can = holder is not self and self.config.host_blocks
        held = holder.held(block_hashes) if can else 0
        seconds = 0.0
        if can and holder.busy_until is not None and holder.held(block_hashes, computing=True) > held:
            held = holder.held(block_hashes, computing=True)
            seconds = max(0.0, holder.busy_until - now)  # the copy waits for the step's end
        chain = tuple(block_hashes[:held])
        seconds += self.config.cost.pull_seconds(held, self.config.same_node)
        ok = held > 0 and seconds <= timeout_s
        pinned = ()
        if ok:
            bm = holder.scheduler.bm
            pinned = tuple(h for h in chain if h in bm.cached)
            for h in pinned:
                bm.pin([h])
        return SimPull(holder, chain if ok else (), pinned, now + (seconds if ok else min(seconds, timeout_s)))

    def finish_pull(self, pull: SimPull, now: float, started_s: float) -> int:
        """The copy of `pull` arrived: its blocks into this group's host tier (those not held
        here), published as host blocks; the holder's pins dropped. Returns the blocks written."""
        holder = pull.holder
        if pull.pinned and holder.alive:
            for h in pull.pinned:
                holder.scheduler.bm.unpin([h])
        self.pull_s += now - started_s
        written = 0
        if pull.block_hashes and holder.alive and self.alive:
            bm = self.scheduler.bm
            rows, _ = bm.host_slots_for(pull.block_hashes)
            bm.imported(rows, True)
            written = len(rows)
        self.pulls += written > 0
        self.pulled_blocks += written
        self.pull_failures += not pull.block_hashes or not holder.alive
        self._stale()
        return written

    def flush(self) -> None:
        """Publish queued KV events (the driver calls this before each placement)."""
        if self._dirty and self.publisher is not None:
            self.publisher.flush()
        self._dirty = False

    def tick(self) -> None:
        """Liveness on the publisher's clock: heartbeat (and load report) when due."""
        if self.publisher is not None:
            self.publisher.tick()

    def _fetch(self, early, fetches) -> int:
        """A simulated disk reads every block whole; the reads add to the next step's time."""
        self._fetched += len(fetches)
        return len(fetches)

    def _on_event(self, event) -> None:
        if self.busy_until is None and isinstance(event, BlockStored) and event.medium == DEVICE:
            self._computing.update(event.block_hashes)  # (while scheduling the next step)
        if self.publisher is not None:
            self.publisher.sink(event)
            self._dirty = True

    # ---- GroupHandle -------------------------------------------------------------------
    def generate(self, request):
        raise TypeError("a simulated group runs in simulated time; drive it with Simulation")

    def abort(self, request_id: str) -> None:
        self.scheduler.abort([request_id])
        self.records.pop(request_id, None)
        self._stale()

    def _stale(self) -> None:
        self._status = None
        self._status_changed()

    def status(self) -> GroupStatus:
        if self._status is None or self._status.alive != self.alive:
            self._status = self._make_status()
        return self._status

    def _make_status(self) -> GroupStatus:
        bm, sched = self.scheduler.bm, self.scheduler
        return GroupStatus(
            group_id=self.group_id,
            alive=self.alive,
            tensor_parallel_size=1,
            devices=("sim",),
            blocks_total=bm.num_blocks,
            blocks_free=bm.num_free_blocks,
            blocks_cached=bm.num_cached_blocks,
            running=sched.num_running,
            waiting=sched.num_waiting,
            pending_prefill_tokens=sched.pending_prefill_tokens(),
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            preemptions=sched.num_preemptions,
        )

    def shutdown(self) -> None:
        self.alive = False
        self._status_changed()
        if self.publisher is not None:
            self.publisher.close()


@dataclass(frozen=True)
class SimPull:
    """A copy of blocks on its way from `holder` (see `SimGroup.start_pull`)."""

    holder: SimGroup
    block_hashes: tuple[bytes, ...]  # the leading blocks it copies (none: it brings nothing)
    pinned: tuple[bytes, ...]  # the holder's device blocks held for the copy
    end_s: float  # when it arrives (or fails)


@dataclass(frozen=True)
class PullRules:
    """How the driver's router pulls (router/router.py: PULL_TIMEOUT_S, COLD_WAIT_S,
    COLD_POLL_S, and what committed lead is worth a cold pull), in simulated seconds."""

    timeout_s: float = 5.0
    wait_s: float = 30.0
    poll_s: float = 0.01
    pays: Callable[[int], bool] = lambda blocks: blocks > 0


class Placed(NamedTuple):
    """A placement with a pull to make first: `group` copies the leading `block_hashes` that
    `source` holds (`wait`: once `source` has committed them, a cold prefix it is computing);
    `pulled` hears how many blocks came just before the request is submitted."""

    group: SimGroup
    source: SimGroup | None = None
    block_hashes: Sequence[bytes] = ()
    wait: bool = False
    pulled: Callable[[int], None] | None = None


@dataclass
class _Pending:
    """Arrivals waiting on one pull (or one cold wait) onto `group`, submitted when it ends."""

    group: SimGroup
    source: SimGroup
    block_hashes: Sequence[bytes]
    started_s: float
    deadline_s: float = math.inf  # a cold wait gives up waiting for the commit then
    waiting: list[tuple[Arrival, list[bytes], Callable[[int], None] | None]] = field(default_factory=list)
    pull: SimPull | None = None  # the copy, once started
    key: tuple | None = None  # a cold wait's key, while others may join it
    lead: Sequence[bytes] = ()  # a cold wait's first prompt chain: what of it is committed is pulled


@dataclass(frozen=True)
class Arrival:
    """One request of a trace, as the simulation replays it."""

    request_id: str
    arrival_s: float
    prompt: Sequence[int]
    max_tokens: int
    cache_salt: str | None = None
    key: str | None = None  # e.g. the document, for a benchmark-only oracle
    block_hashes: Sequence[bytes] | None = None  # precomputed chain; None: hashed on arrival


# place(arrival, block_hashes) -> the group that takes it (and a pull to make first)
PlaceFn = Callable[[Arrival, list[bytes]], "SimGroup | Placed"]
# first_token(record): a request produced its first token (as a router's stream sees it)
FirstTokenFn = Callable[[SimRecord], None]


class Simulation:
    """Discrete-event replay of arrivals over simulated groups.

    Before each placement every group's queued KV events are published, so the index is exact
    as of the arrival (publishing costs no simulated time). Every `tick_every_s` each group
    heartbeats and reports its load: in simulated seconds when a `clock` is given (it is set to
    each event's time before the event is handled), else in wall seconds.
    """

    def __init__(
        self,
        groups: Sequence[SimGroup],
        hasher: BlockHasher,
        tick_every_s: float = 0.25,
        clock: SimClock | None = None,
        pulls: PullRules | None = None,
    ):
        self.groups = list(groups)
        self.pulls = pulls or PullRules()
        self._cold: dict[tuple, _Pending] = {}  # (group, last hash) -> its cold wait-and-pull
        self.hasher = hasher
        self.tick_every_s = tick_every_s
        self.clock = clock
        self.finished: list[SimRecord] = []
        self._heap: list[tuple[float, int, object]] = []
        self._seq = itertools.count()

    def run(
        self, arrivals: Iterable[Arrival], place: PlaceFn, first_token: FirstTokenFn | None = None
    ) -> list[SimRecord]:
        """Replay `arrivals` (in arrival order; read lazily) to the end; returns every finished
        record. `first_token` hears of each request's first token when its step ends."""
        pending = iter(arrivals)
        self._push_next(pending)
        clock = self.clock or time.monotonic
        last_tick = clock()
        while self._heap:
            now, _, item = heapq.heappop(self._heap)
            if self.clock is not None:
                self.clock.now = now
            # Ticks come before the event, so a group idle for a long simulated stretch has
            # beaten again before the router looks at it.
            if clock() - last_tick > self.tick_every_s:
                for g in self.groups:
                    g.tick()
                last_tick = clock()
            if isinstance(item, Arrival):
                self._arrive(now, item, place)
                self._push_next(pending)
            elif isinstance(item, _Pending):
                self._advance(item, now)
            else:
                self.finished += item.end_step()
                started, item.started = item.started, []
                for rec in started if first_token is not None else ():
                    first_token(rec)
                self._start(item, now)
        return self.finished

    def _push_next(self, pending: Iterator[Arrival]) -> None:
        a = next(pending, None)
        if a is not None:
            self._push(a.arrival_s, a)

    def _arrive(self, now: float, a: Arrival, place: PlaceFn) -> None:
        for g in self.groups:
            g.flush()
        hashes = a.block_hashes
        if hashes is None:
            hashes = self.hasher.hash_prompt(a.prompt, cache_salt=a.cache_salt)
        hashes = list(hashes)
        placed = place(a, hashes)
        if not isinstance(placed, Placed):
            placed = Placed(placed)
        if placed.source is None or not placed.block_hashes:
            self._submit(placed.group, a, hashes, placed.pulled, 0, now)
            return
        chain, key = placed.block_hashes, None
        if placed.wait:  # one wait and one pull per group and prefix, as the router shares them
            key = (placed.group.group_id, chain[-1])
            joined = self._cold.get(key)
            if joined is not None:
                joined.waiting.append((a, hashes, placed.pulled))
                return
        job = _Pending(placed.group, placed.source, chain, now, key=key, lead=hashes if placed.wait else ())
        job.waiting.append((a, hashes, placed.pulled))
        if placed.wait:
            job.deadline_s = now + self.pulls.wait_s
            self._cold[key] = job
            self._advance(job, now)
        else:
            self._begin_pull(job, chain, now)

    def _begin_pull(self, job: _Pending, chain: Sequence[bytes], now: float) -> None:
        job.pull = job.group.start_pull(job.source, chain, now, self.pulls.timeout_s)
        self._push(job.pull.end_s, job)

    def _advance(self, job: _Pending, now: float) -> None:
        """A pull's next event: its copy arrived (submit its requests), or a cold wait's poll
        (pull once the holder committed the prefix, or at the deadline what it committed)."""
        if job.pull is not None:
            pulled = job.group.finish_pull(job.pull, now, job.started_s)
            if job.key is not None:
                del self._cold[job.key]
            for a, hashes, heard in job.waiting:
                self._submit(job.group, a, hashes, heard, pulled, now)
            return
        lead = job.lead if len(job.lead) > len(job.block_hashes) else job.block_hashes  # (Router._wait_and_pull)
        committed = job.source.held(lead)
        if committed < len(job.block_hashes) and job.source.alive and now < job.deadline_s:
            self._push(now + self.pulls.poll_s, job)
        elif job.source.alive and self.pulls.pays(committed):
            self._begin_pull(job, lead[:committed], now)
        else:  # nothing worth pulling came: recompute
            job.pull = SimPull(job.source, (), (), now)
            self._advance(job, now)

    def _submit(self, group: SimGroup, a: Arrival, hashes, heard, pulled: int, now: float) -> None:
        if heard is not None:
            heard(pulled)
        group.submit(a.request_id, a.prompt, a.max_tokens, now, hashes, a.cache_salt, arrival_s=a.arrival_s)
        self._start(group, now)

    def _start(self, group: SimGroup, now: float) -> None:
        end = group.start_step(now)
        if end is not None:
            self._push(end, group)

    def _push(self, t: float, item: object) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), item))
