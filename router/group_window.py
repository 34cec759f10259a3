"""A router's recent placements per group, for the load bound of `prefix_aware`
(router/prefix_aware.py)."""

from __future__ import annotations


class GroupWindow:
    """Each group's part of a router's last ~`window` x (live groups) placements, exponentially
    decayed: the requests placed there and the prompt tokens they sent there uncached.

    Stored values are the decayed ones divided by the product of the decays so far, so a
    placement updates one entry instead of decaying every group's."""

    def __init__(self, window: int) -> None:
        self.window = window  # placements per live group
        self._scale = 1.0  # the product of the decays since the last renormalization
        self._requests: dict[str, float] = {}
        self._tokens: dict[str, float] = {}

    def add(self, group_id: str, new_tokens: int, live_groups: int = 1) -> None:
        """Count one placement on `group_id` that sends it `new_tokens` uncached tokens."""
        self._scale *= 1.0 - 1.0 / (self.window * max(1, live_groups))
        if self._scale < 1e-100:  # renormalize before the stored values overflow
            for counts in (self._requests, self._tokens):
                for g in counts:
                    counts[g] *= self._scale
            self._scale = 1.0
        self._requests[group_id] = self._requests.get(group_id, 0.0) + 1.0 / self._scale
        self._tokens[group_id] = self._tokens.get(group_id, 0.0) + new_tokens / self._scale

    def raw(self) -> tuple[dict[str, float], dict[str, float], float]:
        """(requests, tokens, scale): each group's stored placements and uncached tokens; a
        decayed count is the stored value times `scale`. Read-only views for one decision."""
        return self._requests, self._tokens, self._scale
