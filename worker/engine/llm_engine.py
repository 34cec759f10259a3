"""The engine of one group on one device: requests in, a step at a time, outputs out."""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from worker.config import EngineConfig, cluster_secret, quota_blocks
from worker.engine.block_manager import BlockManager
from worker.engine.detokenizer import IncrementalDetokenizer, byte_table
from worker.engine.grammar import GrammarCompiler, RequestGrammar
from worker.engine.request import Request, RequestStatus
from worker.engine.scheduler import Scheduler
from worker.engine.tier_index import TierIndex
from worker.exec.disk_tier import disk_blocks
from worker.exec.executor import Executor, LocalExecutor
from worker.exec.host_tier import host_blocks
from worker.exec.kv_pool import check_pool_fits, kv_fingerprint
from worker.exec.kv_transfer import DEVICE_ROW, HOST_ROW
from worker.hashing import BlockHasher
from worker.kv_events import DISK, HOST, KVEvent
from worker.kv_transfer import BlockExport, KVFormat, KVTransferError
from worker.model.model_config import ModelConfig
from worker.model_source import is_gguf
from worker.outputs import RequestMetrics, RequestOutput, TokenLogprobs
from worker.protocol import ModelFacts, Pin, PinRefusedError, Resume
from worker.sampling_params import SamplingParams
from worker.step import SchedulerOutput
from worker.token_ids import token_list

KVEventsCallback = Callable[[list[KVEvent]], None]
COMPILE_WAIT_S = 0.01  # an engine with only compiling requests waits this long for one
# Documents' pins hold at most this share of the pool, and never the blocks one sequence of the
# whole context needs: the rest serves requests, so that pins can never starve the group (a
# pin over it is refused, PinRefusedError).
PINNED_SHARE = 0.5
# a clean shutdown writes the tiers' blocks down to the disk for this long at most (then stops
# between two batches: what was written is whole), well within AsyncEngine.shutdown's wait
FLUSH_WITHIN_S = 5.0

log = logging.getLogger(__name__)


@dataclass
class _Compiling:
    """A request waiting for its structured output's grammar, outside the scheduler (so
    that the batch, and the queue behind it, go on)."""

    request: Request
    tracked: _Tracked
    grammar: Future  # the compiled grammar (worker/engine/grammar.py)


@dataclass
class _Tracked:
    """Engine-side companions of a request: detokenizer, timings, logprobs, prompt text."""

    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    logprobs: list[TokenLogprobs] | None
    prompt: str | None
    cumulative_logprob: float = 0.0


@dataclass
class _Pinned:
    """A document's pinned blocks: the leading hashes `BlockManager.pin` held, and until when."""

    hashes: list[bytes]
    expires_at: float
    tier: str = "device"  # where they are held (Pin.tier)


