"""`prefix_aware`, the default placement policy: it picks the group with the lowest estimated cost
to first token: the prefill still to compute there (the prompt minus the blocks the group holds
or has pending) on top of the group's queued prefill work, under its running decodes, plus
charges for what the placement costs the rest of the cluster: the recompute (weighted, since a
prefix computed twice also takes pool space twice), the cached blocks it would evict (weighted
by how much new content the group took in lately: little means an old, cold LRU tail), its
neighbours' decode time, and how far the group is above the mean of this router's recent
placements. On top of that, a group over (1 + load_slack) x the mean of recent placements takes
no request (consistent hashing with bounded loads, Mirrokni et al.): a hot document's questions
spread over its holders, and when they are all at the bound the document spills to one more
group, which caches it too. Replication therefore follows load, never more than the bound needs.
The bound's slack goes where diverting costs most: a prefix held by only one or two groups, all
at the bound, may still go to one of them up to (1 + hit_slack) x the mean, since diverting it
recomputes the prefix and keeps a second copy warm; the requests that cost the same anywhere
(new prefixes, chats, a hot document's questions, which have other holders) keep the bound. Ties
go by rendezvous hashing of the chain's first block, so every router replica breaks a tie the
same way.

Measured with benchmarks/routing.py (simulated groups, a Zipf-hot document; 16 groups / 10k
requests, seeds 0 and 1): on the loose trace the hit rate is 0.969 / 0.965 against perfect
document affinity's 0.974 / 0.969, with at most 1.05 / 1.09x the mean requests on any group,
where the affinity oracle and `prefix_hash` put 3.9-4.9x on the hot document's group (64
groups / 100k requests: 0.973 vs 0.977, at 1.09x). On the tight trace (documents twice
the pools) it is 0.929 / 0.922 against `prefix_hash`'s 0.931 / 0.920 and the oracle's 0.934 /
0.924, at 1.06 / 1.09x instead of 4.1-4.4x: the replicas that balance needs take pool space
(the hot document alone is asked 20% of the time, three groups' worth at the bound). That is the
price of balance, not of the placement: a clairvoyant one under the same bound, which knows
every document's demand and size in advance (`oracle_balanced`, benchmarks/oracles.py), reaches
0.928 / 0.920 at 1.15x (TTFT p99 0.58 s on seed 0, against 0.39 s here). Over pools 1% smaller
or larger the figures move by up to 0.1 points and stay within 1.10x.
`load_slack=None` with `max_replicas=1` is pure affinity (0.934 there, no balance).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from cluster.group import GroupStatus
from cluster.index import GroupMatch, touched_ids
from cluster.sim_group import CostModel
from router.group_window import GroupWindow
from router.placement import Placement, Policy, first_block, rendezvous


def _held(n: int, statuses: Mapping[str, GroupStatus], matches: Mapping[str, GroupMatch]) -> dict[str, int]:  # fmt: skip
    """The live groups that hold or have pending any leading block, with how many
    (`cached_blocks`, at most `n`). A match answers for every live group, most of them with
    nothing: only the ones it says it touched are read."""
    held = {}
    for gid in touched_ids(matches):
        m = matches[gid]
        h = m[2] if m[2] > m[3] else m[3]  # blocks, pending_blocks
        if h and gid in statuses:
            held[gid] = h if h < n else n
    return held


@dataclass(frozen=True)
class PrefixAwareConfig:
    """The time model behind `prefix_aware` (seconds from the group's calibrated cost model).

    Defaults measured with benchmarks/routing.py on simulated 16-group research-assistant
    traces (two seeds each, loose and tight pools); see the module docstring."""

    cost: CostModel = field(default_factory=CostModel)
    max_num_batched_tokens: int = 2048  # a group's token budget per step
    # Each prompt token a group must compute is charged its prefill time once for this
    # request's wait and recompute_weight times more for what it costs the cluster: every
    # request queued behind it waits too, and a prefix computed where another group holds it
    # takes a second copy of pool space. 0 is the bare TTFT rule (it spills a hot document as
    # soon as its holder's queue costs more than one prefill, and duplicates freely).
    recompute_weight: float = 8.0
    # Each cached block a placement evicts is charged eviction_weight times its recompute,
    # scaled by the group's recent uncached tokens over the mean: a group that took in less
    # new content lately has an older LRU tail, so what it evicts is colder.
    eviction_weight: float = 4.0
    # Most groups a prefix spills onto by cost; None: half the live groups (at least 2). The
    # load bound below may still place a request elsewhere.
    max_replicas: int | None = None
    # Decode steps a request is expected to run: each request already running or waiting on a
    # group slows every step there by cost.decode_seq_s for about that many steps, so a
    # placement is charged request_weight * decode_tokens * decode_seq_s per such request
    # (the time it adds to its neighbours and they add to it). 0 ignores request counts.
    decode_tokens: int = 32
    request_weight: float = 1.0
    # Load balance over this router's last ~balance_window placements per live group
    # (exponentially decayed; the bound's burst is then the same fraction at any group count):
    # each placement a group took above the mean costs balance_weight neighbours' worth of
    # decode time (so a hot document's questions go to its least busy holder), and a group
    # over (1 + load_slack) * mean + load_burst placements takes none until the others catch up
    # (consistent hashing with bounded loads: the hot document then spills to a new replica).
    # Each router bounds its own placements, so several routers together stay bounded too.
    # With the ~200 placements a group holds in the window, the bound is ~1.12x the mean; a
    # burst of 8 (1.14x) let a whole run end at 1.16x on one of the traces at a 1% larger pool.
    # load_slack None: no bound.
    balance_window: int = 200
    balance_weight: float = 1.0
    load_slack: float | None = 0.1
    load_burst: float = 4.0
    # The bound's slack goes where diverting costs most. A request whose longest match is held
    # by at most hit_holders groups, all over the bound, may still go to one of them up to
    # (1 + hit_slack) * mean + load_burst: diverting it recomputes the prefix and stores a
    # second copy that its later requests keep warm. Requests with a cheap elsewhere (new
    # prefixes, chats, a prefix with more holders: a hot document) keep load_slack, so they
    # absorb the excess. 2 covers a prefix that balance already replicated once; a hot
    # document past 2 replicas spills at load_slack.
    # None (or hit_slack <= load_slack): one bound for all.
    hit_slack: float | None = 0.2
    hit_holders: int = 2

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")  # fmt: skip
        for name in ("recompute_weight", "eviction_weight", "request_weight", "balance_weight", "load_burst"):  # fmt: skip
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.decode_tokens < 0:
            raise ValueError(f"decode_tokens must be >= 0, got {self.decode_tokens}")
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


class PrefixAware(Policy):
    """Lowest estimated cost to first token under a load bound; see the module docstring."""

    name = "prefix_aware"

    def __init__(self, config: PrefixAwareConfig | None = None) -> None:
        self.config = config or PrefixAwareConfig()
        self.window = GroupWindow(self.config.balance_window)  # per live group
        # group id -> (its status, that status's terms of the score; see _status_terms). A
        # group's handle returns the same status object until the group reports again, so an
        # entry whose object `is not` the one passed in is stale and is recomputed.
        self._terms: dict[str, tuple[GroupStatus, int, float, int, float]] = {}
        cfg = self.config
        unit = cfg.balance_weight * cfg.decode_tokens * cfg.cost.decode_seq_s  # per placement
        self._constants = (cfg.cost.prefill_token_s, cfg.max_num_batched_tokens, cfg.recompute_weight, cfg.eviction_weight, unit)  # fmt: skip

    def choose(self, block_hashes, statuses, matches) -> Placement:
        n, key, live = len(block_hashes), first_block(block_hashes), len(statuses)
        held = _held(n, statuses, matches)  # the groups with a hit; every other one has 0
        # decayed placements: a group's is requests[g] * scale (read per candidate, not built
        # for every group: ~15 us at 64 groups)
        requests, _, scale = self.window.raw()
        placed = _Placed(requests, scale, live)
        best_hit, mean = max(held.values(), default=0), placed.mean(statuses)
        min_hit, bound, high = self._limits(held, best_hit, placed, mean)
        rows = statuses, held, placed, mean, best_hit
        tied = self._lowest(n, rows, min_hit, bound, high)
        if not tied:  # every candidate is over the bound: any group under it, else any group
            tied = self._lowest(n, rows, 0, bound, -math.inf)
            tied = tied or self._lowest(n, rows, 0, math.inf, -math.inf)
        gid = tied[0] if len(tied) == 1 else max(tied, key=lambda g: rendezvous(key, g))
        hit = held.get(gid, 0)
        self.window.add(gid, (n - hit) * self.block_size, live)
        if best_hit == 0:
            reason = "new_prefix"
        elif hit == best_hit:
            reason = "prefix_hit"
        else:
            reason = "spill"
        return Placement(gid, reason, hit)

    def _limits(self, held, best_hit, placed, mean) -> tuple[int, float, float]:
        """(min_hit, bound, high): a group is a candidate if it holds at least min_hit blocks and
        its placements are under the load bound, or it is one of a prefix's only holders and
        under the hit bound `high`.

        Replication by cost is bounded: once max_replicas groups hold at least half the longest
        match, only they are candidates. The least placed group is always under the bound. A
        prefix's only holders (at most hit_holders groups with its longest match), all over the
        bound, stay candidates up to the hit bound: diverting the request would recompute the
        prefix and store a second copy, while the bound is kept by the requests that cost
        nothing to place elsewhere (new prefixes, chats, a prefix with more holders)."""
        cfg = self.config
        min_hit = 0
        if best_hit > 0:
            half = (best_hit + 1) // 2  # 2 * hit >= best_hit
            holders = len([h for h in held.values() if h >= half])
            if holders >= (cfg.max_replicas or max(2, placed.live // 2)):
                min_hit = half
        if cfg.load_slack is None:
            return min_hit, math.inf, -math.inf
        bound = (1.0 + cfg.load_slack) * mean + cfg.load_burst
        if cfg.hit_slack is not None and best_hit > 0:
            best = [placed[g] for g, h in held.items() if h == best_hit]
            if len(best) <= cfg.hit_holders and min(best) >= bound:
                return min_hit, bound, (1.0 + cfg.hit_slack) * mean + cfg.load_burst
        return min_hit, bound, -math.inf

    def _lowest(self, n, rows, min_hit, bound, high) -> list[str]:
        """The candidates (see _limits) of lowest estimated cost in seconds of this `n`-block
        prompt, several on a tie (e.g. idle groups, a new prefix): its time to first token, plus
        the charges for recompute, eviction (scaled by the group's pressure: the uncached tokens
        sent there lately over the mean), neighbours and balance. `rows`: (statuses, held,
        placed, mean, best_hit), see `choose`.

        The groups with a hit are scored first. The rest (hit 0) all pay the same recompute, so
        none of them can cost less than `floor`, the whole prompt's prefill and recompute with
        the least placements of any group and no other charge; when a hit already costs less,
        they are not scored at all (every term is a sum of non-negative products, and rounding
        keeps the order, so the skipped cost more even in floating point). One loop with the
        constants hoisted out, the terms that only a status sets cached (`_status_terms`) and
        those that only the hit sets computed once per hit: at 64 groups it is most of a
        decision's time."""
        bs, ceil, (prefill_s, budget, recompute_w, eviction_w, unit) = self.block_size, math.ceil, self._constants  # fmt: skip
        half, (statuses, held, placed, mean, best_hit), live = bs // 2, rows, len(rows[0])
        placements, scale = placed.requests.get, placed.scale
        tokens, total = self.window.raw()[1], None  # total: sent lately, summed when needed
        terms, by_hit = self._terms, {}  # by_hit: hit blocks -> (new tokens, blocks, recompute)
        low, tied = math.inf, []
        todo = [(g, h) for g, h in held.items() if h >= min_hit]
        for rest in (False, True):
            if rest:  # the groups without a hit, if candidates and not all dearer
                new = n * bs + half
                floor = new * prefill_s + recompute_w * new * prefill_s + unit * (placed.least(statuses) - mean)  # fmt: skip
                if min_hit > 0 or floor > low:
                    break
                todo = [(g, 0) for g in statuses if g not in held]
            for g, h in todo:
                p = placements(g, 0.0) * scale
                if p >= bound and (h != best_hit or p >= high):
                    continue
                s = statuses[g]
                t = terms.get(g)
                if t is None or t[0] is not s:
                    t = terms[g] = self._status_terms(s)
                _, queued, step, room, neighbours = t
                if h not in by_hit:
                    new = (n - h) * bs + half
                    by_hit[h] = (new, ceil(new / bs), recompute_w * new * prefill_s)
                new, new_blocks, recompute = by_hit[h]
                work = queued + new
                cost = work * prefill_s + ceil(work / budget) * step + recompute  # ttft + recompute
                evicted = new_blocks - room
                if evicted > 0:  # else the eviction charge is 0
                    if total is None:  # pressure 1 for all when nothing was sent
                        total = sum(map(tokens.get, statuses, itertools.repeat(0.0)))
                    pressure = tokens.get(g, 0.0) * live / total if total > 0 else 1.0
                    cost += eviction_w * pressure * evicted * bs * prefill_s
                cost = cost + neighbours + unit * (p - mean)
                if cost < low:
                    low, tied = cost, [g]
                elif cost == low:
                    tied.append(g)
        if len(terms) > 2 * live + 16:  # forget groups that left
            self._terms = {g: t for g, t in terms.items() if g in statuses}
        return tied

    def _status_terms(self, s: GroupStatus) -> tuple[GroupStatus, int, float, int, float]:
        """(s, queued prefill tokens, seconds of a prefill step with its running decodes, empty
        blocks, neighbours' charge): the parts of a group's cost that only its status sets."""
        cfg, c = self.config, self.config.cost
        room = max(0, s.blocks_free - s.blocks_cached)  # no content, no reference: cached are taken
        neighbours = cfg.request_weight * (s.running + s.waiting) * cfg.decode_tokens * c.decode_seq_s  # fmt: skip
        return s, s.pending_prefill_tokens, c.step_s + s.running * c.decode_seq_s, room, neighbours


class _Placed:
    """A `GroupWindow`'s decayed placements for one decision: group g's is requests[g] * scale,
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
