"""Executors run the scheduler's steps on the group's devices.

The engine talks to one `Executor`; a group of one device uses `LocalExecutor`, a
tensor-parallel group an executor that hands each step to every rank (see worker/tp_*.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kernels.registry import get_backend
from worker.exec.kv_calibration import calibrate_tensor_scales
from worker.exec.kv_pool import KVLayout, KVPool, layout_for, num_blocks_from_memory
from worker.exec.model_runner import ModelRunner, Sampled
from worker.exec.overlap import OverlapRunner, wants_overlap
from worker.model.model_config import ModelConfig
from worker.model.model_loader import load_model
from worker.model.parallel import Collectives, SingleRank
from worker.step import SchedulerOutput


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

    def execute(self, out: SchedulerOutput, sample: bool = True) -> Sampled:
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
            self.overlap = OverlapRunner(self.worker.runner)

    def execute(self, out: SchedulerOutput) -> Sampled:
        if self.overlap is not None:
            return self.overlap.execute(out)
        return self.worker.execute(out)

    def shutdown(self) -> None:
        if self.overlap is not None:
            self.overlap.close()

    @property
    def runs_ahead(self) -> bool:
        return self._wants_overlap

    @property
    def pool_bytes(self) -> int:
        return self.worker.pool.total_bytes if self.worker.pool else 0
