"""Executors run the scheduler's steps on the group's devices.

The engine talks to one `Executor`; a group of one device uses `LocalExecutor`, a
tensor-parallel group an executor that hands each step to every rank (see worker/tp_*.py).
"""

from __future__ import annotations

import collections
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import torch

from kernels.registry import get_backend
from worker.config import check_disk_group, cluster_secret
from worker.exec.disk_tier import DiskTier, disk_blocks, disk_directory
from worker.exec.host_tier import HostTier, host_blocks
from worker.exec.kv_calibration import calibrate_tensor_scales
from worker.exec.kv_pool import KVLayout, KVPool, kv_fingerprint, layout_for, num_blocks_from_memory
from worker.exec.kv_transfer import export_rows, import_rows
from worker.exec.load_times import LoadTimes
from worker.exec.model_runner import ModelRunner, Sampled
from worker.exec.overlap import OverlapRunner, wants_overlap
from worker.kv_events import DISK, HOST
from worker.model.model_config import ModelConfig
from worker.model.model_loader import load_model
from worker.model.parallel import Collectives, SingleRank
from worker.step import KVMoves, SchedulerOutput


class DeviceWorker:
    """One device of a group: its shard of the model, its paged KV pool, its runner."""

    def __init__(self, config, collectives: Collectives | None = None) -> None:
        self.config = config  # an EngineConfig
        self.device = torch.device(config.device)
        self.collectives = collectives or SingleRank()
        backend = get_backend(config.attention_backend, self.device)
        self.model, self.model_config = load_model(
            config.model, config.dtype, self.device, collectives, backend, config.weight_dtype
        )
        local_kv_heads = self.model.attention_layers()[0].num_kv_heads
        self.model_dtype = next(self.model.parameters()).dtype
        self.layout: KVLayout = layout_for(self.model_config, config.cache, local_kv_heads, self.model_dtype)
        self.runner = ModelRunner(self.model, config.cache.block_size, self.device)
        self.pool: KVPool | None = None
        self.host_tier: HostTier | None = None  # blocks under the pool, in host memory
        self.disk_tier: DiskTier | None = None  # and under the host tier, on disk
        self._sibling_directory = None  # (group, ...) -> that group's directory for this rank
        self.load_times = {HOST: LoadTimes(), DISK: LoadTimes()}  # restores' latencies, by tier
        self._reader: ThreadPoolExecutor | None = None  # the disk reads off the step's path
        self._reads: collections.deque[tuple[Future, list[tuple[bytes, int]]]] = collections.deque()

    def determine_num_blocks(self) -> int:
        """Blocks this device can hold under the configured budget."""
        probe = KVPool(self.layout, 1, self.device)  # one block: enough for the profile step
        probe.bind(self.model.attention_layers())
        tokens = self.config.scheduler.max_num_batched_tokens

        def profile() -> None:
            self.runner.profile_step(tokens, self.model_config.vocab_size)

        return num_blocks_from_memory(self.config.cache, self.layout, self.model, self.device, profile)

    def init_pool(self, num_blocks: int) -> None:
        """Allocate the pool; a float8 one gets its per-tensor scales first (every rank of a
        group calls this at the same point, so the calibration's collectives meet)."""
        self.pool = KVPool(self.layout, num_blocks, self.device)
        if self.layout.tensor_scales:
            mc = self.model_config
            scales = calibrate_tensor_scales(
                self.model,
                self.layout,
                self.model_dtype,
                mc.vocab_size,
                mc.max_position_embeddings,
                self.device,
                self.collectives,
            )
            self.pool.set_tensor_scales(*scales)
        self.pool.bind(self.model.attention_layers())
        cache = self.config.cache
        if slots := host_blocks(cache, self.layout):
            self.host_tier = HostTier(self.pool, slots)
            if cache.kv_disk_bytes:
                c = self.collectives
                fingerprint = kv_fingerprint(self.config, self.model_config).encode() + b"tp%d" % c.world_size
                key = cluster_secret(self.config.cluster_secret)
                directory = disk_directory(cache.kv_disk_dir, fingerprint, key, c.rank, cache.kv_disk_group)
                blocks = disk_blocks(cache, self.layout)
                self.disk_tier = DiskTier(directory, self.host_tier, blocks, cache.kv_disk_read_delay_s)
                if cache.kv_disk_group:  # the directory of another group of the node, by its id
                    self._sibling_directory = partial(disk_directory, cache.kv_disk_dir, fingerprint, key, c.rank)

    def sibling_shard(self, group: str, block_hashes: Sequence[bytes]) -> list[torch.Tensor]:
        """This rank's shard of the chain's leading blocks that the disk tier of `group`,
        another group of this node sharing its --kv-disk-dir, left whole in its directory
        (`DiskTier.read_shard`); [] when this rank has no disk tier in a group's own
        subdirectory, or `group` is this one."""
        if self.disk_tier is None or self._sibling_directory is None or group == self.config.cache.kv_disk_group:
            return []
        return self.disk_tier.read_shard(self._sibling_directory(check_disk_group(group)), block_hashes)

    def disk_inventory(self, agree=None) -> list[bytes]:
        """The blocks this rank's disk tier reopened (oldest first), with `agree` only those
        every rank holds, up to the tier's capacity; the rest of its files are removed."""
        if self.disk_tier is None:
            return []
        hashes = self.disk_tier.inventory
        return self.disk_tier.adopt(agree(hashes) if agree is not None else hashes)

    def move(self, moves: KVMoves | None) -> None:
        """A step's copies between the pool and the tiers under it, before its forward: the
        disk's (drops, then demotes), then the host's (saves, then loads)."""
        if not moves:
            return
        if moves.drops or moves.demotes:
            assert self.disk_tier is not None, "a step moved blocks to a disk tier this rank lacks"
            self.disk_tier.remove(moves.drops)
            for slot, block_hash in moves.demotes:
                self.disk_tier.write(slot, block_hash)
        if moves.saves or moves.loads:
            assert self.host_tier is not None, "a step moved blocks to a host tier this rank lacks"
            if not moves.loads:
                self.host_tier.apply(moves)
                return
            if moves.saves:  # (first: a block saved may be the one a load fills)
                self.host_tier.apply(KVMoves(saves=moves.saves))
            t0 = time.perf_counter()
            self.host_tier.apply(KVMoves(loads=moves.loads))
            self.load_times[HOST].observe(time.perf_counter() - t0)

    def fetch(self, early: KVMoves, fetches: list[tuple[bytes, int]], agree=None) -> int:
        """The disk writes in `early`, then the disk blocks (hash, host slot) read in order;
        returns how many were read whole (with `agree`, the smallest count over the ranks).
        The files after those are removed: their blocks are misses now."""
        self.move(early)
        assert self.disk_tier is not None, "a fetch from a disk tier this rank lacks"
        t0 = time.perf_counter()
        got = self.disk_tier.fetch(fetches)
        self.load_times[DISK].observe(time.perf_counter() - t0)
        if agree is not None:
            got = agree(got)
        self.disk_tier.remove([h for h, _ in fetches[got:]])
        return got

    # ---- fetches off the step's path: a reader thread per rank -------------------------------
    def fetch_start(self, early: KVMoves, fetches: list[tuple[bytes, int]]) -> None:
        """The disk writes in `early` now (the slots' victims, before the slots are written),
        then the disk blocks (hash, host slot) queued to this rank's reader thread, in order;
        every rank starts the same fetches in the same order (rank 0's, sent with the steps).
        The slots are the block manager's until `fetch_wait` says the reads are done."""
        self.move(early)
        assert self.disk_tier is not None, "a fetch from a disk tier this rank lacks"
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-reader")
        self._reads.append((self._reader.submit(self._read, fetches), fetches))

    def _read(self, fetches: list[tuple[bytes, int]]) -> int:
        t0 = time.perf_counter()
        got = self.disk_tier.fetch(fetches)
        self.load_times[DISK].observe(time.perf_counter() - t0)
        return got

    def fetch_ready(self) -> int:
        """How many of the fetches started (oldest first) this rank has read, without waiting."""
        n = 0
        for future, _ in self._reads:
            if not future.done():
                break
            n += 1
        return n

    def fetch_wait(self, n: int, agree=None) -> list[int]:
        """The oldest `n` fetches, waited for: for each, how many blocks were read whole in
        order (with `agree`, the smallest count over the ranks). The files after those are
        removed: their blocks are misses now."""
        counts = []
        for _ in range(n):
            future, fetches = self._reads.popleft()
            try:
                got = future.result()
            except Exception:  # (an I/O error the tier did not catch: every block a miss)
                got = 0
            if agree is not None:
                got = agree(got)
            self.disk_tier.remove([h for h, _ in fetches[got:]])
            counts.append(got)
        return counts

    def close_reader(self) -> None:
        """Wait for the reads in flight, then stop the reader thread."""
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None

    def export_rows(self, sources: list[tuple[int, int]]) -> list[torch.Tensor]:
        """This rank's shard of blocks another group pulls (worker/exec/kv_transfer.py)."""
        host = self.host_tier.host_tensors if self.host_tier is not None else None
        return export_rows(self.pool.block_tensors, host, sources)

    def import_rows(self, early: KVMoves, rows: list[tuple[int, int]], shard: list[torch.Tensor] | None) -> bool:
        """The disk writes in `early` (the slots' victims), then a pulled shard's rows (row,
        host slot) into the host tier; False when there is no shard of this tier's shape."""
        self.move(early)
        if self.host_tier is None or shard is None:
            return False
        return import_rows(self.host_tier.host_tensors, shard, rows)

    def kv_row_shapes(self) -> tuple[tuple[int, ...], ...]:
        """One block's shape in each of the pool's block tensors (bytes)."""
        return tuple(tuple(t.shape[1:]) for t in self.pool.block_tensors)

    def kv_tensor_scales(self) -> tuple[float, ...]:
        """A float8 pool's per-tensor scales, K then V of every layer; () otherwise."""
        if not self.layout.tensor_scales:
            return ()
        return tuple(float(t.item()) for t in (*self.pool.k_scales, *self.pool.v_scales))

    def execute(self, out: SchedulerOutput, sample: bool = True) -> Sampled:
        self.move(out.moves)
        return self.runner.execute(out, sample=sample)


