"""Continuous batching: which tokens of which requests run in the next forward pass.

A request whose prefix is partly on the disk tier waits in a loading state (`loading`) while
the block manager's load copies the blocks up to the host tier off the step's path
(worker/engine/block_manager.py): it is neither scheduled nor holding the queue, whose next
requests are admitted, and running ones keep decoding. At each step's start the loads done on
every rank are completed, and a loading request whose blocks are all read goes back to the
head of the queue, to be matched again: its blocks are host hits now (or misses where a read
failed, recomputed). Aborting a loading request lets its load finish for the host tier.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from worker.config import SchedulerConfig
from worker.engine.block_manager import BlockManager, cdiv
from worker.engine.fair_queue import WaitingQueue
from worker.engine.request import Request, RequestStatus
from worker.protocol import QueueFullError
from worker.step import ScheduledRequest, SchedulerOutput


class Scheduler:
    """Owns the waiting and running requests of one group and the group's block manager."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, lookahead: int = 0) -> None:
        self.config = config
        self.bm = block_manager
        self.block_size = block_manager.block_size
        # Tokens past each decode whose slots its table holds already: with a forward that
        # runs ahead of the scheduler (worker/exec/overlap.py), 1, so that a position
        # entering a new block finds it allocated one step early (when a block is free
        # then; nothing is preempted for it).
        self.lookahead = lookahead
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(by_priority=config.policy == "priority", weights=config.tenant_weights)
        self.running: list[Request] = []  # in admission order
        # request id -> (the request, the hashes its loads read), waiting for the disk tier
        self.loading: dict[str, tuple[Request, frozenset[bytes]]] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        self._reserve_blocks = int(config.watermark * block_manager.num_blocks)
        self._seated = 0  # requests preempted this step to free a slot for a fairer tenant

    # ---- requests in and out -----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request, or refuse one that could never run (ValueError) or that finds
        the queue full (QueueFullError): the group's own checks of a request, made once."""
        self.check(request)
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def check(self, request: Request) -> None:
        """`add_request`'s checks alone, for a request that must wait before it is queued (for
        its structured output's grammar)."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError("prompt is empty")
        context, known = self.config.max_model_len, len(request.all_token_ids)  # (a resume's output too)
        if known >= context:
            raise ValueError(f"prompt is {known} tokens; the model's context is {context}")
        total = request.num_prompt_tokens + request.max_tokens
        if total > context:
            raise ValueError(
                f"prompt ({request.num_prompt_tokens} tokens) plus max_tokens "
                f"({request.max_tokens}) is {total} tokens, over the model's context of "
                f"{self.config.max_model_len}"
            )
        if cdiv(total, self.block_size) > self.bm.num_blocks:
            raise ValueError(
                f"request needs {cdiv(total, self.block_size)} KV blocks of {self.block_size} "
                f"tokens but the whole pool has {self.bm.num_blocks}"
            )
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests); retry later")

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (abort, stop string): its blocks are freed at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request_id in self.loading:  # (its load goes on: the host keeps what it reads)
            del self.loading[request_id]
        else:
            self.waiting.remove(request)
        self.bm.free(request)
        request.status = status
        self.waiting.left(request.tenant)
        self._finished_ids.append(request_id)
        return request

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        done = (self.finish_request(rid, RequestStatus.FINISHED_ABORTED) for rid in ids)
        return [r for r in done if r is not None]

    # ---- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Invariant: each request's computed tokens catch up with its known tokens, under a
        token budget (max_num_batched_tokens), a sequence cap (max_num_seqs) and the free-block
        budget. Chunked prefill, prefix hits, decodes and recompute after preemption are all
        cases of this one rule. Order: running decodes, then unfinished prefills, then
        admissions. A running request that cannot get a block preempts the newest (or lowest
        priority) running request not yet scheduled, itself last."""
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        if self.bm.loads_in_flight:
            self._poll_loads()
        self._seated = self._free_seats(out) if self.waiting.fair else 0
        self._favoured, self._others_left = self._prefill_bound()
        budget = self._schedule_running(out, budget)
        if len(out.preempted_ids) == self._seated:  # (none for want of blocks)
            budget = self._schedule_waiting(out, budget)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        out.moves = self.bm.take_moves()  # (the step's copies between tiers, made before it runs)
        if self.waiting.fair:  # each tenant's tokens, against its share (admissions: already)
            charge = self.waiting.charge
            for s in out.scheduled:
                if not s.is_new:
                    charge(s.request.tenant, s.num_tokens)
        return out

    def _poll_loads(self) -> None:
        """Complete the disk loads read on every rank (waiting for the oldest when nothing
        else could run); loading requests whose blocks are all read go back to the head of the
        queue, in the order they arrived."""
        idle = not self.running and not self.waiting
        self.bm.poll_loads(block=idle)
        loading = self.bm.loading
        back = [r for r, waits in self.loading.values() if loading.keys().isdisjoint(waits)]
        for req in sorted(back, key=lambda r: r.arrival_time, reverse=True):
            del self.loading[req.request_id]
            self.waiting.push(req, front=True)

    @property
    def num_loading(self) -> int:
        """Requests waiting for their blocks from the disk tier."""
        return len(self.loading)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running requests in admission order, decodes before the others (a recompute or an
        unfinished prefill). A decode whose table holds its slot (and its lookahead) and
        that does not fill its block needs nothing of the block manager: the steady state's
        common case, kept to a few operations."""
        bs, table_of, scheduled = self.block_size, self.bm.table_of, out.scheduled
        reach = 1 + self.lookahead  # slots a decode needs in its table: its own and ahead
        others = []
        for req in list(self.running):  # (a copy: preemption removes from the list)
            if budget == 0:
                break
            start = req.num_computed_tokens
            if len(req.all_token_ids) - start > 1:
                others.append(req)
            elif req.status is RequestStatus.RUNNING:  # (not preempted earlier in this step)
                ids = table_of(req.request_id)
                if start + reach <= len(ids) * bs and (start + 1) % bs:
                    req.num_computed_tokens = start + 1
                    scheduled.append(ScheduledRequest(req, start, 1, ids, (), False, True))
                    budget -= 1
                else:
                    budget -= self._grow(req, 1, out, self.lookahead)
        fair = self.waiting.fair
        if fair:  # the tenants furthest under their share first (a stable sort)
            others.sort(key=lambda r: self.waiting.counter(r.tenant))
        for req in others:
            if budget == 0:
                break
            if fair and len(out.preempted_ids) == self._seated:
                # a waiting tenant further under its share is admitted before this one goes on
                budget = self._schedule_waiting(out, budget, below=self.waiting.counter(req.tenant))
                if budget == 0:
                    break
            if req.status is RequestStatus.RUNNING:
                n = self._prefill_room(req.tenant, min(req.num_tokens - req.num_computed_tokens, budget))
                if n:
                    n = self._grow(req, n, out)
                    self._took_prefill(req.tenant, n)
                    budget -= n
        return budget

    def _grow(self, req: Request, n: int, out: SchedulerOutput, lookahead: int = 0) -> int:
        """Schedule `n` more tokens of a running request, preempting the newest (or lowest
        priority) request not yet scheduled while the blocks fall short, `req` itself last;
        returns the tokens scheduled (0 when `req` was preempted). Room for `lookahead`
        tokens more is taken only when free."""
        if lookahead and not self.bm.can_append(req, n + lookahead):
            lookahead = 0
        while not self.bm.can_append(req, n, protect=len(self.running) > 1):
            victim = self._pick_victim(exclude={s.request.request_id for s in out.scheduled})
            victim = victim or req
            self._preempt(victim, out)
            if victim is req:
                return 0
        new_ids = self.bm.append_slots(req, n, lookahead)
        if new_ids:
            out.grew.append(len(out.scheduled))
        out.scheduled.append(self._record(req, n, new_ids, is_new=False))
        return n

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, below: float | None = None) -> int:
        """Admit waiting requests in the queue's order while the budgets last; `below`: only
        those of tenants whose counter is below it (worker/engine/fair_queue.py)."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            if below is not None and self.waiting.counter(req.tenant) >= below:
                break
            match = self.bm.match_prefix(req)
            if match.waits:  # a load from the disk reads its blocks: the next may go first
                self.waiting.pop()
                self.loading[req.request_id] = (req, match.waits)
                continue
            n = self._prefill_room(req.tenant, min(req.num_tokens - match.num_tokens, budget))
            if n == 0:
                break
            # (while requests run, they will free blocks: the others' quotas can wait for them)
            if not self.bm.can_allocate(req, match, n, self._reserve_blocks, protect=bool(self.running)):
                break  # keep FCFS order: nobody overtakes the head of the queue
            self.waiting.pop()
            first = req.num_cached_tokens < 0  # (a preempted request keeps its first admission's)
            tiers = self.bm.tiers_of(match) if first else None  # (before the restore forgets them)
            self.bm.allocate(req, match, n)
            block_ids = self.bm.block_ids(req.request_id)
            req.num_computed_tokens = match.num_tokens
            if first:
                req.num_cached_tokens = min(match.num_tokens, req.num_prompt_tokens)
                req.cached_tiers = tiers.clipped(req.num_cached_tokens)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(self._record(req, n, list(block_ids), is_new=True))
            out.admitted.append(out.scheduled[-1])
            if self.waiting.fair:  # (counted now: the next admission of this step sees it)
                self.waiting.charge(req.tenant, n)
            self._took_prefill(req.tenant, n)
            budget -= n
        return budget

    def _prefill_bound(self) -> tuple[set[str] | None, int]:
        """While several tenants have requests in the group, the tenants at or under their
        weighted share of the running requests, and the prompt tokens a step may compute for
        the others (config.over_share_prefill_tokens): a bound on how long a step of a heavy
        tenant's prefill makes another's new request wait. (None, 0): no bound."""
        cap = self.config.over_share_prefill_tokens
        active = self.waiting.active_tenants() if cap is not None and self.waiting.fair else set()
        if len(active) < 2:
            return None, 0
        counts: dict[str, int] = {}
        for r in self.running:
            counts[r.tenant] = counts.get(r.tenant, 0) + 1
        weight = self.waiting.weights.get
        total, n = sum(weight(t, 1.0) for t in active), len(self.running)
        return {t for t in active if counts.get(t, 0) <= n * weight(t, 1.0) / total}, cap

    def _prefill_room(self, tenant: str, n: int) -> int:
        """Of `n` prompt tokens, those `tenant` may compute in this step (see _prefill_bound)."""
        if self._favoured is None or tenant in self._favoured:
            return n
        return min(n, self._others_left)

    def _took_prefill(self, tenant: str, n: int) -> None:
        """Any tenant's prompt tokens in the step count against the over-share tenants' room."""
        if self._favoured is not None:
            self._others_left = max(0, self._others_left - n)

    def _record(self, req: Request, n: int, new_ids: list[int], is_new: bool) -> ScheduledRequest:
        start = req.num_computed_tokens
        req.num_computed_tokens += n
        return ScheduledRequest(
            request=req,
            start=start,
            num_tokens=n,
            block_ids=self.bm.block_ids(req.request_id),
            new_block_ids=new_ids,
            is_new=is_new,
            samples=req.num_computed_tokens == req.num_tokens,
        )

    def _free_seats(self, out: SchedulerOutput, at_most: int = 4) -> int:
        """With every sequence slot taken, waiting tenants under their weighted share of the
        slots take them from the tenant furthest over its share, whose newest (or lowest
        priority) running request is preempted (to be recomputed, mostly from the prefix
        cache): so that one tenant's backlog cannot hold every slot while another's requests
        wait. Each waiting request of an under-share tenant gets a slot (a free one first),
        the tenants furthest under their share first; returns the requests preempted (at most
        `at_most` a step)."""
        cap, running, waiting = self.config.max_num_seqs, self.running, self.waiting
        if len(running) < cap or not waiting:
            return 0
        counts: dict[str, int] = {}
        for r in running:
            counts[r.tenant] = counts.get(r.tenant, 0) + 1
        weight = waiting.weights.get
        freed = 0
        for tenant, backlog in waiting.backlogs():  # (furthest under its share first)
            tenants = {*counts, tenant}
            total = sum(weight(t, 1.0) for t in tenants)
            seats = {t: cap * weight(t, 1.0) / total for t in tenants}
            for _ in range(backlog):
                if freed == at_most or counts.get(tenant, 0) + 1 > seats[tenant]:
                    return freed  # it has its share: it (and, in queue order, those after) waits
                over = max(counts, key=lambda t: counts[t] - seats[t])
                if counts[over] <= seats[over]:
                    return freed
                self._preempt(self._newest(over), out)
                counts[over] -= 1
                counts[tenant] = counts.get(tenant, 0) + 1
                freed += 1
        return freed

    def _newest(self, tenant: str) -> Request:
        """`tenant`'s running request that preemption takes first: its newest, or its lowest
        priority (then newest) under the priority policy."""
        mine = (r for r in self.running if r.tenant == tenant)
        if self.waiting.by_priority:
            return max(mine, key=lambda r: r.sort_key)
        return max(mine, key=lambda r: r.arrival_time)

    def _pick_victim(self, exclude: set[str]) -> Request | None:
        """The newest (or lowest priority) running request not in `exclude`, of the tenant
        furthest over its share (worker/engine/fair_queue.py) when several send."""
        candidates = [r for r in self.running if r.request_id not in exclude]
        if not candidates:
            return None
        counter = self.waiting.counter
        if self.waiting.by_priority:
            return max(candidates, key=lambda r: (counter(r.tenant), r.sort_key))
        return max(candidates, key=lambda r: (counter(r.tenant), r.arrival_time))

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Recompute later: free the blocks (cached ones stay reusable) and requeue at the head."""
        self.running.remove(req)
        self.bm.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(req, front=True)
        out.preempted_ids.append(req.request_id)

    # ---- after the forward -------------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, sampled: Mapping[str, int | tuple[int, object]]
    ) -> list[Request]:
        """Append each sampled token (request id -> token, or (token, its logprobs) as the
        executor returns them) and apply the stop conditions; returns finished requests."""
        finished = []
        for s in out.scheduled:
            req = s.request
            token = sampled.get(req.request_id)
            if token is None or req.status is not RequestStatus.RUNNING:
                continue  # a prefill chunk that does not sample, or aborted meanwhile
            if self.append_token(req, token[0] if type(token) is tuple else token):
                finished.append(req)
        return finished

    def append_token(self, req: Request, token: int) -> bool:
        """Append a running request's sampled token and apply the stop conditions (EOS unless
        ignored, a stop token, max_tokens, the model's context): whether that ended it (its
        blocks are then freed). The engine calls this for each request as it walks a step's
        samples once."""
        req.append_token(token)
        if token in req.ending_token_ids:
            req.stop_reason = token
            self.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            return True
        if len(req.output_token_ids) >= req.max_tokens or len(req.all_token_ids) >= self.config.max_model_len:
            self.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)
            return True
        return False

    # ---- load --------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def pending_prefill_tokens(self) -> int:
        """Tokens still to compute before every request has its next token: the queued work."""
        return sum(r.num_tokens - r.num_computed_tokens for r in self.requests.values())
