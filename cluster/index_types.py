"""What a prefix index answers: a group's load report and its match of a chain (shared by the
index backends, cluster/prefix_index.py, and the router's copy, cluster/index_copy.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import NamedTuple


@dataclass(frozen=True)
class GroupLoad:
    """A group's load at one engine step, as the router weighs it."""

    waiting_prefill_tokens: int  # prompt tokens admitted or queued but not yet computed
    running_seqs: int
    waiting_seqs: int
    free_blocks: int
    total_blocks: int
    timestamp: float = field(default_factory=time.time)  # wall clock (s) when measured

    def __post_init__(self) -> None:
        for name in ("waiting_prefill_tokens", "running_seqs", "waiting_seqs", "free_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.free_blocks <= self.total_blocks:
            raise ValueError(f"total_blocks must be >= free_blocks, got {self.total_blocks}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> GroupLoad:
        return cls(**json.loads(text))


class GroupMatch(NamedTuple):
    """What one live group holds of a queried chain. A named tuple: a match builds one per
    group it touches, at a quarter of a frozen dataclass's cost; `_replace` for a changed copy."""

    group_id: str
    epoch: int
    blocks: int  # leading blocks of the chain cached on the group
    pending_blocks: int  # leading blocks of the chain pending (recently placed) on the group
    load: GroupLoad | None  # latest load report; None until the group reports one

    @property
    def expected_blocks(self) -> int:
        """Leading blocks the group holds or is about to hold."""
        return max(self.blocks, self.pending_blocks)


class Matches(dict[str, GroupMatch]):
    """A match's answer: every live group's `GroupMatch` by id, and `touched`, the ids of those
    whose answer may hold or have pending a leading block (every other one answers 0 and 0).
    A policy reads the touched answers only: at 64 groups, reading all of them took ~20 us of
    a decision for the two dozen that hold a hot document."""

    __slots__ = ("touched",)

    def __init__(self, answers: Mapping[str, GroupMatch] | None = None, touched: Iterable[str] = ()) -> None:  # fmt: skip
        super().__init__(answers or ())
        self.touched: list[str] = list(touched)


def touched_ids(matches: Mapping[str, GroupMatch]) -> Sequence[str]:
    """The ids whose answer may have a hit: `touched` of a `Matches`, else every id."""
    return matches.touched if isinstance(matches, Matches) else list(matches)
