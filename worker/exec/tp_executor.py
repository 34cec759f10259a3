"""Rank 0's executor of a tensor-parallel group: each step goes to the other ranks, then runs here.

The step travels as one message on the group's step channel (worker/exec/distributed.py ByteChannel,
a TCP stream per other rank; worker/exec/step_codec.py: the step's flat arrays, running requests as
diffs), never as a remote call per step; then rank 0 runs its own shard, whose collectives meet the
other ranks' inside the forward pass. When the group is idle, a heartbeat (a message and a barrier) every `heartbeat_s` keeps the other ranks' receive
under the collective timeout and finds a dead or hung rank within `heartbeat_s + timeout`.
A collective that fails or times out raises `GroupFailedError`: the engine loop then stops and
fails its in-flight requests.
"""

from __future__ import annotations

import collections
import contextlib
import time

from worker.exec.distributed import ByteChannel, startup_barrier
from worker.exec.executor import DeviceWorker, Executor
from worker.exec.kv_transfer import encode_export, encode_import
from worker.exec.model_runner import Sampled
from worker.exec.step_codec import (
    FETCH,
    FETCH_START,
    HEARTBEAT,
    SHUTDOWN,
    encode_fetch_wait,
    encode_inventory,
    encode_moves,
    encode_step,
    probe_message,
)
from worker.model.parallel import Collectives
from worker.step import KVMoves, SchedulerOutput

TIMINGS_KEPT = 4096  # steps of control-overhead samples kept for the benchmark


class GroupFailedError(RuntimeError):
    """A rank of the group died or stopped answering (a collective failed or timed out)."""


