"""Where a block-hash chain is probed.

The prefix index keeps pending placements at a chain's probe positions only, and every match
(the Redis script, and the `IndexCopy` of the in-process index and of a router's mirror) looks
at those positions first, so that a 2048-block chain costs about a hundred lookups, not two
thousand. A chain hash covers every block before it, and a group's holdings stay prefix-closed
(the block manager frees a request's blocks tail first), which is what makes counting by probes
exact.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence

from worker.hashing import HashChain

# Pending placements are kept (and `RedisPrefixIndex.match` probes chains) at these positions.
PROBE_DENSE = 32  # every block up to here: short chains and gaps near the head are exact
PROBE_STRIDE = 32  # then every STRIDE-th block


@functools.lru_cache(maxsize=4096)
def probe_positions(n: int) -> tuple[int, ...]:
    """0-based positions of an n-block chain kept for pending placements and probed first by
    the Redis match: every block up to PROBE_DENSE, then every PROBE_STRIDE-th, then the last."""
    pos = list(range(min(n, PROBE_DENSE)))
    pos += range(PROBE_DENSE + PROBE_STRIDE - 1, n, PROBE_STRIDE)
    if n and pos[-1] != n - 1:
        pos.append(n - 1)
    return tuple(pos)


@functools.lru_cache(maxsize=4096)
def _probe_getter(n: int) -> Callable[[Sequence[bytes]], tuple[bytes, ...]]:
    pos = probe_positions(n)
    if len(pos) == 1:
        return lambda chain: (chain[0],)
    return operator.itemgetter(*pos)  # picks every probe in one C call


def prefix_length(n: int, holds: Callable[[int], bool]) -> int:
    """How many leading indices of range(n) satisfy `holds`, when those that do are a prefix
    (as along a chain: a chain hash covers every block before it), by binary search."""
    lo, hi = 0, n  # indices below lo hold; from hi on, none
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if holds(mid - 1):
            lo = mid
        else:
            hi = mid - 1
    return lo


def probe_hashes(chain: Sequence[bytes]) -> tuple[bytes, ...]:
    """The chain's hashes at `probe_positions(len(chain))`."""
    if isinstance(chain, HashChain):
        return chain.at(probe_positions(len(chain)))  # sliced from its bytes, no list built
    return _probe_getter(len(chain))(chain) if chain else ()