class Executor(ABC):
    """What the engine needs from the devices of its group."""

    model_config: ModelConfig
    layout: KVLayout  # rank 0's pool layout (every rank holds the same share of KV heads)

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """The smallest block count over the group's devices."""

    @abstractmethod
    def init_pool(self, num_blocks: int) -> None:
        """Allocate every device's pool with the same number of blocks (shared block ids)."""

    @abstractmethod
    def execute(self, out: SchedulerOutput) -> Sampled:
        """Run one step on every device; returns rank 0's samples."""

    @property
    def pool_bytes(self) -> int:
        """Bytes of one device's pool."""
        return 0

    @property
    def runs_ahead(self) -> bool:
        """Whether a decode step's forward may start before the scheduler makes that step
        (worker/exec/overlap.py): the scheduler then allocates each decode's next block a step
        early, so that a position entering a new block does not stop it."""
        return False

    def shutdown(self) -> None:  # noqa: B027  (nothing to release by default)
        """Release the devices."""

    def flush_moves(self, moves: KVMoves) -> None:
        """A shutdown's copies between tiers, after the last step (BlockManager.flush_moves):
        every rank makes them, in the order of a step's."""
        raise NotImplementedError(f"{type(self).__name__} has no KV tiers")

    def disk_inventory(self) -> list[bytes]:
        """The blocks the group's disk tier reopened at start-up, oldest first: those every
        rank holds whole, up to its capacity (worker/exec/disk_tier.py); none without one."""
        return []

    def fetch(self, early: KVMoves, fetches: list[tuple[bytes, int]]) -> int:
        """Disk blocks into the host tier's slots on every rank (worker/exec/disk_tier.py):
        the disk writes in `early` first, then the reads; how many, in order, every rank read."""
        raise NotImplementedError(f"{type(self).__name__} has no disk tier")

    def fetch_start(self, early: KVMoves, fetches: list[tuple[bytes, int]]) -> None:
        """Start reading disk blocks into the host tier's slots on every rank, off the step's
        path (each rank's reader thread); the disk writes in `early` first, now."""
        raise NotImplementedError(f"{type(self).__name__} has no disk tier")

    def fetch_ready(self) -> int:
        """How many of the fetches started (oldest first) rank 0 has read, without waiting."""
        raise NotImplementedError(f"{type(self).__name__} has no disk tier")

    def fetch_wait(self, n: int) -> list[int]:
        """The oldest `n` fetches done on every rank: for each, the blocks every rank read
        whole, in order (rank 0 asks for those it has read, so that the others barely wait)."""
        raise NotImplementedError(f"{type(self).__name__} has no disk tier")

    def export_blocks(self, export_id: bytes, sources: list[tuple[int, int]]) -> list:
        """Every rank's shard of the blocks at `sources` (worker/exec/kv_transfer.py), copied
        now: rank 0's, and None for each rank that keeps its own under `export_id` for a peer."""
        raise NotImplementedError(f"{type(self).__name__} cannot export KV blocks")

    def import_blocks(self, import_id: bytes, early: KVMoves, rows: list[tuple[int, int]], shard) -> bool:
        """Pulled shards' rows (row, host slot) into every rank's host tier: rank 0's `shard`,
        each other rank's kept under `import_id`; the disk writes in `early` first. True when
        every rank wrote its rows."""
        raise NotImplementedError(f"{type(self).__name__} cannot import KV blocks")

    def sibling_shard(self, group: str, block_hashes: Sequence[bytes]) -> list:
        """Rank 0's shard of the chain's leading blocks left whole in the disk directory of
        `group`, another group of this node (`DeviceWorker.sibling_shard`); [] for none."""
        return []