class TPExecutor(Executor):
    """Runs the scheduler's steps on every rank of the group; this process is rank 0."""

    def __init__(
        self,
        config,
        comm: Collectives,
        channel: ByteChannel,
        heartbeat_s: float = 1.0,
    ) -> None:
        if comm.rank != 0:
            raise ValueError(f"TPExecutor runs on rank 0, not rank {comm.rank}")
        self.worker = DeviceWorker(config, comm)
        startup_barrier()
        self.model_config = self.worker.model_config
        self.layout = self.worker.layout
        self.channel = channel
        self.world_size = comm.world_size
        self.heartbeat_s = heartbeat_s
        self._last_sent = time.monotonic()
        self._closed = False
        self._reopened: list[bytes] = []  # the disk blocks every rank reopened
        # (scheduled requests, seconds from the scheduler's decision to this rank's forward call,
        # its parts: plan, encode, send, prepare)
        self.timings: collections.deque[tuple] = collections.deque(maxlen=TIMINGS_KEPT)

    def determine_num_blocks(self) -> int:
        local = self.worker.determine_num_blocks()
        return self._collective(self.channel.all_reduce_min, local)

    def init_pool(self, num_blocks: int) -> None:
        self.worker.init_pool(num_blocks)
        self._reopened = self._agree_on_disk()

    def _agree_on_disk(self) -> list[bytes]:
        """Rank 0's reopened disk blocks go to every rank (as each rank's `init_pool` ends),
        which marks those it holds too; the blocks all of them hold are the group's (each rank
        keeps only those files)."""
        if self.worker.disk_tier is None:
            return []
        hashes = self.worker.disk_tier.inventory
        self._collective(self.channel.send, encode_inventory(hashes))
        return self._collective(self.worker.disk_inventory, lambda mine: held_by_all(self.channel, hashes, mine))

    def execute(self, out: SchedulerOutput) -> Sampled:
        decided = time.perf_counter()
        runner = self.worker.runner
        step = runner.plan(out)  # planned once: sent as it is, and prepared here
        planned = time.perf_counter()
        message = encode_step(step, decided)
        encoded = time.perf_counter()
        if out.moves:  # the step's copies between tiers go first: every rank makes them first
            self._collective(self.channel.send, encode_moves(out.moves))
        self._collective(self.channel.send, message)
        sent = time.perf_counter()
        self.worker.move(out.moves)
        self._last_sent = time.monotonic()
        sampled = self._collective(runner.run, step, out)
        if step.num_seqs:  # up to the model's forward call, inputs ready (as on every rank)
            started = runner.forward_started
            parts = (planned - decided, encoded - planned, sent - encoded, started - sent)
            self.timings.append((step.num_seqs, started - decided, parts))
        return sampled

    def fetch(self, early: KVMoves, fetches: list[tuple[bytes, int]]) -> int:
        """Every rank reads the disk blocks into its host slots; the count all read whole."""
        self._collective(self.channel.send, encode_moves(early, fetches, kind=FETCH))
        self._last_sent = time.monotonic()
        return self._collective(self.worker.fetch, early, fetches, self.channel.all_reduce_min)

    def fetch_start(self, early: KVMoves, fetches: list[tuple[bytes, int]]) -> None:
        """Every rank makes the disk writes, then queues the reads to its reader thread: the
        message goes ahead of the next step's, so every rank starts the same reads in order."""
        self._collective(self.channel.send, encode_moves(early, fetches, kind=FETCH_START))
        self._last_sent = time.monotonic()
        self._collective(self.worker.fetch_start, early, fetches)

    def fetch_ready(self) -> int:
        """Rank 0's own count of fetches read (the others read the same blocks alongside)."""
        return self.worker.fetch_ready()

    def fetch_wait(self, n: int) -> list[int]:
        """Every rank waits for its oldest `n` fetches and agrees on each one's count (the
        smallest over the ranks), before rank 0 lets a request use the blocks."""
        self._collective(self.channel.send, encode_fetch_wait(n))
        self._last_sent = time.monotonic()
        return self._collective(self.worker.fetch_wait, n, self.channel.all_reduce_min)

    def export_blocks(self, export_id: bytes, sources: list[tuple[int, int]]) -> list:
        """Every rank copies its shard of the blocks now (the others keep theirs for a peer)."""
        self._collective(self.channel.send, encode_export(export_id, sources))
        self._last_sent = time.monotonic()
        return [self.worker.export_rows(sources), *[None] * (self.world_size - 1)]

    def import_blocks(self, import_id: bytes, early: KVMoves, rows: list[tuple[int, int]], shard) -> bool:
        """Every rank writes its pulled shard's rows; True when all of them could."""
        self._collective(self.channel.send, encode_import(import_id, early, rows))
        self._last_sent = time.monotonic()
        ok = self._collective(self.worker.import_rows, early, rows, shard)
        return bool(self._collective(self.channel.all_reduce_min, int(ok)))

    def sibling_shard(self, group: str, block_hashes) -> list:
        """Rank 0's own shard; each other rank reads its own (cluster/ray/rank_actor.py)."""
        return self.worker.sibling_shard(group, block_hashes)

    def flush_moves(self, moves: KVMoves) -> None:
        """Every rank makes the shutdown's copies (as a step's, sent ahead of no step)."""
        self._collective(self.channel.send, encode_moves(moves))
        self._last_sent = time.monotonic()
        self.worker.move(moves)

    def disk_inventory(self) -> list[bytes]:
        return self._reopened

    def keepalive(self) -> None:
        """Called while idle: a heartbeat round trip when nothing was sent for heartbeat_s."""
        if self._closed or time.monotonic() - self._last_sent < self.heartbeat_s:
            return
        self._collective(self.channel.send, HEARTBEAT)
        self._collective(self.channel.barrier)
        self._last_sent = time.monotonic()

    def probe_broadcast(self, rounds: int) -> float:
        """Seconds of one small broadcast on the step channel: `rounds` ping-pongs (rank 0 to
        all, then the last rank to all) halved, on the same transport as the steps."""
        self._collective(self.channel.send, probe_message(rounds))
        tiny = self.channel.probe_tensor()
        t0 = time.perf_counter()
        for _ in range(rounds):
            self.channel.broadcast(tiny, src=0)
            self.channel.broadcast(tiny, src=self.world_size - 1)
        self._last_sent = time.monotonic()
        return (time.perf_counter() - t0) / (2 * rounds)

    @property
    def pool_bytes(self) -> int:
        return self.worker.pool.total_bytes if self.worker.pool else 0

    def shutdown(self) -> None:
        """Tell the other ranks to leave their loops (best effort: they may be gone)."""
        if self._closed:
            return
        self._closed = True
        self.worker.close_reader()
        with contextlib.suppress(Exception):  # a dead rank cannot hear it; nothing else to do
            self.channel.send(SHUTDOWN)

    def _collective(self, fn, *args):
        try:
            return fn(*args)
        except RuntimeError as e:  # gloo / NCCL: peer closed the connection, or timed out
            self._closed = True
            raise GroupFailedError(
                f"a rank of the tensor-parallel group failed or stopped answering ({self.world_size} ranks): {e}"
            ) from e


def held_by_all(channel: ByteChannel, hashes: list[bytes], mine: list[bytes]) -> list[bytes]:
    """Of rank 0's `hashes`, those that every rank holds (`mine`: this rank's), in their order."""
    have = set(mine)
    held = channel.all_reduce_min_many([1 if h in have else 0 for h in hashes]) if hashes else []
    return [h for h, ok in zip(hashes, held, strict=True) if ok]
