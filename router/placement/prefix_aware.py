"""`prefix_aware`, the default placement policy: the candidate group of lowest estimated cost,
where the candidates are those under a load bound.

The cost of placing an n-block prompt on group g that holds (or has pending) its first h
blocks, in seconds (`PrefixAware.cost`, one term per line). A block costs nothing on g's
device, a restore from g's host tier (load_block_s) or disk tier (fetch_block_s, then the
host's load), or its recompute: h counts the leading blocks g holds in any tier (the prefix
index's per-tier match), of which `host` and `disk` blocks are restored:

    new         = (n - h) * block_size + block_size / 2    tokens g must compute (with the tail)
    ttft        = (g's queued prefill + new) * prefill_token_s
                  + steps of that work * (step_s + g's running decodes * decode_seq_s)
    restore     = host * load_block_s + disk * (fetch_block_s + load_block_s)
    recompute   = (1 + delayed) * new * prefill_token_s
                  where delayed = the fewest requests running and waiting on any live group
    eviction    = eviction_weight * pressure(g) * (new and restored blocks beyond g's empty
                  ones) * block_size * prefill_token_s
    neighbours  = request_weight * (g's running + waiting requests) * decode_seq_s
    balance     = balance_weight * decode_seq_s * (g's recent placements - their mean)

The first term is the request's own wait (g's queued prefill as the router's ledger corrects it:
without the prefixes it predicted cached for its requests in flight, which the group counts as
work until it admits them). The others are what the placement costs the rest of the cluster. A
prefix computed where another group holds it takes a second copy of pool space (the 1 of
recompute) and is work that the requests behind it wait for: at least as many as the least busy
group holds (Little's law: as many arrive during a wait as a group holds). On an idle cluster
that is none, and a spill costs little more than its own prefill; under saturation it is tens of
requests, so a holder keeps its prefix unless its queue outweighs them all, since a cold copy of
a document adds its whole prefill to a saturated cluster. (The least busy group, not the mean:
one overloaded group must not make an idle one look busy.) What the placement evicts is colder
the less new content the group took in lately (pressure: g's recent uncached tokens over the
mean); each request already on g slows its steps (neighbours); and a group above the mean of
recent placements should take the next one less (balance).

The bound (`LoadBound`, consistent hashing with bounded loads, Mirrokni et al.): a group over
(1 + load_slack) x the mean of this router's recent placements (+ load_burst) takes no request,
so a hot document's questions spread over its holders and, when they are all at the bound, spill
to one more group, which caches it too; replication follows load, never more than the bound
needs. A prefix held by only a few groups (hit_holders), all at the bound, may still go to one
of them up to (1 + hit_slack) x the mean: diverting it would recompute the prefix and keep a
second copy warm, while the requests that cost the same anywhere (chats, a hot document's
questions, which have other holders) keep the bound. A new prefix (no group holds any of it)
is not bounded: the bound counts requests, not their work, and the group that took the fewest
requests lately is the one busy with long prefills, so a bound would send every new document's
prefill to the group whose queue is longest; its cost (its wait there, the balance term)
places it instead. Replication by cost is capped too: once max_replicas groups hold half the
longest match, only they are candidates.

Ties go by rendezvous hashing of the chain's first block, so every router replica breaks a tie
the same way. `choose` is the formula over every candidate; `PrefixAware` answers the same with a
faster loop (`_lowest`: constant terms hoisted, status terms cached, groups without a hit skipped
when none of them can cost less), tested equal to the formula on random decisions. Measured
figures: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from cluster.cost_model import CostModel
from cluster.group import GroupStatus
from cluster.index import GroupMatch, touched_ids
from router.placement.policy import PlacedShare, Placement, Policy, first_block, rendezvous


@dataclass(frozen=True)
class PrefixAwareConfig:
    """The weights of the cost terms and the load bound (see the module docstring); times come
    from the groups' calibrated `cost` model, the block size and the step's token budget from
    the engine's configuration. Defaults measured with benchmarks/routing.py on simulated
    research-assistant traces (benchmarks/RESULTS.md)."""

    cost: CostModel = field(default_factory=CostModel)
    # Each cached block a placement evicts is charged eviction_weight times its recompute,
    # scaled by the group's recent uncached tokens over the mean: a group that took in less
    # new content lately has an older LRU tail, so what it evicts is colder.
    eviction_weight: float = 4.0
    # Most groups a prefix spills onto by cost; None: half the live groups (at least 2). The
    # load bound below may still place a request elsewhere.
    max_replicas: int | None = None
    # Decode steps' worth of time charged per request already on the group (it slows every
    # step there by cost.decode_seq_s for about a request's output length: ~32 tokens).
    request_weight: float = 32.0
    # Decode steps' worth of time charged per placement a group took above the mean of this
    # router's last ~balance_window placements per live group (exponentially decayed, so the
    # bound's burst is the same fraction at any group count): a hot document's questions go to
    # its least busy holder.
    balance_window: int = 200
    balance_weight: float = 32.0
    # The bound: a group over (1 + load_slack) * mean + load_burst placements takes none until
    # the others catch up. Each router bounds its own placements, so several routers together
    # stay bounded too. None: no bound.
    load_slack: float | None = 0.1
    load_burst: float = 4.0
    # A request whose longest match is held by at most hit_holders groups, all over the
    # bound, may still go to one of them up to (1 + hit_slack) * mean + load_burst. None (or
    # hit_slack <= load_slack): one bound for all.
    hit_slack: float | None = 0.2
    hit_holders: int = 2

    def __post_init__(self) -> None:
        for name in ("eviction_weight", "request_weight", "balance_weight", "load_burst"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_replicas is not None and self.max_replicas < 1:
            raise ValueError(f"max_replicas must be >= 1, got {self.max_replicas}")
        if self.balance_window < 1:
            raise ValueError(f"balance_window must be >= 1, got {self.balance_window}")
        if self.load_slack is not None and not self.load_slack >= 0:
            raise ValueError(f"load_slack must be >= 0 or None, got {self.load_slack}")
        if self.hit_slack is not None and not self.hit_slack >= 0:
            raise ValueError(f"hit_slack must be >= 0 or None, got {self.hit_slack}")
        if self.hit_holders < 1:
            raise ValueError(f"hit_holders must be >= 1, got {self.hit_holders}")


class LoadBound(NamedTuple):
    """Which groups may take a request: a group is a candidate if it holds at least `min_hit`
    blocks and its recent placements are under `bound`, or it holds the longest match
    (`best_hit`) and is under the hit bound `high`. (A named tuple: one is made per decision.)"""

    min_hit: int
    bound: float
    high: float
    best_hit: int

    @classmethod
    def of(cls, cfg: PrefixAwareConfig, held: Mapping[str, int], placed: _Placed, mean: float) -> LoadBound:
        """The bound for one request. The least placed group is always under it. A prefix's
        only holders (at most hit_holders groups with its longest match), all over the bound,
        stay candidates up to the hit bound. Once max_replicas groups hold at least half the
        longest match, only they are candidates (replication by cost is bounded). A prefix no
        group holds has no bound (module docstring)."""
        best_hit = max(held.values(), default=0)
        min_hit = 0
        if best_hit > 0:
            half = (best_hit + 1) // 2  # 2 * hit >= best_hit
            holders = len([h for h in held.values() if h >= half])
            if holders >= (cfg.max_replicas or max(2, placed.live // 2)):
                min_hit = half
        if cfg.load_slack is None or best_hit == 0:  # (a new prefix: no bound)
            return cls(min_hit, math.inf, -math.inf, best_hit)
        bound = (1.0 + cfg.load_slack) * mean + cfg.load_burst
        if cfg.hit_slack is not None and best_hit > 0:
            best = [placed[g] for g, h in held.items() if h == best_hit]
            if len(best) <= cfg.hit_holders and min(best) >= bound:
                return cls(min_hit, bound, (1.0 + cfg.hit_slack) * mean + cfg.load_burst, best_hit)
        return cls(min_hit, bound, -math.inf, best_hit)

    def admits(self, hit: int, placements: float) -> bool:
        if hit < self.min_hit:
            return False
        return placements < self.bound or (hit == self.best_hit and placements < self.high)

    def relaxed(self) -> list[LoadBound]:
        """When no group is a candidate: any group under the bound, else any group."""
        return [LoadBound(0, self.bound, -math.inf, self.best_hit), LoadBound(0, math.inf, -math.inf, self.best_hit)]


class PrefixAware(Policy):
    """Lowest estimated cost to first token under a load bound; see the module docstring."""

    name = "prefix_aware"

    def __init__(
        self,
        config: PrefixAwareConfig | None = None,
        block_size: int = 16,
        batch_tokens: int = 2048,
    ) -> None:
        super().__init__(block_size)
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
        self.config = config or PrefixAwareConfig()
        self.batch_tokens = batch_tokens  # a group's token budget per step (the engine's)
        # group id -> the terms of the score its status sets (_status_terms), for the status
        # of that version: a group's handle returns the same status until the group reports
        # again, so an entry of another version is stale and is recomputed
        self._terms: dict[str, StatusTerms] = {}

    def placed_window(self) -> int:
        return self.config.balance_window

    # ---- the formula ------------------------------------------------------------------
    def cost(
        self,
        n: int,
        s: GroupStatus,
        hit: int,
        placements: float,
        mean: float,
        pressure: float,
        delayed: int,
        restored: tuple[int, int] = (0, 0),
    ) -> float:
        """Seconds: this request's time to first token on the group, plus what placing it
        there costs the rest of the cluster (module docstring). `placements`: the group's
        recent placements, `mean` theirs over the live groups; `pressure`: the group's recent
        uncached tokens over the mean (1 when nothing was sent); `delayed`: the fewest requests
        running and waiting on any live group (`delayed_requests`); `restored`: of the `hit` blocks,
        those restored from the host and from the disk tier (`_restored`)."""
        cfg, c, bs = self.config, self.config.cost, self.block_size
        st = self._status_terms(s)
        ht = hit_terms(n, hit, bs, 1.0 + delayed, c, restored)
        ttft = ttft_s(st.queued + ht.new, c.prefill_token_s, self.batch_tokens, st.step_s)
        restore = ht.restore
        recompute = ht.recompute
        eviction = eviction_s(cfg.eviction_weight, pressure, max(0, ht.new_blocks - st.room), bs, c.prefill_token_s)
        neighbours = st.neighbours
        balance = cfg.balance_weight * c.decode_seq_s * (placements - mean)
        return ttft + restore + recompute + eviction + neighbours + balance

    def choose_by_formula(self, block_hashes, statuses, matches, placed) -> Placement:
        """The placement by the formula over every candidate (what `choose` answers faster)."""
        n, live = len(block_hashes), len(statuses)
        held = _held(n, statuses, matches)
        restored = _restored(matches, held)
        requests, tokens, scale = placed.raw()
        share = _Placed(requests, scale, live)
        mean = share.mean(statuses)
        total = sum(tokens.get(g, 0.0) for g in statuses)
        bound, delayed = LoadBound.of(self.config, held, share, mean), delayed_requests(statuses)
        for limits in (bound, *bound.relaxed()):
            costs = {
                g: self.cost(
                    n,
                    s,
                    held.get(g, 0),
                    share[g],
                    mean,
                    tokens.get(g, 0.0) * live / total if total > 0 else 1.0,
                    delayed,
                    restored.get(g, _NOT_RESTORED),
                )
                for g, s in statuses.items()
                if limits.admits(held.get(g, 0), share[g])
            }
            if costs:
                break
        low = min(costs.values())
        return self._placement(block_hashes, [g for g, c in costs.items() if c == low], held, bound.best_hit)

    # ---- the same, fast ----------------------------------------------------------------
    def choose(self, block_hashes, statuses, matches, placed) -> Placement:
        n, live = len(block_hashes), len(statuses)
        held = _held(n, statuses, matches)  # the groups with a hit; every other one has 0
        requests, tokens, scale = placed.raw()
        share = _Placed(requests, scale, live)  # read per candidate, not built for every group
        mean = share.mean(statuses)
        bound = LoadBound.of(self.config, held, share, mean)
        rows = statuses, held, share, mean, tokens, 1.0 + delayed_requests(statuses), _restored(matches, held)
        tied = self._lowest(n, rows, bound)
        if not tied:  # every candidate is over the bound
            for limits in bound.relaxed():
                tied = tied or self._lowest(n, rows, limits)
        return self._placement(block_hashes, tied, held, bound.best_hit)

    def _placement(self, block_hashes, tied: list[str], held, best_hit: int) -> Placement:
        gid = tied[0] if len(tied) == 1 else max(tied, key=lambda g: rendezvous(first_block(block_hashes), g))
        hit = held.get(gid, 0)
        if best_hit == 0:
            reason = "new_prefix"
        elif hit == best_hit:
            reason = "prefix_hit"
        else:
            reason = "spill"
        return Placement(gid, reason, hit)

    def _lowest(self, n, rows, limits: LoadBound) -> list[str]:
        """The candidates of lowest `cost`, several on a tie (e.g. idle groups, a new prefix).
        `rows`: (statuses, held, placed share, mean, recent uncached tokens, recompute's
        weight, restored blocks), see `choose`.

        The groups with a hit are scored first. The rest (hit 0) all pay the same recompute, so
        none of them can cost less than `floor`, the whole prompt's prefill and recompute with
        the least placements of any group and no other charge; when a hit already costs less,
        they are not scored at all (every term is a sum of non-negative products, and rounding
        keeps the order, so the skipped cost more even in floating point). The terms are the
        formula's, computed in the same order (the same floats): constants hoisted out, the
        terms that only a status sets cached (`_status_terms`), those that only the hit sets
        computed once per hit."""
        cfg, c, bs = self.config, self.config.cost, self.block_size
        prefill_s, budget, eviction_w = c.prefill_token_s, self.batch_tokens, cfg.eviction_weight
        unit = cfg.balance_weight * c.decode_seq_s
        half, (statuses, held, placed, mean, tokens, recompute_w, restored), live = bs // 2, rows, len(rows[0])
        placements, scale = placed.requests.get, placed.scale
        min_hit, bound, high, best_hit = limits.min_hit, limits.bound, limits.high, limits.best_hit
        terms, by_hit, total = self._terms, {}, None  # by_hit: (hit, restored) -> its HitTerms
        low, tied = math.inf, []
        todo = [(g, h) for g, h in held.items() if h >= min_hit]
        for rest in (False, True):
            if rest:  # the groups without a hit, if candidates and not all dearer
                new = n * bs + half
                floor = new * prefill_s + recompute_w * new * prefill_s + unit * (placed.least(statuses) - mean)
                if min_hit > 0 or floor > low:
                    break
                todo = [(g, 0) for g in statuses if g not in held]
            for g, h in todo:
                p = placements(g, 0.0) * scale
                if p >= bound and (h != best_hit or p >= high):
                    continue
                s = statuses[g]
                t = terms.get(g)
                if t is None or t.version != s.version:
                    t = terms[g] = self._status_terms(s)
                key = (h, restored.get(g, _NOT_RESTORED)) if restored else (h, _NOT_RESTORED)
                ht = by_hit.get(key)
                if ht is None:
                    ht = by_hit[key] = hit_terms(n, h, bs, recompute_w, c, key[1])
                cost = ttft_s(t.queued + ht.new, prefill_s, budget, t.step_s) + ht.restore + ht.recompute
                evicted = ht.new_blocks - t.room
                if evicted > 0:  # else the eviction charge is 0
                    if total is None:  # pressure 1 for all when nothing was sent
                        total = sum(map(tokens.get, statuses, itertools.repeat(0.0)))
                    pressure = tokens.get(g, 0.0) * live / total if total > 0 else 1.0
                    cost += eviction_s(eviction_w, pressure, evicted, bs, prefill_s)
                cost = cost + t.neighbours + unit * (p - mean)  # + neighbours + balance
                if cost < low:
                    low, tied = cost, [g]
                elif cost == low:
                    tied.append(g)
        if len(terms) > 2 * live + 16:  # forget groups that left
            self._terms = {g: t for g, t in terms.items() if g in statuses}
        return tied

    def _status_terms(self, s: GroupStatus) -> StatusTerms:
        """The parts of a group's cost that only its status sets."""
        cfg, c = self.config, self.config.cost
        neighbours = cfg.request_weight * (s.running + s.waiting) * c.decode_seq_s
        step = c.step_s + s.running * c.decode_seq_s
        return StatusTerms(s.version, s.pending_prefill_tokens, step, _empty_blocks(s), neighbours)


