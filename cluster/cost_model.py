"""How long one engine step takes, as a group's placement weighs it and the simulation runs it:
a fixed cost, a cost per prefill token and one per decoding sequence, fitted to measured steps
(benchmarks/routing.py --calibrate); and what a restore from a KV tier under the pool costs
instead of recomputing (a block copied up from host memory, or read from disk first), from
the real engine's restore time per block (benchmarks/kv_tiers.py); and what a pull of blocks
from another group costs (a link's latency plus the blocks' bytes over its bandwidth, one link
within a node, one across nodes), timed by benchmarks/routing.py --calibrate over the transport
the groups use. Uncalibrated, the defaults are this project's CPU figures (benchmarks/RESULTS.md,
"KV pull between groups": 125 built-in blocks, 3.9 MiB, 20 ms in process, 49 ms over Ray's
object store between two nodes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    """Seconds of one engine step: step_s + prefill_token_s * prefill tokens
    + decode_seq_s * decoding sequences (a least-squares fit to measured steps)."""

    step_s: float = 2e-3
    prefill_token_s: float = 5e-5
    decode_seq_s: float = 2e-4
    load_block_s: float = 0.0  # one block copied from the host tier into the pool
    fetch_block_s: float = 0.0  # one block read from the disk tier into the host's
    # a pull from another group: latency (seconds, the round trips and the two engines' steps
    # it waits for) + bytes / bandwidth (bytes a second), within a node and across nodes
    pull_latency_s: float = 5e-3
    pull_bandwidth: float = 2.5e8
    remote_pull_latency_s: float = 2e-2
    remote_pull_bandwidth: float = 1.4e8
    block_bytes: int = 32768  # one block's KV (all layers, K and V) on the wire

    def __post_init__(self) -> None:
        for name in (
            "step_s",
            "prefill_token_s",
            "decode_seq_s",
            "load_block_s",
            "fetch_block_s",
            "pull_latency_s",
            "remote_pull_latency_s",
            "block_bytes",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("pull_bandwidth", "remote_pull_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, loads: int = 0, fetches: int = 0) -> float:
        """`loads`: blocks restored from the host tier in the step; `fetches`: of which read
        from the disk first."""
        seconds = self.step_s + self.prefill_token_s * prefill_tokens + self.decode_seq_s * decode_seqs
        return seconds + self.load_block_s * loads + self.fetch_block_s * fetches

    def pull_seconds(self, blocks: int, same_node: bool = True) -> float:
        """Seconds to pull `blocks` blocks from another group (none: 0): the link's latency plus
        their bytes over its bandwidth, within a node or across nodes."""
        if blocks <= 0:
            return 0.0
        if same_node:
            return self.pull_latency_s + blocks * self.block_bytes / self.pull_bandwidth
        return self.remote_pull_latency_s + blocks * self.block_bytes / self.remote_pull_bandwidth

    def recompute_seconds(self, tokens: int) -> float:
        """Seconds of prefill for `tokens` tokens a group computes instead of getting them."""
        return tokens * self.prefill_token_s

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]]) -> CostModel:
        """Least squares over (prefill tokens, decoding sequences, seconds) step samples."""
        import numpy as np  # only the calibration needs it

        a = np.array([[1.0, p, d] for p, d, _ in samples])
        y = np.array([s for _, _, s in samples])
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        step_s, prefill_token_s, decode_seq_s = (max(0.0, float(c)) for c in coef)
        return cls(step_s, prefill_token_s, decode_seq_s)

    @staticmethod
    def fit_link(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
        """(latency s, bandwidth bytes/s) of a link, least squares over (bytes, seconds) pull
        samples of at least two sizes: seconds = latency + bytes / bandwidth."""
        import numpy as np

        a = np.array([[1.0, b] for b, _ in samples])
        y = np.array([s for _, s in samples])
        (latency, per_byte), *_ = np.linalg.lstsq(a, y, rcond=None)
        return max(0.0, float(latency)), 1.0 / max(float(per_byte), 1e-12)
