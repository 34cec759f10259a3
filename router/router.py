"""The router: one front door over many worker groups.

For each request it tokenizes (applying the chat template for chat messages, exactly as the
engine would render them), computes the block hashes once with the same keyed function the
groups use, asks the placement policy for a group, records the choice as pending (in the
router's ledger at once, in the shared prefix index in the background), forwards the
request with its hashes, and streams the results back. A group that fails before the first
token is retried on another group. The ledger of recent placements is
router/placement/ledger.py. A group chosen for a prefix that another group holds pulls it
from there (`pull_source`); one chosen for a prefix that another group is computing waits for
that group's commit and pulls it, so a burst on a cold document computes it once
(`cold_source`, COLD_WAIT_S). A stream moves to another group with its KV (the new group pulls
it, DRAIN_CHECK_S) when its group drains and, with `move_for_load`, when another group would
finish it sooner (`load_move_target`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import time
from array import array
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from cluster.cost_model import CostModel
from cluster.group import GroupHandle, GroupStatus
from cluster.index import GroupMatch, IndexReader, PrefixIndexError, touched_ids
from router.documents import Documents
from router.hash_cache import PrefixHashCache
from router.placement import Ledger, Placement, Policy, make_policy
from router.placement.prefix_aware import delayed_requests
from worker.chat import check_messages, message_chars, render_chat
from worker.hashing import BlockHasher
from worker.outputs import CachedTiers, RequestMetrics, RequestOutput
from worker.protocol import (
    EngineDeadError,
    GenerationRequest,
    ModelFacts,
    QueueFullError,
    Resume,
)
from worker.sampling_params import SamplingParams
from worker.token_ids import CheckedIds, check_token_ids
from worker.tools import Tool

log = logging.getLogger(__name__)

STATUS_REFRESH_S = 1.0  # every group's status is read at least this often (see live_statuses)
MAX_RESUMES = 3  # a stream moves to another group at most this often
RESUME_WAIT_S = 30.0  # a stream to resume waits this long for a live group (a replacement)
MAX_RECORDS = 10_000  # route records kept (Router.records): those of the newest requests
# A group chosen for a prompt pulls the prefix from another live group that holds more of its
# leading blocks when the cost model says the pull is sooner than their recompute: the link's
# latency plus the blocks' bytes over its bandwidth (within a node or across nodes, calibrated by
# benchmarks/routing.py --calibrate) against their prefill (`pull_source`, `pull_pays`). No
# fixed floor: the latency is the pull's fixed cost (its Ray round trips and the two engines'
# steps it waits for), measured with the rest.
PULL_TIMEOUT_S = 5.0  # a pull not done by then is given up: the group recomputes the prefix
# A stream on a group that starts draining moves to another live group with its KV: the new
# group pulls the full committed blocks of the prompt and the tokens generated so far from the
# draining group (alive until its streams are gone), then resumes, recomputing only the tail
# (a failed pull recomputes it all, with the same tokens). Routers look at a streaming group's
# drain flag, and whether the stream should move for load, at most this often.
DRAIN_CHECK_S = 0.05
# A stream moves for load the same way (`Router.move_for_load`, `load_move_target`) when the cost
# model says its tokens left finish sooner on another live group, the pull and the tail's
# recompute included. The groups' requests (running and waiting) must differ by at least
# LOAD_MOVE_MARGIN: after the move its old group still has at least as many as its new one, so a
# move never reverses the imbalance it corrects and two groups never trade a stream back and forth.
LOAD_MOVE_MARGIN = 2
# Of a stream's MAX_RESUMES, moves for load leave this many: a group that dies or drains under the
# stream must still find it a resume (load is an optimisation, a failure is not).
RESUMES_KEPT = 1
# A cold prefix is computed once: a request placed on a group that lacks a prefix (by at least
# COLD_MIN_BLOCKS blocks) which another live group has pending and not committed (a burst of
# questions on a new document, spilled by the load bound while the first group computes it)
# waits for that group to commit the prefix and pulls it, rather than computing a second copy
# (`cold_source`) when the cost model says waiting is sooner: the holder's queued prefill (its
# pending work, the prefix among it) and the pull, against recomputing the prefix. The wait is
# bounded: after COLD_WAIT_S it pulls what is committed by then (if the pull pays) and the
# group recomputes the rest. Its requests for the same
# prefix share one wait and one pull (per router: two routers may each pull once). The bound
# is above a document's prefill on CPU (a 2,000-token document: ~0.5 s built-in, ~18 s the
# default model on two cores, benchmarks/RESULTS.md, "KV pull between groups"), which the
# holder started first: a live holder commits sooner than the waiter could recompute, a wait
# past the bound means it is stalled (a holder that dies, drains or leaves the router ends the
# wait at once: the request recomputes).
COLD_WAIT_S = 30.0
# A shorter cold prefix is recomputed: the wait's fixed costs (the holder's publish, polls, the
# pull's round trips between two engines' steps, ~50-100 ms in process) are then of the order of
# its prefill (built-in model, two in-process groups on two cores, benchmarks/RESULTS.md "A
# cold document's burst, computed once": TTFT p50 1.5x the recompute's at 256 tokens, 0.78x
# at 512, 0.63-0.71x at 2,000; the shared machine's noise is about +-30%).
COLD_MIN_BLOCKS = 32
# What a holder's step holds of the prefill queue, when the policy does not say (the engine's
# default max_num_batched_tokens).
DEFAULT_BATCH_TOKENS = 2048
COLD_POLL_S = 0.01  # how often a waiting pull reads the index for the holder's commit
COLD_KEEP_S = 1.0  # a finished shared pull answers later requests this long (until indexed)


class _ColdPull(NamedTuple):
    """One wait-and-pull of a cold prefix onto a group, shared by the requests that need it."""

    source: str  # the group computing the prefix
    blocks: int  # its leading blocks the pull waits for
    task: asyncio.Future[int]  # the blocks that came (0: recompute)


class _Departure(NamedTuple):
    """Why a stream leaves its group now (for the log), and for which group."""

    why: str  # "drains", "is loaded"
    to: str | None  # the group it moves to for load; None: any live group it has not tried


class NoGroupAvailableError(RuntimeError):
    """No live group can take the request (the server answers UNAVAILABLE)."""


class PromptTooLongError(ValueError):
    """A prompt that cannot fit the model's context (the server answers OUT_OF_RANGE)."""


