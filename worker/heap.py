"""The garbage collector's policy in a process that runs an engine or a server.

Once loaded, everything built so far (the model, the pool, the tokenizer, the groups) lives as
long as the process: `gc.freeze` hides it from the collector, so that a full collection no
longer walks it (it would pause a step). Then, a step makes a few objects per running request
(its scheduled share, its output): with many running, the collector's default (a young
collection every 700 net allocations) runs several times a step and promotes the outputs still
held by the caller, a part of the engine's own time per step (benchmarks/RESULTS.md, "One
output object per request and step"). A young collection every 50,000 allocations, as servers
commonly set it, runs once in many steps. Reference counting frees everything acyclic at once either way; only
cyclic garbage waits longer.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000  # net allocations between two young collections (CPython's: 700)


def settle_heap(young_threshold: int = YOUNG_THRESHOLD) -> None:
    """Collect, freeze what exists (it lives as long as the process), and collect the young
    generation less often. Call once the process has loaded what it serves with."""
    gc.collect()
    gc.freeze()
    young, older, oldest = gc.get_threshold()
    gc.set_threshold(max(young_threshold, young), older, oldest)
