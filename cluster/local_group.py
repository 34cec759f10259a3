"""A worker group whose TP=1 engine runs on a thread of this process: the embedded default of
`pagefleet serve`, and the tests' group."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Sequence

from cluster.group import GroupHandle, GroupStatus, for_group, status_from_stats
from cluster.index import GroupPublisher, IndexWriter
from worker.config import EngineConfig
from worker.engine.async_engine import AsyncEngine
from worker.engine.llm_engine import LLMEngine
from worker.outputs import RequestOutput
from worker.protocol import GenerationRequest

log = logging.getLogger(__name__)
_group_ids = itertools.count()


class LocalGroup(GroupHandle):
    """A TP=1 group whose engine runs on a thread of this process."""

    def __init__(
        self,
        config: EngineConfig,
        index: IndexWriter | Sequence[IndexWriter] | None = None,
        group_id: str | None = None,
    ) -> None:
        """`index`: where the group publishes its KV events and load (one index or several;
        None: nowhere)."""
        if group_id is not None:  # (a disk tier of its own under an id a restart keeps)
            config = for_group(config, group_id)
        self.group_id = group_id or f"group-{next(_group_ids)}"
        self.config = config
        engine = LLMEngine(config)
        self.hasher = engine.hasher  # (fixed for the engine's life: read here, not through it)
        self.tokenizer = engine.tokenizer
        self.publisher = None
        if index is not None:
            self.publisher = GroupPublisher(index, self.group_id, engine.tier_hashes)
            engine.on_kv_events = self.publisher.collect
        self.engine = AsyncEngine(engine, on_step=self._tick)
        self.draining = False

    def _tick(self, engine: LLMEngine) -> None:
        if self.publisher is not None:
            self.publisher.after_step()

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(request)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def unpin(self, document_id: str) -> None:
        self.engine.unpin(document_id)

    async def pull_from(self, holder: GroupHandle, block_hashes: Sequence[bytes], timeout_s: float) -> int:
        """From another group of this process: the holder's engine copies the blocks out
        between two of its steps, this one's writes them into its host tier between two of its
        own (worker/kv_transfer.py); the tensors pass directly."""
        if not isinstance(holder, LocalGroup) or holder is self:
            return 0
        hashes = tuple(block_hashes)
        try:
            async with asyncio.timeout(timeout_s):
                export = await asyncio.wrap_future(holder.engine.call(lambda e: e.export_blocks(hashes)))
                if not export.num_blocks:
                    return 0
                return await asyncio.wrap_future(self.engine.call(lambda e: e.import_blocks(export)))
        except Exception as e:  # (TimeoutError, a dead engine, another format): recompute instead
            log.warning(
                "group %s: pulling %d blocks from %s failed (%s)", self.group_id, len(hashes), holder.group_id, e
            )
            return 0

    async def pull_from_disk(self, group_id: str, block_hashes: Sequence[bytes], timeout_s: float) -> int:
        """Read the files that `group_id`'s disk tier left on a thread of its own, then, between
        two of this engine's steps, write them into the host tier (LLMEngine.import_from_disk).
        The reads (a file and its checksum a block) stay off the step loop, so the group's
        other streams keep their pace while a dead group's stream is being resumed here."""
        hashes = tuple(block_hashes)
        executor = self.engine.engine.executor
        try:
            async with asyncio.timeout(timeout_s):
                shard = await asyncio.to_thread(executor.sibling_shard, group_id, hashes)
                if not shard or not shard[0].shape[0]:
                    return 0
                return await asyncio.wrap_future(
                    self.engine.call(lambda e: e.import_from_disk(group_id, hashes, shard))
                )
        except Exception as e:  # (TimeoutError, a dead engine, another format): recompute instead
            log.warning(
                "group %s: reading %d blocks of %s's disk tier failed (%s)", self.group_id, len(hashes), group_id, e
            )
            return 0

    def set_draining(self, draining: bool = True) -> None:
        """Routers place no new request on a draining group; they move its streams to another
        group with their KV (router/router.py, DRAIN_CHECK_S), or those finish here."""
        self.draining = draining

    def status(self) -> GroupStatus:
        dead = self.engine.dead
        return status_from_stats(
            self.group_id,
            {**self.engine.stats(), "draining": self.draining},
            alive=dead is None,
            tp=1,
            devices=(self.config.device,),
            error=None if dead is None else f"{type(dead).__name__}: {dead}",
        )

    def shutdown(self) -> None:
        self.engine.shutdown()
        if self.publisher is not None:
            self.publisher.close()
