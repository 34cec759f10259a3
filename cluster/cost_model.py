"""How long one engine step takes, as a group's placement weighs it and the simulation runs it:
a fixed cost, a cost per prefill token and one per decoding sequence, fitted to measured steps
(benchmarks/routing.py --calibrate); and what a restore from a KV tier under the pool costs
instead of recomputing (a block copied up from host memory, or read from disk first), from
the real engine's restore time per block (benchmarks/kv_tiers.py)."""

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

    def __post_init__(self) -> None:
        for name in ("step_s", "prefill_token_s", "decode_seq_s", "load_block_s", "fetch_block_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, loads: int = 0, fetches: int = 0) -> float:
        """`loads`: blocks restored from the host tier in the step; `fetches`: of which read
        from the disk first."""
        seconds = self.step_s + self.prefill_token_s * prefill_tokens + self.decode_seq_s * decode_seqs
        return seconds + self.load_block_s * loads + self.fetch_block_s * fetches

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]]) -> CostModel:
        """Least squares over (prefill tokens, decoding sequences, seconds) step samples."""
        import numpy as np  # only the calibration needs it

        a = np.array([[1.0, p, d] for p, d, _ in samples])
        y = np.array([s for _, _, s in samples])
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        return cls(*(max(0.0, float(c)) for c in coef))