class LocalExecutor(Executor):
    """A group of one device in this process."""

    def __init__(self, config) -> None:
        self.worker = DeviceWorker(config)
        self.model_config = self.worker.model_config
        self.layout = self.worker.layout
        self.overlap: OverlapRunner | None = None  # started with the pool (after profiling)
        self._wants_overlap = wants_overlap(config.scheduler.overlap, self.worker.device)

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def init_pool(self, num_blocks: int) -> None:
        self.worker.init_pool(num_blocks)
        if self._wants_overlap:
            self.overlap = OverlapRunner(self.worker.runner, self.worker.move)

    def execute(self, out: SchedulerOutput) -> Sampled:
        if self.overlap is not None:
            return self.overlap.execute(out)
        return self.worker.execute(out)

    def fetch(self, early: KVMoves, fetches: list[tuple[bytes, int]]) -> int:
        return self.worker.fetch(early, fetches)

    def fetch_start(self, early: KVMoves, fetches: list[tuple[bytes, int]]) -> None:
        self.worker.fetch_start(early, fetches)

    def fetch_ready(self) -> int:
        return self.worker.fetch_ready()

    def fetch_wait(self, n: int) -> list[int]:
        return self.worker.fetch_wait(n)

    def export_blocks(self, export_id: bytes, sources: list[tuple[int, int]]) -> list:
        return [self.worker.export_rows(sources)]

    def import_blocks(self, import_id: bytes, early: KVMoves, rows: list[tuple[int, int]], shard) -> bool:
        return self.worker.import_rows(early, rows, shard)

    def sibling_shard(self, group: str, block_hashes: Sequence[bytes]) -> list:
        return self.worker.sibling_shard(group, block_hashes)

    def disk_inventory(self) -> list[bytes]:
        return self.worker.disk_inventory()

    def flush_moves(self, moves: KVMoves) -> None:
        if self.overlap is not None:  # (no forward may run on: the last step has been)
            self.overlap.close()
            self.overlap = None
        self.worker.move(moves)

    def shutdown(self) -> None:
        if self.overlap is not None:
            self.overlap.close()
            self.overlap = None
        self.worker.close_reader()
        if self.worker.disk_tier is not None:
            self.worker.disk_tier.close()

    @property
    def runs_ahead(self) -> bool:
        return self._wants_overlap

    @property
    def pool_bytes(self) -> int:
        return self.worker.pool.total_bytes if self.worker.pool else 0
