"""Where a block-hash chain is probed, and how many of its leading blocks pass a test.

The prefix index keeps pending placements at a chain's probe positions only, and both matches
(the Redis script and a router's mirror of it) look at those positions first, so that a
2048-block chain costs about a hundred lookups, not two thousand. A chain hash covers every block
before it, and a group's holdings stay prefix-closed (the block manager frees a request's blocks
tail first), which is what makes counting by probes exact.
"""

from __future__ import annotations

import functools
import itertools
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


def probe_hashes(chain: Sequence[bytes]) -> tuple[bytes, ...]:
    """The chain's hashes at `probe_positions(len(chain))`."""
    if isinstance(chain, HashChain):
        return chain.at(probe_positions(len(chain)))  # sliced from its bytes, no list built
    return _probe_getter(len(chain))(chain) if chain else ()


def leading_count(chain: Sequence[bytes], holds: Callable[[bytes], bool]) -> int:
    """How many leading hashes of `chain` satisfy `holds`; the first miss ends the count."""
    # takewhile + a bound method + list run the loop in C: ~50 ns a hash instead of ~100.
    return len(list(itertools.takewhile(holds, chain)))


def leading_unexpired(chain: Sequence[bytes], deadlines: dict[bytes, float], now: float) -> int:
    """How many leading hashes of `chain` have a deadline in `deadlines` later than `now`."""
    n = leading_count(chain, deadlines.__contains__)
    if n and min(map(deadlines.__getitem__, chain[:n])) > now:
        return n  # the usual case: nothing expired among them, checked at C speed
    return leading_count(chain, lambda h: deadlines.get(h, 0.0) > now)
