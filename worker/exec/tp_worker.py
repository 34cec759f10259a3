"""The loop of a tensor-parallel rank other than 0: receive a step, run its shard, repeat.

Such a rank owns no scheduler and no request: rank 0's messages (worker/exec/step_codec.py) carry
each step as flat arrays that its model runner prepares directly (its block tables kept from
step to step), and it runs the same forward pass without sampling, so its collectives meet
rank 0's. A heartbeat answers with a barrier; a shutdown message ends the loop; a
collective that fails or times out (rank 0 gone or hung) ends it with `GroupFailedError`.
"""

from __future__ import annotations

import collections
import time

import torch

from worker.exec.distributed import ByteChannel, startup_barrier
from worker.exec.executor import DeviceWorker
from worker.exec.kv_transfer import EXPORT, IMPORT, ShardStash, decode_export, decode_import
from worker.exec.step_codec import (
    FETCH,
    FETCH_START,
    FETCH_WAIT,
    HEARTBEAT,
    INVENTORY,
    MOVES,
    PROBE,
    SHUTDOWN,
    STEP,
    decode_fetch_wait,
    decode_inventory,
    decode_moves,
    decode_step,
    probe_rounds,
)
from worker.exec.tp_executor import TIMINGS_KEPT, GroupFailedError, held_by_all
from worker.model.parallel import Collectives


class TPWorker:
    """One rank > 0 of a group: its shard of the model and pool, driven by rank 0's steps."""

    def __init__(self, config, comm: Collectives, channel: ByteChannel) -> None:
        if comm.rank == 0:
            raise ValueError("rank 0 runs the engine (TPExecutor), not a TPWorker")
        self.worker = DeviceWorker(config, comm)
        startup_barrier()
        self.layout = self.worker.layout
        self.channel = channel
        self.world_size = comm.world_size
        self.steps = 0
        # (scheduled requests, seconds from rank 0's decision to this rank's forward call, its
        # parts: until the message is received, decode, prepare)
        self.timings: collections.deque[tuple] = collections.deque(maxlen=TIMINGS_KEPT)
        self._received = 0.0  # perf_counter when the latest message arrived
        self.stash = ShardStash()  # KV shards kept for another group's rank, or pulled from one

    def init_pool(self) -> int:
        """Agree with rank 0 on the group's block count (the smallest over ranks); allocate;
        then on the disk blocks every rank reopened (rank 0 sends its own)."""
        try:
            num_blocks = self.channel.all_reduce_min(self.worker.determine_num_blocks())
            self.worker.init_pool(num_blocks)
            if self.worker.disk_tier is not None:
                message = self.channel.recv()
                assert message[:1] == INVENTORY, "rank 0 sent no disk inventory"
                hashes = decode_inventory(message)
                self.worker.disk_inventory(lambda mine: held_by_all(self.channel, hashes, mine))
        except RuntimeError as e:
            raise GroupFailedError(f"rank {self._rank} could not agree on the pool: {e}") from e
        return num_blocks

    def run(self) -> int:
        """Serve steps until rank 0 says shutdown; returns the number of steps run."""
        handlers = {
            STEP: self._step,
            HEARTBEAT: self._heartbeat,
            PROBE: self._probe,
            MOVES: self._moves,
            FETCH: self._fetch,
            FETCH_START: self._fetch_start,
            FETCH_WAIT: self._fetch_wait,
            EXPORT: self._export,
            IMPORT: self._import,
        }
        with torch.inference_mode():  # held across steps: entering it costs before each forward
            return self._serve(handlers)

    def _serve(self, handlers: dict) -> int:
        while True:
            try:
                message = self.channel.recv()
                self._received = time.perf_counter()
                kind = message[:1]
                if kind == SHUTDOWN:
                    self.worker.close_reader()
                    return self.steps
                handlers[kind](message)
            except RuntimeError as e:  # gloo / NCCL: rank 0 gone, a peer gone, or a timeout
                raise GroupFailedError(
                    f"rank {self._rank} of {self.world_size}: the tensor-parallel group failed "
                    f"or stopped answering after {self.steps} steps: {e}"
                ) from e

    def _step(self, message: bytes) -> None:
        step, decided = decode_step(message)
        decoded = time.perf_counter()
        runner = self.worker.runner
        runner.run(step)
        if step.num_seqs:  # up to the model's forward call, inputs ready (as on rank 0)
            started = runner.forward_started
            parts = (self._received - decided, decoded - self._received, started - decoded)
            self.timings.append((step.num_seqs, started - decided, parts))
        self.steps += 1

    def _moves(self, message: bytes) -> None:
        """The next step's copies between tiers, made before it runs (as on rank 0)."""
        self.worker.move(decode_moves(message)[0])

    def _fetch(self, message: bytes) -> None:
        """Disk blocks into host slots, then agree with every rank on how many were read."""
        self.worker.fetch(*decode_moves(message), agree=self.channel.all_reduce_min)

    def _fetch_start(self, message: bytes) -> None:
        """The disk writes now, then the reads queued to this rank's reader thread."""
        self.worker.fetch_start(*decode_moves(message))

    def _fetch_wait(self, message: bytes) -> None:
        """Wait for the oldest fetches rank 0 names and agree with every rank on their counts."""
        self.worker.fetch_wait(decode_fetch_wait(message), agree=self.channel.all_reduce_min)

    def _export(self, message: bytes) -> None:
        """Copy this rank's shard of the blocks another group pulls; kept for its rank r."""
        export_id, sources = decode_export(message)
        self.stash.put(export_id, self.worker.export_rows(sources))

    def _import(self, message: bytes) -> None:
        """Write the shard pulled for the import (kept here before rank 0 sent the message)
        into the host slots, then agree with every rank on whether all could."""
        import_id, early, rows = decode_import(message)
        ok = self.worker.import_rows(early, rows, self.stash.take(import_id))
        self.channel.all_reduce_min(int(ok))

    def _heartbeat(self, message: bytes) -> None:
        self.channel.barrier()

    def _probe(self, message: bytes) -> None:
        tiny = self.channel.probe_tensor()
        for _ in range(probe_rounds(message)):
            self.channel.broadcast(tiny, src=0)
            self.channel.broadcast(tiny, src=self.world_size - 1)

    @property
    def _rank(self) -> int:
        return self.channel.rank
