"""When a shared index is out of reach: one warning per outage, retries with a growing wait, one
line when it is back. Every part that talks to Redis (a group's publisher, a router's failover
reader, the mirror's follower, the pending-placement writer) keeps its outage in one of these."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class Outage:
    """The state of one link to a shared index: up, or down until `retry_at`."""

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        retry_initial_s: float = 0.5,
        retry_max_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`what` names the link in the log lines (e.g. "prefix index for group-0")."""
        if not 0 < retry_initial_s <= retry_max_s:
            raise ValueError(f"retry times must satisfy 0 < initial <= max, got {retry_initial_s}, {retry_max_s}")
        self.log, self.what = log, what
        self.retry_initial_s, self.retry_max_s = retry_initial_s, retry_max_s
        self._clock = clock
        self.up = True
        self._retry_at = 0.0
        self._backoff = retry_initial_s

    def may_retry(self) -> bool:
        """Whether to try the link now: it is up, or its wait has passed."""
        return self.up or self._clock() >= self._retry_at

    def failed(self, error: BaseException, consequence: str) -> None:
        """A call failed: warn once per outage (saying what happens meanwhile) and wait longer
        before each next try, up to retry_max_s."""
        if self.up:
            self.log.warning("%s unavailable (%s); %s", self.what, error, consequence)
        self.up = False
        self._retry_at = self._clock() + self._backoff
        self._backoff = min(2 * self._backoff, self.retry_max_s)

    def recovered(self, detail: str = "") -> None:
        """A call succeeded: after an outage, say so once."""
        if not self.up:
            self.log.warning("%s is back%s", self.what, f"; {detail}" if detail else "")
        self.up = True
        self._backoff = self.retry_initial_s