class HitTerms(NamedTuple):
    """The terms of a group's score that only its hit sets, worked out once per hit."""

    new: int  # tokens the group must compute (with the tail's half block)
    new_blocks: int  # blocks they fill, and the restored ones
    restore: float  # the restore term: host * load_block_s + disk * (fetch_block_s + load_block_s)
    recompute: float  # the recompute charge: (1 + delayed) * new * prefill_token_s


def hit_terms(
    n: int, hit: int, block_size: int, recompute_weight: float, cost: CostModel, restored: tuple[int, int] = (0, 0)
) -> HitTerms:
    """`HitTerms` of an n-block prompt on a group holding its first `hit` blocks, of which
    `restored` (host, disk) come from its tiers; `recompute_weight`: 1 + delayed."""
    new = (n - hit) * block_size + block_size // 2
    host, disk = restored
    restore = host * cost.load_block_s + disk * (cost.fetch_block_s + cost.load_block_s)
    recompute = recompute_weight * new * cost.prefill_token_s
    return HitTerms(new, math.ceil(new / block_size) + host + disk, restore, recompute)


def ttft_s(work: int, prefill_token_s: float, batch_tokens: int, step_s: float) -> float:
    """The ttft term: `work` prefill tokens (the group's queue and this prompt's new ones) in
    steps of `batch_tokens`, each `step_s` long with the running decodes."""
    return work * prefill_token_s + math.ceil(work / batch_tokens) * step_s