@dataclass(frozen=True)
class ModelInfo:
    """What the front door tells clients about the served model."""

    model: str
    max_model_len: int
    block_size: int
    kv_cache_dtype: str
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, name: str, facts: ModelFacts) -> ModelInfo:
        return cls(
            model=name,
            max_model_len=facts.max_model_len,
            block_size=facts.fingerprint.block_size,
            kv_cache_dtype=facts.fingerprint.kv_cache_dtype,
            vocab_size=facts.vocab_size,
            eos_token_ids=facts.eos_token_ids,
        )


@dataclass
class RouteRequest:
    """A request at the front door: exactly one of prompt, prompt_token_ids or messages."""

    prompt: str | None = None
    prompt_token_ids: Sequence[int] | np.ndarray | None = None  # an array is checked in C
    messages: Sequence[dict] | None = None  # chat: [{"role": ..., "content": ...}, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None  # the tenant's salt: tenants never share blocks
    resume: Resume | None = None  # a stream continued from another router: what it delivered
    tenant: str = ""  # whose fair share of a group it counts against ("": the only one)


@dataclass(frozen=True)
class CheckedRequest:
    """A request checked once, at a door (router/door/serving.py: `checked_request`) or by
    `Router.check`: the router and the groups trust it. Below it only the checks that need a
    group's own state remain (worker/engine/: one completion per request, its queue and pool)."""

    ids: CheckedIds  # the prompt's ids, checked against the vocabulary
    params: SamplingParams  # validated when it was built
    request_id: str | None = None  # None: the router names it
    priority: int = 0
    cache_salt: str | None = None  # the tenant's salt: tenants never share blocks
    resume: Resume | None = None  # a stream continued from another router: what it delivered
    tenant: str = ""  # whose fair share of a group it counts against ("": the only one)


@dataclass
class RouteRecord:
    """What the router decided for one request, and what the engine then reported."""

    request_id: str
    group_id: str
    reason: str
    predicted_cached_tokens: int
    actual_cached_tokens: int | None = None
    decision_seconds: float = 0.0
    resumes: int = 0  # times the request moved to another group mid-stream
    pulled_from: str | None = None  # the group whose KV blocks the chosen group pulled first
    pulled_blocks: int = 0  # how many blocks came
    # the cached tokens by tier: as the placement predicted them, as the engine reported them
    predicted_tiers: CachedTiers = CachedTiers()
    actual_tiers: CachedTiers | None = None

    def moved(self, placement: Placement, predicted: CachedTiers, decided: float, resumes: int) -> None:
        """The request went to another group (a retry, a spill, a resume)."""
        self.group_id, self.reason = placement.group_id, placement.reason
        self.predicted_cached_tokens, self.predicted_tiers = predicted.total, predicted
        self.decision_seconds, self.resumes = decided, resumes
        self.actual_cached_tokens = self.actual_tiers = None


class _Stream:
    """What of one request reached its caller (its tokens, how much of their text, their
    logprobs, the first group's timings) and which groups it tried: what a resume needs."""

    def __init__(self, resume: Resume | None = None) -> None:
        """`resume`: what the stream had delivered through another router (counts as a
        resume)."""
        self.tokens: list[int] = list(resume.token_ids) if resume else []
        self.text_sent = resume.text_sent if resume else 0
        self.texts: list[str] = []  # the text passed through this router, piece by piece
        self.logprobs: list = list(resume.logprobs) if resume else []
        self.metrics: RequestMetrics | None = None  # the first group's: TTFT, queue time
        self.resumes = int(resume is not None)
        self.record: RouteRecord | None = None
        self.tried: set = set()  # group handles that failed or refused it
        self.full: set = set()  # of which refused it for a full queue
        # the group that died under it and its last status (its node), until the next group
        # has read what its disk tier left (`Router._read_dead`)
        self.dead: tuple[str, GroupStatus] | None = None

    def resume(self) -> Resume | None:
        if not self.tokens:
            return None
        return Resume(tuple(self.tokens), self.text_sent, tuple(self.logprobs))

    def passed(self, out: RequestOutput) -> RequestOutput:
        """`out`, counted as passed to the caller; after a resume, the last one with the whole
        output (a group that resumed it may hold only what it generated itself: the deltas
        before are the caller's, the whole output is read at the end) and each with the first
        group's timings (arrival, first token), the ones the caller saw."""
        self.tokens += out.new_token_ids
        self.text_sent += len(out.new_text)
        self.texts.append(out.new_text)
        self.logprobs += out.new_logprobs or ()
        if self.resumes and out.finished:
            c = out.outputs[0]
            asked = c.logprobs is not None
            whole = replace(
                c,
                token_ids=list(self.tokens),
                text="".join(self.texts),
                logprobs=list(self.logprobs) if asked else None,
                cumulative_logprob=sum(lp.logprob for lp in self.logprobs) if asked else None,
            )
            out = out.replace(outputs=[whole, *out.outputs[1:]])
        if self.metrics is None:
            self.metrics = out.metrics
        elif out.metrics is not self.metrics:
            first, m = self.metrics, out.metrics
            merged = RequestMetrics(
                arrival_time=first.arrival_time,
                first_scheduled_time=first.first_scheduled_time,
                first_token_time=first.first_token_time,
                finished_time=m.finished_time,
                token_times=m.token_times,
            )
            out = out.replace(metrics=merged)
        return out


