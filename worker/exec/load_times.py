"""How long a rank's restores took: a histogram of load latencies per tier, for the metrics.

A restore from the host tier is the copy of a step's loads into the pool (host -> device); one
from the disk tier is the read of a fetch's block files into host slots (disk -> host). Rank
0's are reported in the engine's stats (worker/engine/llm_engine.py) and exported as a
Prometheus histogram (router/door/cluster_metrics.py). Cumulative bucket counts, as
Prometheus keeps them, so that a scrape of a process's stats needs no arithmetic.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# upper bounds, seconds: a few blocks' copy on a GPU (~10 us) to a long document read from disk
LOAD_BUCKETS_S = (1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


@dataclass
class LoadTimes:
    """Latencies of one tier's loads: counts per bucket of `LOAD_BUCKETS_S` (and +Inf)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS_S) + 1))
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LOAD_BUCKETS_S, seconds)] += 1
        self.total_s += seconds

    def as_dict(self) -> dict:
        """{"buckets": [(upper bound, cumulative count)...], "sum": seconds, "count": loads},
        the last bound +Inf: what a Prometheus histogram family takes."""
        cumulative, running = [], 0
        for bound, n in zip((*LOAD_BUCKETS_S, float("inf")), self.counts, strict=True):
            running += n
            cumulative.append((bound, running))
        return {"buckets": cumulative, "sum": self.total_s, "count": running}