def eviction_s(weight: float, pressure: float, evicted: int, block_size: int, prefill_token_s: float) -> float:
    """The eviction term: `evicted` blocks beyond the group's empty ones, as cold as the
    group's `pressure` says."""
    return weight * pressure * evicted * block_size * prefill_token_s


class StatusTerms(NamedTuple):
    """The terms of a group's score that only its status sets, worked out once per status."""

    version: int  # GroupStatus.version of the status they were worked out from
    queued: int  # prefill tokens queued ahead of new work
    step_s: float  # seconds of one prefill step with its running decodes
    room: int  # empty blocks: a new block there evicts nothing
    neighbours: float  # the charge for delaying the requests already there


def delayed_requests(statuses: Mapping[str, GroupStatus]) -> int:
    """The fewest requests running and waiting on any live group: how many, at least, wait
    behind new work wherever it goes (the recompute charge's weight, module docstring)."""
    return min(s.running + s.waiting for s in statuses.values())


def _empty_blocks(s: GroupStatus) -> int:
    """Blocks with no content and no reference: a new block there evicts nothing."""
    return max(0, s.blocks_free - s.blocks_cached)


def _held(n: int, statuses: Mapping[str, GroupStatus], matches: Mapping[str, GroupMatch]) -> dict[str, int]:
    """The live groups that hold (in any tier) or have pending any leading block, with how
    many (at most `n`). A match answers for every live group, most of them with nothing: only
    the ones it says it touched are read."""
    held = {}
    for gid in touched_ids(matches):
        m = matches[gid]
        h = m[2] if m[2] > m[3] else m[3]  # blocks, pending_blocks
        below = m[2] + m[4] + m[5]  # blocks, host_blocks, disk_blocks: the lead in any tier
        if below > h:
            h = below
        if h and gid in statuses:
            held[gid] = h if h < n else n
    return held