class Router:
    """Places requests on groups by prefix and load; see the module docstring."""

    def __init__(
        self,
        groups: Sequence[GroupHandle],
        index: IndexReader,
        hasher: BlockHasher,
        model_info: ModelInfo,
        tokenizer=None,
        policy: Policy | str = "prefix_aware",
        max_attempts: int = 2,
    ) -> None:
        self.index = index
        self.hasher = hasher
        self.hash_cache = PrefixHashCache(hasher)  # a shared document is hashed once
        self.model_info = model_info
        self.tokenizer = tokenizer
        # Text beyond this many characters cannot fit the context, whatever its tokens: it is
        # refused before the tokenizer spends seconds on it.
        self.max_prompt_chars = None if tokenizer is None else max_prompt_chars(tokenizer, model_info.max_model_len)
        if isinstance(policy, str):
            policy = make_policy(policy, model_info.block_size)
        if policy.block_size != model_info.block_size:
            raise ValueError(
                f"the policy counts blocks of {policy.block_size} tokens; the model's are {model_info.block_size}"
            )
        self.policy = policy
        # a group's prefill tokens per step (the engine's budget, as the policy knows it): how
        # much of a holder's queue can be ahead of a prefix it has started
        self.batch_tokens: int = getattr(policy, "batch_tokens", DEFAULT_BATCH_TOKENS)
        # the calibrated costs a pull is weighed with: the policy's (prefix_aware's), else the defaults
        self.cost: CostModel = getattr(getattr(policy, "config", None), "cost", None) or CostModel()
        self.max_attempts = max_attempts
        # Recent decisions, for predicted vs actual and a stream's group: the newest
        # `max_records`, so that what a long-running router keeps per request is bounded.
        self.records: dict[str, RouteRecord] = {}
        self.max_records = MAX_RECORDS
        self._ids = itertools.count()
        self.ledger = Ledger(index, model_info.block_size, policy.placed_window())
        self._live: dict[str, GroupStatus] = {}
        self.absent_statuses: Callable[[], list[GroupStatus]] | None = None
        self.set_groups(groups)
        # (group, last hash of the prefix) -> the shared wait-and-pull of a cold prefix
        self._cold: dict[tuple[str, bytes], _ColdPull] = {}
        # (group, the chain's last hash) -> the pull of that chain onto that group in flight,
        # which a request placed there for the same prefix meanwhile joins (one copy, not two)
        self._pulls: dict[tuple[str, bytes], asyncio.Future[int]] = {}
        self.cold_wait_s = COLD_WAIT_S  # 0: a spilled cold prefix is recomputed (no wait)
        self.move_drained = True  # streams on a draining group move with their KV (DRAIN_CHECK_S)
        # streams move off a loaded group with their KV (`load_move_target`); off by default: it
        # did not pay on groups sharing one CPU (benchmarks/RESULTS.md, "Moves for load")
        self.move_for_load = False
        self.move_pull = True  # False: a moved stream recomputes its KV (a benchmark's peer)
        # a stream whose group died resumes from what its disk tier left on the node
        # (`_read_dead`); False: it recomputes that too (a benchmark's peer)
        self.read_dead_disk = True
        self.documents = Documents(self)  # documents pinned through this router (router/documents.py)

    def set_groups(self, groups: Sequence[GroupHandle]) -> None:
        """Route over these groups from now on (a router follows groups coming and going; call
        it on the router's event loop). Requests already on a group that left keep their
        streams: the group's handle ends them."""
        self.groups = {g.group_id: g for g in groups}
        # The live groups' latest statuses. Groups that can tell (`GroupHandle.watch`) queue
        # their id on a change and are read again only then; the others are read at every
        # decision, and all of them once a second all the same. Bounded: a full queue means
        # read them all.
        self._changed: deque[str] = deque(maxlen=64 * max(1, len(groups)))
        self._polled = [g for g in groups if not g.watch(self._changed.append)]
        self._live = {gid: s for gid, s in self._live.items() if gid in self.groups}
        self._read_all_at = -math.inf
        # the live statuses the streams' load checks read, and when (`_load_statuses`)
        self._loads: tuple[float, dict[str, GroupStatus]] = (-math.inf, {})

    # ---- input -------------------------------------------------------------------------
    def tokenize(self, request: RouteRequest) -> list[int]:
        """The prompt's token ids: given, tokenized text, or the rendered chat template."""
        ids = self.checked_prompt(request)[0]
        return ids if isinstance(ids, list) else ids.tolist()

    def check(self, request: RouteRequest) -> CheckedRequest:
        """An in-process caller's request, checked as a door checks one (its sampling
        parameters were checked when built)."""
        ids = self.checked_prompt(request)[1]
        r = request
        return CheckedRequest(ids, r.params, r.request_id, r.priority, r.cache_salt, r.resume, r.tenant)

    def checked_prompt(self, request: RouteRequest) -> tuple[list[int] | array, CheckedIds]:
        """The prompt's ids, checked, and as the uint32 array the hash cache reads; ids given as
        an array stay that array (see worker/token_ids.py)."""
        given = [x is not None for x in (request.prompt, request.prompt_token_ids, request.messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
        if request.prompt_token_ids is not None:
            return check_token_ids(request.prompt_token_ids, self.model_info.vocab_size)
        if request.messages is not None:
            check_message_count(len(request.messages), self.model_info.max_model_len)
        return self.tokenized(request.prompt, request.messages)

    def tokenized(
        self, prompt: str | None, messages: Sequence[dict] | None = None, tools: Sequence[Tool] | None = None
    ) -> tuple[list[int], CheckedIds]:
        """The ids of a text `prompt` or of chat `messages` (given one, and the messages
        counted: a door does both before it builds them), rendered with the model's chat
        template (with `tools`, worker/chat.py); the one tokenizing function of every door."""
        if self.tokenizer is None:
            raise ValueError("the model has no tokenizer: send prompt_token_ids")
        if messages is not None:
            messages = check_messages(messages)
        self.check_text_size(prompt, messages, tools)
        if messages is not None:
            ids = render_chat(self.tokenizer, messages, checked=True, tools=tools)
        else:
            ids = self.tokenizer.encode(prompt)
        return check_token_ids(ids, self.model_info.vocab_size)

    def check_text_size(
        self, prompt: str | None, messages: Sequence[dict] | None, tools: Sequence[Tool] | None = None
    ) -> None:
        """PromptTooLongError for text that cannot fit the context (see `max_prompt_chars`)."""
        limit, context = self.max_prompt_chars, self.model_info.max_model_len
        if messages is not None:
            chars = message_chars(messages) + sum(len(json.dumps(t.as_openai())) for t in tools or ())
        else:
            chars = len(prompt or "")
        if limit is not None and chars > limit:
            raise PromptTooLongError(
                f"the prompt's text is {chars} characters, more than the model's context of "
                f"{context} tokens can hold (at most {limit} characters)"
            )

    def render_chat(self, messages: Sequence[dict]) -> list[int]:
        """The chat template's prompt ids, as `pagefleet.LLM.chat` renders them."""
        return render_chat(self.tokenizer, messages)

    # ---- placement ---------------------------------------------------------------------
    def live_statuses(self, exclude: Collection[str] = ()) -> dict[str, GroupStatus]:
        """Live groups' statuses (but those in `exclude`), with the prefill this router just
        sent them counted."""
        changed, now = self._changed, time.monotonic()
        if len(changed) == changed.maxlen or now - self._read_all_at > STATUS_REFRESH_S:
            changed.clear()  # (before reading: what changes from now on is queued again)
            self._read_all_at, stale = now, self.groups.values()
        else:
            stale = self._polled
            while changed:
                g = self.groups.get(changed.popleft())
                if g is not None:  # (not a group that left)
                    self._read(g)
        for g in stale:
            self._read(g)
        out = self._live.copy()
        for gid in exclude:
            out.pop(gid, None)
        return self.ledger.with_in_flight(out)

    def _read(self, g: GroupHandle) -> None:
        s = g.status()
        if s.alive and not s.draining:
            self._live[g.group_id] = s
        else:
            self._live.pop(g.group_id, None)

    def place(self, block_hashes: Sequence[bytes], exclude: Collection[str] = ()) -> Placement:
        """Choose a group for a prompt's hash chain (one index round trip; the pending record
        reaches the shared index in the background, see router/placement/ledger.py)."""
        statuses = self.live_statuses(exclude)
        if not statuses:
            raise NoGroupAvailableError("no live worker group is available")
        matches = self.ledger.matches(block_hashes)
        placement = self.policy.choose(block_hashes, statuses, matches, self.ledger.placed)
        self.ledger.record(placement, block_hashes, len(statuses))
        placement = replace(placement, tier_lead=tier_lead(matches.get(placement.group_id)))
        placement = self.joined_pull(placement, block_hashes)
        bs = self.model_info.block_size
        if placement.pull_from is None:
            placement = pull_source(placement, matches, statuses, self.cost, bs, self.batch_tokens)
            if self.cold_wait_s > 0:  # or wait for more than is committed, if that is sooner
                placement = cold_source(placement, matches, statuses, self.cost, bs, self.batch_tokens)
        return placement

    def joined_pull(self, placement: Placement, block_hashes: Sequence[bytes]) -> Placement:
        """The placement with the shared pull of a cold prefix this router has going (or just
        finished) to its group for a prefix of this chain; unchanged when there is none."""
        gid = placement.group_id
        for (group_id, last), cold in self._cold.items():
            blocks = cold.blocks
            if group_id == gid and blocks <= len(block_hashes) and block_hashes[blocks - 1] == last:
                return replace(placement, pull_from=cold.source, pull_blocks=blocks, pull_wait=True)
        return placement

    # ---- one request -------------------------------------------------------------------
    async def generate(self, request: RouteRequest | CheckedRequest) -> AsyncIterator[RequestOutput]:
        """`stream`'s outputs, for a request checked here first unless it is checked."""
        checked = request if isinstance(request, CheckedRequest) else self.check(request)
        async with contextlib.aclosing(self.stream(checked)) as outputs:
            async for out, _ in outputs:
                yield out

    async def stream(self, request: CheckedRequest) -> AsyncIterator[tuple[RequestOutput, RouteRecord | None]]:
        """Hash once, place, forward, stream: each output with the request's record when its
        placement is new to the caller (the first output, and the first after a move), else
        None. A group that fails before the first token is retried elsewhere; one that dies
        mid-stream has the request resumed on another group (the prompt plus the tokens
        streamed so far: see worker/protocol.py, Resume), the stream going on with no token
        missing or repeated. A full queue tries the next group. Errors: NoGroupAvailableError,
        QueueFullError (every group's queue is full), EngineDeadError (no group to resume on)."""
        ids = request.ids  # trusted from here on
        rid = request.request_id or f"rt-{next(self._ids)}"
        hashes = self.hash_cache.hash_prompt(ids, cache_salt=request.cache_salt)
        state = _Stream(request.resume)  # what reached the caller, for a resume
        moved: tuple[Placement, int, float] | None = None  # where a moved stream goes, pulled
        while True:
            t0 = time.perf_counter()
            if moved is not None:
                (placement, pulled, decided), moved = moved, None
            else:
                placement = await self._place_for(hashes, state)
                decided = time.perf_counter() - t0
                pulled = 0
                if placement.pull_from is not None:
                    placement, pulled = await self._pull(placement, hashes)
                if state.dead is not None:  # a resume: what the dead group left on its node's disk
                    placement, read = await self._read_dead(placement, ids, hashes, request.cache_salt, state)
                    pulled += read
            predicted = placement.cached_tiers(len(ids), self.model_info.block_size)
            if state.record is None:  # one record per request, updated when it moves
                state.record = RouteRecord(
                    rid,
                    placement.group_id,
                    placement.reason,
                    predicted.total,
                    decision_seconds=decided,
                    resumes=state.resumes,
                    predicted_tiers=predicted,
                )
            else:
                state.record.moved(placement, predicted, decided, state.resumes)
            record = self.records[rid] = state.record
            record.pulled_from, record.pulled_blocks = placement.pull_from, pulled
            group = self.groups[placement.group_id]
            forwarded = GenerationRequest(
                ids,
                request.params,
                request_id=rid,
                priority=request.priority,
                cache_salt=request.cache_salt,
                block_hashes=hashes,
                resume=state.resume(),
                tenant=request.tenant,
            )
            hits = record.predicted_cached_tokens
            sent = len(ids) - hits
            self.ledger.add_in_flight(placement.group_id, sent, hits, 1)
            started, checked = False, time.monotonic()
            try:
                async with contextlib.aclosing(group.generate(forwarded)) as outs:
                    async for out in outs:
                        if not started:
                            started = True
                            self.ledger.add_in_flight(placement.group_id, -sent, -hits, -1)
                            self._arrived(rid)
                            if not state.resumes:
                                record.actual_cached_tokens = out.num_cached_tokens
                                record.actual_tiers = out.cached_tiers
                            yield state.passed(out), record
                        else:
                            yield state.passed(out), None
                        if out.finished or time.monotonic() - checked < DRAIN_CHECK_S:
                            continue
                        checked = time.monotonic()
                        leave = self._departure(group, len(ids), request.params, state)
                        if leave is not None:
                            moved = await self._move(group, ids, hashes, request.cache_salt, state, leave.to)
                            if moved is not None:  # (closing the stream aborts it on the old group)
                                break
                if moved is None:
                    return
                state.resumes += 1
                log.info(
                    "group %s %s: %s moved%s to %s after %d tokens, %d blocks pulled",
                    placement.group_id,
                    leave.why,
                    rid,
                    " for load" if leave.to else "",
                    moved[0].group_id,
                    len(state.tokens),
                    moved[1],
                )
            except QueueFullError:  # try the next-best group before refusing
                state.tried.add(group)
                state.full.add(group)
                log.info("group %s refused %s: its queue is full", placement.group_id, rid)
            except EngineDeadError as e:
                state.tried.add(group)
                if state.tokens:  # it streamed: go on elsewhere
                    if state.resumes >= MAX_RESUMES:
                        raise
                    state.resumes += 1
                    if self.read_dead_disk:
                        state.dead = (placement.group_id, group.status())
                    log.warning(
                        "group %s died after %d tokens of %s (%s); resuming it elsewhere",
                        placement.group_id,
                        len(state.tokens),
                        rid,
                        e,
                    )
                elif len(state.tried) >= self.max_attempts:
                    raise
                else:
                    log.warning(
                        "group %s failed before the first token of %s (%s); retrying elsewhere",
                        placement.group_id,
                        rid,
                        e,
                    )
            finally:
                if not started:
                    self.ledger.add_in_flight(placement.group_id, -sent, -hits, -1)
                if moved is None:  # (not moving on: whatever move it was in is over)
                    self.ledger.arrived(rid)
                self._trim_records()

    def _departure(
        self, group: GroupHandle, prompt_tokens: int, params: SamplingParams, state: _Stream
    ) -> _Departure | None:
        """Whether the stream on `group` leaves it now, and why: the group drains
        (`move_drained`), or another live group it has not tried would finish it sooner
        (`move_for_load`, `load_move_target`); None: it stays."""
        if self.move_drained and state.resumes < MAX_RESUMES and group.status().draining:
            return _Departure("drains", None)
        if not self.move_for_load:
            return None
        statuses = self._load_statuses()
        here = statuses.get(group.group_id)
        if here is None:  # (it left the router, died or drains)
            return None
        if state.tried:
            statuses = {gid: s for gid, s in statuses.items() if self.groups.get(gid) not in state.tried}
        known = prompt_tokens + len(state.tokens)
        limit = params.max_tokens or self.model_info.max_model_len - prompt_tokens
        to = load_move_target(
            here,
            statuses,
            self.ledger.moving_groups(),
            known,
            limit - len(state.tokens),
            state.resumes,
            self.cost,
            self.model_info.block_size,
            self.move_pull,
        )
        return None if to is None else _Departure("is loaded", to)

    def _load_statuses(self) -> dict[str, GroupStatus]:
        """The live statuses the load checks read: read at most once a DRAIN_CHECK_S for all of
        this router's streams, and again once a moved stream arrives (the moves in between are
        in the ledger, `Ledger.moving`)."""
        at, statuses = self._loads
        now = time.monotonic()
        if now - at >= DRAIN_CHECK_S:
            statuses = self.ledger.with_requests_in_flight(self.live_statuses())
            self._loads = (now, statuses)
        return statuses

    def _arrived(self, request_id: str) -> None:
        """The stream's first token from its group: a move that brought it there is over."""
        if request_id in self.ledger.moving:
            self.ledger.arrived(request_id)
            self._loads = (-math.inf, {})  # (its groups' statuses show it from now)

    async def _move(
        self,
        group: GroupHandle,
        ids: Sequence[int],
        hashes: Sequence[bytes],
        cache_salt: str | None,
        state: _Stream,
        to: str | None = None,
    ) -> tuple[Placement, int, float] | None:
        """Where a stream leaving `group` goes: the live group `to` (a move for load; `group`
        stays one it may go back to on a failure) or, with None (`group` drains), a placement
        among the live groups it has not tried. That group has pulled from `group` the full
        committed blocks of the prompt and the tokens generated so far (`move_pull`; a failed
        pull brings 0: the new group recomputes). Returns the placement, the pulled blocks and
        the decision's seconds; None when the group is not live (no other group, or `to` left):
        the stream goes on where it is. Called before the old stream is closed, so `group` still
        holds the blocks (a drain waits for its streams). The ledger counts the move until the
        stream's first token there (`Ledger.moving`)."""
        t0 = time.perf_counter()
        if to is None:
            state.tried.add(group)
        exclude = {gid for gid, g in self.groups.items() if g in state.tried or to not in (None, gid)}
        try:
            placement = self.place(hashes, exclude=exclude)
        except NoGroupAvailableError:
            state.tried.discard(group)
            return None
        decided = time.perf_counter() - t0
        placement = replace(placement, pull_from=None, pull_blocks=0, pull_wait=False)
        self.ledger.move(state.record.request_id, group.group_id, placement.group_id)
        chain = self._known_chain(ids, cache_salt, state)
        pulled = 0
        if self.move_pull and chain:
            pulled = await self.groups[placement.group_id].pull_from(group, chain, PULL_TIMEOUT_S)
        return with_pulled(placement, group.group_id, pulled, len(hashes)), pulled, decided

    def _known_chain(self, ids: Sequence[int], cache_salt: str | None, state: _Stream) -> list[bytes]:
        """The block hashes of what a stream knows that a group it moves or resumes on can take
        instead of recomputing: the full blocks of its prompt and the tokens generated so far,
        but for the last token. A prompt's last token is always computed (its logits give the
        next token), so its block is never taken from a cache; on a block boundary, pulling it
        would copy a block only to recompute it (and the block's last token may have no KV at
        the source yet)."""
        return self.hasher.hash_prompt((list(ids) + state.tokens)[:-1], cache_salt=cache_salt)

    async def _read_dead(
        self, placement: Placement, ids: Sequence[int], hashes: Sequence[bytes], cache_salt: str | None, state: _Stream
    ) -> tuple[Placement, int]:
        """A stream whose group died resumes on `placement`'s group: when that group is on the
        dead one's node, it reads the leading blocks of the prompt and the tokens generated so
        far that the dead group's disk tier left whole in its directory there (and it holds in
        no tier: `GroupHandle.pull_from_disk`), and recomputes only the rest; the placement
        then names them among its pulled blocks (with the dead group as their source, unless
        a live holder gave some). Elsewhere, or with nothing there: unchanged, 0."""
        (gone, status), state.dead = state.dead, None
        if not same_node(status, self.live_statuses().get(placement.group_id)):
            return placement, 0
        chain = self._known_chain(ids, cache_salt, state)
        pulled = await self.groups[placement.group_id].pull_from_disk(gone, chain, PULL_TIMEOUT_S) if chain else 0
        if pulled:
            log.info("group %s read %d blocks that %s left on its node's disk", placement.group_id, pulled, gone)
        return with_pulled(placement, gone, pulled, len(hashes)), pulled

    async def _pull(self, placement: Placement, hashes: Sequence[bytes]) -> tuple[Placement, int]:
        """Have the chosen group pull the prefix from `placement.pull_from` before the request
        goes there; the placement then predicts the pulled blocks as cached. A pull that
        fails brings nothing (the group recomputes): the placement without its source."""
        holder = self.groups.get(placement.pull_from)
        group = self.groups[placement.group_id]
        chain = hashes[: placement.pull_blocks]
        if holder is None:
            pulled = 0
        elif placement.pull_wait:
            pulled = await asyncio.shield(self._cold_pull(group, holder, chain, hashes))
        else:
            pulled = await asyncio.shield(self._shared_pull(group, holder, chain))
        if not pulled:
            return replace(placement, pull_from=None, pull_blocks=0, pull_wait=False), 0
        return replace(placement, cached_blocks=max(placement.cached_blocks, placement.pull_blocks)), pulled

    def _shared_pull(self, group: GroupHandle, holder: GroupHandle, chain: Sequence[bytes]) -> asyncio.Future[int]:
        """The pull of `chain` from `holder` onto `group`: a new one, or the one in flight (so
        that concurrent questions on one document copy it once); forgotten when it ends, as
        what it brought is then in the group's tiers, which placement reads."""
        key = (group.group_id, chain[-1])
        task = self._pulls.get(key)
        if task is None:
            task = self._pulls[key] = asyncio.ensure_future(group.pull_from(holder, chain, PULL_TIMEOUT_S))

            def forget(t: asyncio.Future[int]) -> None:
                if self._pulls.get(key) is t:
                    del self._pulls[key]
                if not t.cancelled():
                    t.exception()  # (retrieved: a failed pull recomputes, whoever awaited it)

            task.add_done_callback(forget)
        return task

    def _cold_pull(
        self, group: GroupHandle, holder: GroupHandle, chain: Sequence[bytes], lead: Sequence[bytes] = ()
    ) -> asyncio.Future[int]:
        """The one wait-and-pull of `chain` onto `group` (a new one, or the one going; `lead`:
        the prompt's chain, see `_wait_and_pull`)."""
        key = (group.group_id, chain[-1])
        cold = self._cold.get(key)
        if cold is None:
            cold = self._cold[key] = _ColdPull(
                holder.group_id, len(chain), asyncio.ensure_future(self._wait_and_pull(group, holder, chain, lead))
            )

            def forget(t: asyncio.Future[int]) -> None:
                def drop() -> None:
                    if self._cold.get(key) is cold:
                        del self._cold[key]

                brought = not t.cancelled() and t.exception() is None and t.result()
                asyncio.get_running_loop().call_later(COLD_KEEP_S if brought else 0, drop)

            cold.task.add_done_callback(forget)
        return cold.task

    async def _wait_and_pull(
        self, group: GroupHandle, holder: GroupHandle, chain: Sequence[bytes], lead: Sequence[bytes] = ()
    ) -> int:
        """Wait (up to `cold_wait_s`, COLD_WAIT_S) until `holder` has committed `chain`, then pull
        all it has committed of `lead` (the prompt's chain, of which `chain` is the start; none:
        `chain`): the pending record `chain` ends at is one of the index's probe positions,
        short of the document's end. What is committed by the deadline is pulled if the pull
        pays (`pull_pays`), else nothing (0). A holder that dies or drains meanwhile ends the
        wait at once: nothing (0)."""
        lead = lead if len(lead) > len(chain) else chain
        deadline, committed = time.monotonic() + self.cold_wait_s, 0
        while True:
            try:
                m = self.index.match(lead).get(holder.group_id)
            except PrefixIndexError as e:  # out of reach: recompute
                log.warning("waiting for %s to commit a prefix: index unavailable (%s)", holder.group_id, e)
                return 0
            committed = 0 if m is None else min(len(lead), m.blocks + m.host_blocks)
            if committed >= len(chain) or m is None or time.monotonic() >= deadline:
                break
            if holder.group_id not in self.live_statuses():  # it died or drains: no commit to come
                committed = 0
                break
            await asyncio.sleep(COLD_POLL_S)
        statuses = self.live_statuses()
        near = same_node(statuses.get(group.group_id), statuses.get(holder.group_id))
        if not pull_pays(committed, self.cost, self.model_info.block_size, near):
            log.info("group %s did not commit a prefix in %.1f s: recomputing it", holder.group_id, self.cold_wait_s)
            return 0
        return await group.pull_from(holder, lead[:committed], PULL_TIMEOUT_S)

    async def _place_for(self, hashes: Sequence[bytes], state: _Stream) -> Placement:
        """A placement among the groups this request has not tried (by handle: a group
        replaced under the same id is new). A stream to resume waits up to RESUME_WAIT_S for a
        live group (a replacement) rather than failing."""
        deadline = time.monotonic() + RESUME_WAIT_S
        while True:
            exclude = {gid for gid, g in self.groups.items() if g in state.tried}
            try:
                return self.place(hashes, exclude=exclude)
            except NoGroupAvailableError:
                if state.tried and state.tried <= state.full:
                    raise QueueFullError(f"every live group's queue is full ({len(state.tried)} tried)") from None
                if not state.tokens or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.2)

    def abort(self, request_id: str) -> None:
        record = self.records.get(request_id)
        group = None if record is None else self.groups.get(record.group_id)
        if group is not None:
            group.abort(request_id)

    def cluster_status(self) -> list[GroupStatus]:
        """Every group's status, with the declared groups that have no running generation
        (restarting, failed, retired) when something tells of them (`absent_statuses`)."""
        absent = self.absent_statuses() if self.absent_statuses is not None else []
        return [g.status() for g in self.groups.values()] + absent

    def _trim_records(self) -> None:
        # Oldest first, one at a time: once full, each request drops one record rather than
        # copying the table's keys (benchmarks/RESULTS.md, "Soak").
        records = self.records
        while len(records) > self.max_records:
            del records[next(iter(records))]


def node_of(status: GroupStatus | None) -> str:
    """The node a group runs on: what follows '@' in its first device (Ray groups name it, e.g.
    "cpu@<node id>"); "" when it does not say (a group of this process)."""
    if status is None or not status.devices:
        return ""
    return status.devices[0].rpartition("@")[2] if "@" in status.devices[0] else ""


def same_node(a: GroupStatus | None, b: GroupStatus | None) -> bool:
    """Whether a pull between the two groups stays on one node (both say nothing: one process)."""
    return node_of(a) == node_of(b)


def pull_pays(blocks: int, cost: CostModel, block_size: int, near: bool = True) -> bool:
    """Whether pulling `blocks` blocks is sooner than computing them (the cost model's link
    within a node if `near`, else across nodes)."""
    return blocks > 0 and cost.pull_seconds(blocks, near) < cost.recompute_seconds(blocks * block_size)


def with_pulled(placement: Placement, source: str, pulled: int, prompt_blocks: int) -> Placement:
    """`placement` with `pulled` more blocks brought to its group before the request (from
    `source`, unless a pull from another holder came first): they count among its pulled
    blocks, and those of the prompt's `prompt_blocks` full blocks among its cached ones."""
    if not pulled:
        return placement
    return replace(
        placement,
        pull_from=placement.pull_from or source,
        pull_blocks=placement.pull_blocks + pulled,
        cached_blocks=max(placement.cached_blocks, min(prompt_blocks, pulled)),
    )


def load_move_target(
    here: GroupStatus,
    statuses: Mapping[str, GroupStatus],
    moving: Collection[str],
    known: int,
    left: int,
    resumes: int,
    cost: CostModel,
    block_size: int,
    pull: bool = True,
) -> str | None:
    """The live group a stream on `here` should move to for load, or None to stay: of the
    `statuses` with at least LOAD_MOVE_MARGIN fewer requests (running and waiting), the one
    where the stream's `left` tokens (at most) would finish soonest, if sooner than on `here`.
    On a group the stream waits for its queued prefill, then decodes with its requests, at the
    cost model's step; on another, first the pull of the full blocks of its `known` tokens (the
    prompt and its output so far; `pull` False: none) and the recompute of the rest. `moving`:
    the groups a stream of this router is moving from or to (`Ledger.moving_groups`), which
    take part in no other move until it arrives (their statuses may not show it yet). A stream
    that has moved `resumes` times keeps RESUMES_KEPT of its MAX_RESUMES for failures."""
    if left <= 0 or resumes >= MAX_RESUMES - RESUMES_KEPT or here.group_id in moving:
        return None
    load = here.running + here.waiting  # (the stream among them)
    soonest = cost.recompute_seconds(here.pending_prefill_tokens) + left * cost.step_seconds(0, load)
    blocks = (known - 1) // block_size if pull else 0  # (the last token's block is computed)
    best = None
    for gid, s in statuses.items():
        other = s.running + s.waiting
        if gid == here.group_id or gid in moving or load - other < LOAD_MOVE_MARGIN:
            continue
        stall = cost.pull_seconds(blocks, same_node(here, s))
        queued = s.pending_prefill_tokens + known - blocks * block_size
        finish = stall + cost.recompute_seconds(queued) + left * cost.step_seconds(0, other + 1)
        if finish < soonest:
            best, soonest = gid, finish
    return best


def tier_lead(m: GroupMatch | None) -> tuple[int, int, int]:
    """A group's lead of a chain on its device, with its host tier, with its disk tier
    (`Placement.tier_lead`). Blocks pending beyond what it committed in any tier count as on
    the device (it is computing them, as `cold_source` reads it); pending blocks it committed
    already are the ones placed before, wherever they are now (on the host, once evicted)."""
    if m is None:
        return (0, 0, 0)
    device = m.pending_blocks if m.pending_blocks > m.tier_blocks else m.blocks
    host = max(device, m.blocks + m.host_blocks)
    return (device, host, max(host, m.tier_blocks))


def pull_source(
    placement: Placement,
    matches: Mapping[str, GroupMatch],
    statuses: Collection[str] | Mapping[str, GroupStatus],
    cost: CostModel | None = None,
    block_size: int = 16,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
) -> Placement:
    """The placement with the live group to pull the prefix from: of those whose committed
    leading blocks (on the device or the host tier: what a holder exports) exceed what the
    chosen group holds in any tier (a lead it holds on its host or disk tier is restored
    there, not pulled again), the one whose pull saves the most time over recomputing the
    blocks it adds (`pull_eta`: the cost model's link to it, and the step it may have in
    flight); unchanged when no pull is sooner. `statuses`: the live groups (with their
    statuses, their nodes)."""
    cost = cost or CostModel()
    chosen = matches.get(placement.group_id)
    own = chosen.tier_blocks if chosen is not None else 0
    here = statuses.get(placement.group_id) if isinstance(statuses, Mapping) else None
    best, most, saved = None, 0, 0.0
    for gid in touched_ids(matches):
        m = matches[gid]
        held = m.blocks + m.host_blocks  # (worker/engine/block_manager.py: `held_chain`)
        extra = held - own
        if extra <= 0 or gid == placement.group_id or gid not in statuses:
            continue
        holder = statuses[gid] if isinstance(statuses, Mapping) else None
        gain = cost.recompute_seconds(extra * block_size) - pull_eta(m, holder, here, extra, cost, batch_tokens)
        if gain > saved:
            best, most, saved = gid, held, gain
    return placement if best is None else replace(placement, pull_from=best, pull_blocks=most)


def pull_eta(
    m: GroupMatch,
    holder: GroupStatus | None,
    here: GroupStatus | None,
    blocks: int,
    cost: CostModel,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
) -> float:
    """Seconds until `blocks` committed blocks of a chain that the holder (its match `m`, its
    status) has are pulled: the link's time, after the step the holder may have in flight when
    it is still computing the chain (it indexes blocks as it schedules them and exports them
    between steps: the last committed ones may be in that step)."""
    seconds = cost.pull_seconds(blocks, same_node(here, holder))
    if holder is not None and m.pending_blocks > m.tier_blocks:
        seconds += cost.step_seconds(min(holder.pending_prefill_tokens, batch_tokens), holder.running)
    return seconds


def cold_source(
    placement: Placement,
    matches: Mapping[str, GroupMatch],
    statuses: Collection[str] | Mapping[str, GroupStatus],
    cost: CostModel | None = None,
    block_size: int = 16,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
) -> Placement:
    """The placement with the live group that has the prefix pending but not committed (it is
    computing it) to wait for and pull from (`pull_wait`): the one whose pending lead exceeds
    what the chosen group holds or has pending, or would pull at once (`pull_source`), by the
    most, at least COLD_MIN_BLOCKS, when waiting for it is sooner (`wait_seconds`) than the
    alternative: the chosen group's queued prefill and the blocks it lacks after what it
    pulls at once (`pull_eta`), with the copy's charge. Unchanged when none is (see
    COLD_WAIT_S). Both queues are as the router's ledger corrects them
    (`Router.live_statuses`)."""
    cost = cost or CostModel()
    chosen = matches.get(placement.group_id)
    own = 0 if chosen is None else max(chosen.tier_blocks, chosen.pending_blocks)
    pulled = placement.pull_blocks if placement.pull_from is not None else 0
    base = max(own, pulled)
    best, most = None, base + COLD_MIN_BLOCKS - 1
    for gid in touched_ids(matches):
        m = matches[gid]
        computing = m.pending_blocks > m.tier_blocks  # pending beyond what it committed
        if m.pending_blocks > most and computing and gid != placement.group_id and gid in statuses:
            best, most = gid, m.pending_blocks
    if best is None:
        return placement
    if isinstance(statuses, Mapping):
        holder, here = statuses[best], statuses.get(placement.group_id)
        m = matches[best]
        wait = wait_seconds(holder, most, cost, same_node(here, holder), m.tier_blocks, block_size, batch_tokens)
        missing = (most - base) * block_size
        # its own queue first, then the prefix; and the second copy's charge (the placement
        # formula's recompute term: the compute and pool space a copy takes, and the requests
        # that wait behind it, at least as many as the least busy group holds)
        queued, running = (here.pending_prefill_tokens, here.running) if here is not None else (0, 0)
        delayed = delayed_requests(statuses)
        recompute = cost.step_seconds(queued + missing, running) + (1 + delayed) * cost.recompute_seconds(missing)
        if pulled > own:  # the lead it would pull at once comes first
            source = placement.pull_from
            recompute += pull_eta(matches[source], statuses.get(source), here, pulled - own, cost, batch_tokens)
        if wait >= recompute:
            return placement
    return replace(placement, pull_from=best, pull_blocks=most, pull_wait=True)


def wait_seconds(
    holder: GroupStatus,
    blocks: int,
    cost: CostModel,
    near: bool = True,
    committed: int = 0,
    block_size: int = 16,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
) -> float:
    """Seconds until `blocks` blocks a group is computing are pulled from it: its queued
    prefill in one step with its running decodes, then the pull. Of the queue, only what is
    ahead of the prefix's end counts: all of it while the prefix waits, but once the holder has
    `committed` COLD_MIN_BLOCKS or more of it (a document's prefill under way, not a shared
    system prompt) only the rest of the prefix and at most one step's budget of the prefills
    admitted before it (what comes after it in the queue does not delay it)."""
    queued = holder.pending_prefill_tokens
    if committed >= COLD_MIN_BLOCKS:
        queued = min(queued, (blocks - committed) * block_size + batch_tokens)
    return cost.step_seconds(queued, holder.running) + cost.pull_seconds(blocks, near)


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """The most characters of text whose tokens could still fit `max_model_len`: no token
    decodes to more than `longest` characters (special tokens included; +1 for the space a
    SentencePiece token drops at the start of a text), so a text of N characters is at least
    N / longest tokens. Doubled, for a normalizer that folds characters into fewer."""
    pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    longest = max(len(p) for p in pieces) + 1
    return 2 * longest * max_model_len


def check_message_count(count: int, context: int) -> None:
    """PromptTooLongError for more chat messages than the context has tokens, before anything
    is built for each."""
    if count > context:
        raise PromptTooLongError(
            f"messages has {count} entries; the model's context of {context} tokens cannot hold that many"
        )