class LLMEngine:
    """One tensor-parallel group of size 1: scheduler, block manager, KV pool, model."""

    def __init__(
        self,
        config: EngineConfig,
        on_kv_events: KVEventsCallback | None = None,
        executor: Executor | None = None,
    ) -> None:
        torch.manual_seed(config.seed)
        # one secret for the hashes and the disk tier's directory, even a random one
        config = replace(config, cluster_secret=cluster_secret(config.cluster_secret))
        self.config = config
        self.executor = executor or LocalExecutor(config)
        mc = self.model_config = self.executor.model_config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.tokenizer = load_tokenizer(config.model)
        if self.tokenizer is not None:  # (made now rather than for the first request)
            byte_table(self.tokenizer, skip_special_tokens=True)
        self.eos_token_ids = mc.eos_token_ids
        self.layout = self.executor.layout

        cache = config.cache
        num_blocks = self.executor.determine_num_blocks()
        check_pool_fits(num_blocks, self.layout, self.max_model_len)
        self.executor.init_pool(num_blocks)

        self.hasher = block_hasher(config, mc)
        self._events: list[KVEvent] = []
        self.on_kv_events = on_kv_events
        hasher = self.hasher if cache.enable_prefix_caching else None
        host_slots = host_blocks(cache, self.layout)  # (each rank's tier holds as many)
        block_bytes = self.layout.block_bytes
        host = None
        if host_slots and hasher is not None:
            host = TierIndex(host_slots, HOST, quota_blocks(cache.tenant_kv_host_quotas, host_slots, block_bytes))
        disk = None
        if host is not None and cache.kv_disk_bytes:
            disk_slots = disk_blocks(cache, self.layout)
            disk = TierIndex(disk_slots, DISK, quota_blocks(cache.tenant_kv_disk_quotas, disk_slots, block_bytes))
        quotas = quota_blocks(cache.tenant_kv_quotas, num_blocks, self.layout.block_bytes) or None
        loader = self.executor if disk is not None and cache.kv_disk_async else None
        bm = BlockManager(
            num_blocks, cache.block_size, hasher, self._events.append, host, disk, self.executor.fetch, quotas, loader
        )
        if disk is not None:  # what an earlier owner of the directory left, under the same names
            bm.adopt_disk(self.executor.disk_inventory())
        self.scheduler = Scheduler(
            replace(config.scheduler, max_model_len=self.max_model_len),
            bm,
            lookahead=1 if self.executor.runs_ahead else 0,
        )
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self.tokens_computed = 0  # tokens run through the model (prompt, recomputed and decoded)
        self.blocks_exported = 0  # blocks copied out for another group
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        self._compiling: dict[str, _Compiling] = {}
        self._failed: list[tuple[str, Exception]] = []  # refused after add_request returned
        self._pin_on_finish: dict[str, tuple[Pin, int]] = {}  # request id -> its pin, blocks
        self.pins: dict[str, _Pinned] = {}  # document id -> its pinned blocks
        self._shut = False  # (see `shutdown`)

    # ---- requests ----------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        block_hashes: Sequence[bytes] | None = None,
        arrival_time: float | None = None,
        resume: Resume | None = None,
        tenant: str = "",
        pin: Pin | None = None,
    ) -> str:
        """Queue a prompt (text, when the model has a tokenizer, or token ids); `resume`: the
        output it already had on a group that died (worker/protocol.py: Resume); `pin`: keep
        the prompt's full blocks pinned once it is prefilled (see `pin_blocks`)."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError(
                f"SamplingParams.n={params.n}: the engine runs one completion per request "
                f"(pagefleet.LLM adds one request per completion)"
            )
        text = prompt if isinstance(prompt, str) else None
        if text is not None:
            prompt = self.tokenize(text)
        token_ids = token_list(prompt, self.model_config.vocab_size)
        resumed = (
            ()
            if resume is None
            else tuple(token_list(resume.token_ids, self.model_config.vocab_size))
            if resume.token_ids
            else ()
        )
        # (the scheduler refuses what cannot fit the context: worker/engine/scheduler.py)
        max_tokens = params.max_tokens or self.max_model_len - len(token_ids)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(
            rid,
            token_ids,
            params,
            max_tokens=max_tokens,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            arrival_time=arrival_time,
            hash_root=self.hasher.root(None, cache_salt),
            block_hashes=block_hashes or (),
            tenant=tenant,
        )
        tracked = _Tracked(
            IncrementalDetokenizer(self.tokenizer, token_ids, params, params.skip_special_tokens),
            RequestMetrics(arrival_time=req.arrival_time),
            [] if params.logprobs is not None else None,
            text,
        )
        if resumed:  # as after a preemption: the output so far is recomputed with the prompt
            req.append_tokens(resumed)
            tracked.detok.resume(resumed, resume.text_sent)
            if tracked.logprobs is not None:
                tracked.logprobs.extend(resume.logprobs)
                tracked.cumulative_logprob = sum(lp.logprob for lp in resume.logprobs)
        if pin is not None:
            self._check_pin(pin, len(token_ids) // self.scheduler.bm.block_size)
        constraint = params.structured_outputs
        if constraint is None:
            self.scheduler.add_request(req)
            if pin is not None:
                self._pin_on_finish[rid] = (pin, len(token_ids) // self.scheduler.bm.block_size)
            self._tracked[rid] = tracked
            return rid
        if rid in self._compiling:
            raise ValueError(f"request_id {rid!r} is already in use")
        self.scheduler.check(req)
        grammar = self.grammars.compile(constraint)
        if grammar.done():  # cached: a bad constraint is refused here, a good one scheduled
            self._schedule_constrained(req, tracked, grammar)
        else:
            self._compiling[rid] = _Compiling(req, tracked, grammar)
        return rid

    def _schedule_constrained(self, req: Request, tracked: _Tracked, grammar: Future) -> None:
        """A request whose grammar is compiled into the scheduler, its matcher following the
        output it already has (a resume's); raises what the compiler or the scheduler refused."""
        req.grammar = RequestGrammar(grammar.result(), req.output_token_ids)
        self.scheduler.add_request(req)
        self._tracked[req.request_id] = tracked

    def _admit_compiled(self) -> None:
        """Requests whose grammars are ready join the scheduler; refused ones fail. With
        nothing else to run, wait a little for a grammar first (not a busy loop)."""
        if not self.scheduler.has_unfinished():
            wait([c.grammar for c in self._compiling.values()], COMPILE_WAIT_S, FIRST_COMPLETED)
        for rid, c in list(self._compiling.items()):
            if c.grammar.done():
                del self._compiling[rid]
                try:
                    self._schedule_constrained(c.request, c.tracked, c.grammar)
                except Exception as e:  # (ValueError: the constraint; QueueFullError)
                    self._failed.append((rid, e))

    # ---- pins --------------------------------------------------------------------------
    def _check_pin(self, pin: Pin, num_blocks: int) -> None:
        """PinRefusedError unless the pins, those to come included, stay within PINNED_SHARE
        of the pool once this one is held (a pin of a document held already replaces it)."""
        bm = self.scheduler.bm
        if bm.hasher is None:
            raise ValueError("documents need the prefix cache (enable_prefix_caching)")
        if pin.tier not in ("device", "host"):
            raise ValueError(f"a pin's tier is device or host, got {pin.tier!r}")
        pending = sum(n for p, n in self._pin_on_finish.values() if p.tier == pin.tier)
        old = self.pins.get(pin.document_id)
        replaced = len(old.hashes) if old is not None and old.tier == pin.tier else 0
        if pin.tier == "host":
            if bm.host is None:
                raise PinRefusedError("this group has no host tier (kv_host_bytes) to pin a document in")
            held = bm.num_host_pinned_blocks + pending + num_blocks - replaced
            cap = int(bm.host.num_slots * PINNED_SHARE)
            if held > cap:
                raise PinRefusedError(
                    f"pinning {num_blocks} blocks in the host tier would hold {held} of its "
                    f"{bm.host.num_slots}; documents may pin at most {cap} there (half the tier)"
                )
            return
        held = bm.num_pinned_blocks + pending + num_blocks - replaced
        longest = -(-self.max_model_len // bm.block_size)  # (blocks of one whole context)
        cap = min(int(bm.num_blocks * PINNED_SHARE), bm.num_blocks - longest)
        if held > cap:
            raise PinRefusedError(
                f"pinning {num_blocks} blocks would hold {held} of the group's {bm.num_blocks}; "
                f"documents may pin at most {max(cap, 0)} (half the pool, less one whole context)"
            )

    def _pin_prefilled(self, req: Request) -> None:
        """A finished request's pin, if it carries one: its prompt's full blocks, cached now
        (freed in this very step: nothing was evicted since), pinned under the document."""
        entry = self._pin_on_finish.pop(req.request_id, None)
        if entry is None or req.status is RequestStatus.FINISHED_ABORTED:
            return
        pin, num_blocks = entry
        self.unpin(pin.document_id)  # (a document pinned again: its new pin replaces the old)
        hashes = req.block_hashes[:num_blocks]
        held = self.scheduler.bm.pin(hashes, pin.tier)
        self.pins[pin.document_id] = _Pinned(hashes[:held], pin.expires_at, pin.tier)

    def unpin(self, document_id: str) -> bool:
        """Release a document's blocks (evictable again, tail first); False if none is held."""
        pinned = self.pins.pop(document_id, None)
        if pinned is not None:
            self.scheduler.bm.unpin(pinned.hashes, pinned.tier)
        return pinned is not None

    def expire_pins(self, now: float | None = None) -> list[str]:
        """Unpin the documents whose time has passed; returns their ids."""
        if not self.pins:
            return []
        now = time.time() if now is None else now
        expired = [d for d, p in self.pins.items() if p.expires_at <= now]
        for d in expired:
            self.unpin(d)
        return expired

    def take_failures(self) -> list[tuple[str, Exception]]:
        """The requests refused since the last call (their constraint did not compile, or
        the queue filled while it did), with their errors; each is gone from the engine."""
        failed, self._failed = self._failed, []
        return failed

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text but the model directory has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def abort(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Stop the requests and free their blocks; returns each one's final output (what it
        generated, finish_reason "abort"). Unknown or finished ids are ignored."""
        outputs = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            c = self._compiling.pop(rid, None)
            if c is not None:  # never scheduled: nothing to free
                c.request.status = RequestStatus.FINISHED_ABORTED
                c.tracked.metrics.finished_time = time.monotonic()
                no_lps = None if c.tracked.logprobs is None else []
                outputs.append(_output(c.request, c.tracked, [], "", True, None, no_lps))
        for req in self.scheduler.abort(request_ids):
            self._pin_on_finish.pop(req.request_id, None)
            tracked = self._tracked.pop(req.request_id, None)
            if tracked is None:
                continue
            delta = tracked.detok.flush()
            tracked.metrics.finished_time = time.monotonic()
            no_lps = None if tracked.logprobs is None else []
            outputs.append(_output(req, tracked, [], delta, True, None, no_lps))
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._compiling) or bool(self._failed)

    # ---- one step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample; returns the requests that progressed
        (those refused meanwhile: `take_failures`)."""
        if self._compiling:
            self._admit_compiled()
        out = self.scheduler.schedule()
        self.flush_events()
        now = time.monotonic()
        tracked = self._tracked
        for s in out.admitted:  # (or back from preemption: scheduled before if so)
            m = tracked[s.request.request_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        self.tokens_computed += out.num_batched_tokens
        sampled = self.executor.execute(out)
        now = time.monotonic()  # when this step's tokens were sampled
        append, running = self.scheduler.append_token, RequestStatus.RUNNING
        outputs = []
        for s in out.scheduled:  # one walk: append (stop conditions), detokenize, output
            req = s.request
            entry = sampled.get(req.request_id)
            if entry is not None and req.status is running:  # (sampled, not aborted meanwhile)
                token, lp = entry  # (a grammar took it already: the runner that sampled it)
                finished = append(req, token)
                outputs.append(self._progress(req, tracked[req.request_id], token, lp, finished, now))
        self.flush_events()
        return outputs

    def _progress(
        self,
        req: Request,
        tracked: _Tracked,
        token: int,
        lp: TokenLogprobs | None,
        finished: bool,
        now: float,
    ) -> RequestOutput:
        """A sampled token's output: metrics, logprobs, text (a stop string ends it here)."""
        m = tracked.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.token_times.append(now)
        lps = tracked.logprobs
        if lps is not None:
            lps.append(lp)
            tracked.cumulative_logprob += lp.logprob
        detok = tracked.detok
        delta = detok.step_one(token)
        if detok.stop_matched is not None and not finished:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            req.stop_reason = detok.stop_matched
            finished = True
        if finished:
            delta += detok.flush()
            m.finished_time = now
            del self._tracked[req.request_id]
            if self._pin_on_finish:
                self._pin_prefilled(req)
            self.flush_events()
        return _output(req, tracked, [token], delta, finished, now, None if lps is None else [lp])

    def flush_events(self) -> None:
        """Hand the KV events so far to `on_kv_events` (each step does; an idle engine's
        loop too, so that what it reopened at start-up reaches the index before any request)."""
        if self._events:
            batch, self._events[:] = list(self._events), []
            if self.on_kv_events is not None:
                self.on_kv_events(batch)

    # ---- shutdown ----------------------------------------------------------------------
    def shutdown(self, within_s: float = FLUSH_WITHIN_S) -> dict[str, int]:
        """End the engine: with a disk tier, first write down what a restart would otherwise
        lose, the host tier's blocks and the device's cached full blocks that no tier below
        holds (BlockManager.flush_moves), batch by batch on every rank, for `within_s` at
        most; then release the executor. Returns (and logs) the blocks written from each, and
        the batches made.
        A second call does nothing; a kill flushes nothing (the disk keeps what it had)."""
        if self._shut:
            return {}
        self._shut = True
        kept = {"host": 0, "device": 0, "batches": 0}
        bm = self.scheduler.bm
        if bm.disk is not None:
            try:  # (the reads in flight end first: their slots are the host's again)
                bm.drain_loads()
            except Exception as e:
                log.warning("KV tiers: the disk reads in flight at shutdown failed: %s", e)
            t0 = time.monotonic()
            cut, device_phase = False, False
            for moves in bm.flush_moves():
                if time.monotonic() - t0 > within_s:
                    cut = True
                    break
                try:
                    self.executor.flush_moves(moves)
                except Exception as e:  # (a rank gone, say): the disk keeps what was written
                    log.warning("KV tiers: writing the tiers to the disk at shutdown failed: %s", e)
                    break
                kept["batches"] += 1
                device_phase = device_phase or bool(moves.saves)  # (its demotes: the saved blocks)
                kept["device" if device_phase else "host"] += len(moves.demotes)
            self.flush_events()
            log.warning(
                "KV tiers: wrote %d host and %d device blocks to the disk tier at shutdown in %.2f s%s",
                kept["host"],
                kept["device"],
                time.monotonic() - t0,
                f" (stopped at the {within_s:g} s bound)" if cut else "",
            )
        self.executor.shutdown()
        return kept

    # ---- KV blocks moved between groups (worker/kv_transfer.py) --------------------------
    def kv_format(self) -> KVFormat:
        """What a group must share with this one to exchange KV blocks."""
        worker = self.executor.worker  # rank 0's device (every rank has its shape)
        return KVFormat(
            self.hasher.fingerprint,
            getattr(self.executor, "world_size", 1),
            worker.kv_row_shapes(),
            worker.kv_tensor_scales(),
        )

    def export_blocks(self, block_hashes: Sequence[bytes]) -> BlockExport:
        """The leading blocks of the chain held here (device or host), copied now, between two
        steps: rank 0's shard, the other ranks' kept for a peer under the export's id."""
        held = self.scheduler.bm.held_chain(block_hashes)
        export_id = uuid.uuid4().bytes
        sources = [(DEVICE_ROW if on_device else HOST_ROW, x) for on_device, x in held]
        shards = self.executor.export_blocks(export_id, sources) if held else []
        self.blocks_exported += len(held)
        return BlockExport(self.kv_format(), tuple(block_hashes[: len(held)]), shards, export_id)

    def import_blocks(self, export: BlockExport, shard=None, import_id: bytes = b"") -> int:
        """Another group's blocks into this group's host tier, where the next request's prefix
        lookup finds them (a host hit, restored with its step); returns how many were written.
        `shard`: rank 0's (default: the export's own); every other rank's is kept under
        `import_id`. KVTransferError for another format or no host tier."""
        self.kv_format().check_compatible(export.format)
        bm = self.scheduler.bm
        if bm.host is None:
            raise KVTransferError("this group has no host tier to import KV blocks into (kv_host_bytes)")
        rows, early = bm.host_slots_for(export.block_hashes)
        pairs = [(i, slot) for i, _, slot in rows]
        shard = export.shards[0] if shard is None and export.shards else shard
        ok = self.executor.import_blocks(import_id, early, pairs, shard) if rows or early else True
        bm.imported(rows, ok)
        self.flush_events()
        return len(rows) if ok else 0

    def import_from_disk(self, group: str, block_hashes: Sequence[bytes], shard=None, import_id: bytes = b"") -> int:
        """The leading blocks of the chain that the disk tier of `group` (another group of this
        node, gone: a shared --kv-disk-dir, its own subdirectory) left whole, into this group's
        host tier as a pull's blocks go (`import_blocks`); returns how many were written, 0
        when there are none or this group has no disk tier. A block's file is named by its
        hash, which means the same K/V here under the cluster's secret and the model's
        fingerprint (the directory's digest). `shard`: rank 0's, when the caller read every
        rank's (the chain then cut to its blocks); each other rank's kept under `import_id`."""
        shard = self.executor.sibling_shard(group, block_hashes) if shard is None else shard
        n = shard[0].shape[0] if shard else 0
        if not n:
            return 0
        export = BlockExport(self.kv_format(), tuple(block_hashes[:n]), [shard])
        return self.import_blocks(export, shard, import_id)

    # ---- introspection -----------------------------------------------------------------
    def cached_hashes(self) -> list[bytes]:
        """Every block hash in the prefix cache on the device."""
        return list(self.scheduler.bm.cached_hashes())

    def tier_hashes(self) -> dict[str, list[bytes]]:
        """Every block hash of every tier, by medium: the group's inventory, which a publisher
        republishes whole when an index lost it."""
        return self.scheduler.bm.tier_hashes()

    def facts(self) -> ModelFacts:
        """This engine's model as a router of another process needs it."""
        return ModelFacts(
            fingerprint=self.hasher.fingerprint,
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=tuple(self.eos_token_ids),
            tokenizer_files=ModelFacts.tokenizer_files_of(self.tokenizer),
        )

    def stats(self) -> dict:
        bm, sched = self.scheduler.bm, self.scheduler
        return {
            "blocks_total": bm.num_blocks,
            "blocks_free": bm.num_free_blocks,
            "blocks_cached": bm.num_cached_blocks,
            "blocks_used": bm.num_blocks - bm.num_free_blocks,
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "preemptions": sched.num_preemptions,
            "running": sched.num_running,
            "waiting": sched.num_waiting + len(self._compiling),
            "loading": sched.num_loading,  # waiting for their prefix's blocks from the disk tier
            "pending_prefill_tokens": sched.pending_prefill_tokens(),
            "tokens_computed": self.tokens_computed,
            "block_size": bm.block_size,
            "kv_bytes_per_token": self.layout.bytes_per_token,
            "kv_pool_bytes": self.executor.pool_bytes,
            "kv_host_blocks_total": bm.host.num_slots if bm.host is not None else 0,
            "kv_host_blocks_cached": len(bm.host) if bm.host is not None else 0,
            "kv_host_hits": bm.host_hits,  # prompt tokens restored from the host tier
            "kv_host_saves": bm.host_saves,  # blocks written back to the host tier
            "kv_host_blocks_held": bm.host.num_held if bm.host is not None else 0,  # by reads in flight
            "kv_loads_in_flight": bm.loads_in_flight,  # disk reads started, not yet completed
            "kv_disk_blocks_total": bm.disk.num_slots if bm.disk is not None else 0,
            "kv_disk_blocks_cached": len(bm.disk) if bm.disk is not None else 0,
            "kv_disk_hits": bm.disk_hits,  # prompt tokens fetched from the disk tier
            "kv_disk_failures": bm.disk_failures,  # reads that failed (misses, never KV)
            "kv_blocks_imported": bm.blocks_imported,  # pulled from another group (host tier)
            "kv_blocks_exported": self.blocks_exported,  # copied out for another group
            **self._tier_bytes(),
            "blocks_pinned": bm.num_pinned_blocks,
            "blocks_pinned_host": bm.num_host_pinned_blocks,
            "pinned": {d: len(p.hashes) for d, p in self.pins.items()},  # document -> blocks
            # tenant -> tokens processed over its weight (worker/engine/fair_queue.py); empty
            # while one tenant sends
            "tenant_tokens": dict(sched.waiting.served),
            # with KV quotas: tenant -> its cached blocks on the device, its unreferenced ones
            # (what its quota counts), and the cached blocks its requests evicted and it lost
            "tenant_kv_blocks": bm.tenant_cached_blocks(),
            "tenant_kv_idle_blocks": bm.tenant_idle_blocks(),
            "tenant_kv_evictions_caused": dict(bm.evictions_caused),
            "tenant_kv_evictions_suffered": dict(bm.evictions_suffered),
            **_tier_tenants(bm.host, bm.disk),
            "kv_block_bytes": self.layout.block_bytes,
        }

    def _tier_bytes(self) -> dict:
        """Bytes rank 0 moved between its pool and the tiers under it, each way, and how long
        its restores took."""
        worker = getattr(self.executor, "worker", None)
        host = getattr(worker, "host_tier", None)
        disk = getattr(worker, "disk_tier", None)
        times = getattr(worker, "load_times", {})
        return {
            # restores' latencies (worker/exec/load_times.py): host -> device, disk -> host
            **{f"kv_{tier}_load_seconds": t.as_dict() for tier, t in times.items()},
            "kv_host_bytes_saved": host.bytes_saved if host else 0,
            "kv_host_bytes_loaded": host.bytes_loaded if host else 0,
            "kv_disk_bytes_written": disk.bytes_written if disk else 0,
            "kv_disk_bytes_read": disk.bytes_read if disk else 0,
            # blocks rank 0 could not write (a full or failing disk: they are misses when asked)
            "kv_disk_write_failures": disk.failed_writes if disk else 0,
        }


def _output(
    req: Request,
    tracked: _Tracked,
    new_token_ids: list[int],
    delta: str,
    finished: bool,
    token_time: float | None,
    new_logprobs: list[TokenLogprobs] | None,
) -> RequestOutput:
    """The request's output after a step (or an abort): everything so far and this delta.
    `token_ids` is the request's own output list, as `logprobs` and `metrics` are its own: they
    grow as the engine runs on, and a consumer that reads later takes the `new_*` fields.
    Made once per request per step: one object, its arguments positional."""
    lps = tracked.logprobs
    return RequestOutput(
        req.request_id,
        req.prompt_token_ids,
        None,
        finished,
        req.num_cached_tokens if req.num_cached_tokens > 0 else 0,
        tracked.metrics,
        new_token_ids,
        delta,
        new_logprobs,
        token_time,
        tracked.prompt,
        (
            tracked.detok.text,
            req.output_token_ids,
            None if lps is None else tracked.cumulative_logprob,
            lps,
            req.finish_reason if finished else None,
            req.stop_reason,
        ),
        req.cached_tiers,
    )


def block_hasher(config: EngineConfig, mc: ModelConfig) -> BlockHasher:
    """The keyed hasher of this model and cache layout. The engine and the router both build
    theirs here, so that they name every block alike."""
    return BlockHasher(cluster_secret(config.cluster_secret), kv_fingerprint(config, mc))


def load_tokenizer(model_dir: str):
    """The model's tokenizer (a directory's files or a GGUF file's metadata), or None when it
    has none (token-id prompts only)."""
    if is_gguf(model_dir):
        from worker.model.gguf_loader import gguf_tokenizer

        return gguf_tokenizer(model_dir)
    path = Path(model_dir)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


__all__ = ["EngineConfig", "LLMEngine", "SchedulerOutput"]


def _tier_tenants(*tiers: TierIndex | None) -> dict[str, dict[str, int]]:
    """For each tier with KV quotas (`tenant_kv_host_blocks`, `tenant_kv_disk_...`): tenant ->
    its blocks in the tier, the tier's blocks its requests evicted, and its blocks evicted."""
    out: dict[str, dict[str, int]] = {}
    for tier in tiers:
        if tier is not None and tier.quotas is not None:
            out[f"tenant_kv_{tier.medium}_blocks"] = tier.tenant_blocks()
            out[f"tenant_kv_{tier.medium}_evictions_caused"] = dict(tier.evictions_caused)
            out[f"tenant_kv_{tier.medium}_evictions_suffered"] = dict(tier.evictions_suffered)
    return out