_NOT_RESTORED = (0, 0)  # (host, disk) blocks restored of a hit


def _restored(matches: Mapping[str, GroupMatch], held: Mapping[str, int]) -> dict[str, tuple[int, int]]:
    """The groups whose hit (`held`) goes on below the device, with how many of its blocks
    they restore from the host and from the disk (a pending block is counted as on the
    device: it is being computed or restored there already)."""
    out = {}
    for gid, h in held.items():
        m = matches.get(gid)
        if m is None or not (m[4] or m[5]):
            continue
        device = min(max(m[2], m[3]), h)
        host = max(device, min(m[2] + m[4], h))  # the lead on the device or the host
        if h > device:
            out[gid] = (host - device, h - host)
    return out


class _Placed:
    """A `PlacedShare`'s decayed placements for one decision: group g's is requests[g] * scale,
    read per candidate instead of built for every group."""

    __slots__ = ("requests", "scale", "live")

    def __init__(self, requests: Mapping[str, float], scale: float, live: int) -> None:
        self.requests, self.scale, self.live = requests, scale, live

    def __getitem__(self, group_id: str) -> float:
        return self.requests.get(group_id, 0.0) * self.scale

    def mean(self, groups: Iterable[str]) -> float:
        return sum(map(self.requests.get, groups, itertools.repeat(0.0))) * self.scale / self.live

    def least(self, groups: Iterable[str]) -> float:
        return min(map(self.requests.get, groups, itertools.repeat(0.0))) * self.scale


__all__ = ["LoadBound", "PlacedShare", "PrefixAware", "PrefixAwareConfig", "delayed_requests"]
