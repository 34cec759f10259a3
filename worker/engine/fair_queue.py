"""The waiting queue of one group: first come first served (or by priority) within a tenant,
and among tenants by weighted fair share of the tokens the group processed for them.

Each tenant has a virtual token counter (Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024): the tokens the group computed for it (prompt chunks and decodes), divided by
its weight. The next request admitted is the head of the queue of the waiting tenant with the
lowest counter (on a tie, the earlier head), so a tenant sending ten times another's load
queues behind its own requests, not in front of the other's. A tenant that had nothing in the
group (neither waiting nor running) starts from the lowest counter among the tenants that have
when it sends again, so that idle time banks no credit. A request's
priority orders it within its tenant. With one tenant (every request's tenant ""), the queue is
exactly that tenant's FCFS or priority queue and nothing is counted.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator, Mapping

from worker.engine.request import Request


class TenantQueue:
    """One tenant's waiting requests: FCFS (preempted requests return to the front) or by
    (priority, arrival)."""

    def __init__(self, by_priority: bool) -> None:
        self.by_priority = by_priority
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()

    def push(self, request: Request, front: bool = False) -> None:
        if self.by_priority:
            heapq.heappush(self._heap, (*request.sort_key, next(self._tiebreak), request))
        elif front:
            self._fifo.appendleft(request)
        else:
            self._fifo.append(request)

    def peek(self) -> Request:
        return self._heap[0][-1] if self.by_priority else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1] if self.by_priority else self._fifo.popleft()

    def remove(self, request: Request) -> None:
        if self.by_priority:
            self._heap = [e for e in self._heap if e[-1] is not request]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(request)

    def __len__(self) -> int:
        return len(self._heap) if self.by_priority else len(self._fifo)

    def __iter__(self) -> Iterator[Request]:
        return (e[-1] for e in self._heap) if self.by_priority else iter(self._fifo)


class WaitingQueue:
    """The group's waiting requests, by tenant (see the module docstring)."""

    def __init__(self, by_priority: bool, weights: Mapping[str, float] | None = None) -> None:
        self.by_priority = by_priority
        self.weights = dict(weights or {})  # tenant -> weight (1 when not named)
        self._queues: dict[str, TenantQueue] = {"": TenantQueue(by_priority)}
        self._only = self._queues[""]  # the one tenant's queue while there is one
        self.served: dict[str, float] = {}  # tenant -> tokens processed / weight
        self._in_group: dict[str, int] = {}  # tenant -> its requests waiting or running
        self._len = 0

    @property
    def fair(self) -> bool:
        """Whether more than one tenant has sent requests (only then are tokens counted)."""
        return self._only is None

    def push(self, request: Request, front: bool = False) -> None:
        """Queue a new request, or (`front`) one preempted, first in its tenant's order."""
        tenant = request.tenant
        q = self._queues.get(tenant)
        if q is None:
            q = self._queues[tenant] = TenantQueue(self.by_priority)
            self._only = None
        if not front:
            was = self._in_group.get(tenant, 0)
            self._in_group[tenant] = was + 1
            if not was and self._only is None:  # back from idle: no banked credit
                busy = [self.served.get(t, 0.0) for t, k in self._in_group.items() if k and t != tenant]
                if busy and self.served.get(tenant, 0.0) < min(busy):
                    self.served[tenant] = min(busy)
        q.push(request, front)
        self._len += 1

    def left(self, tenant: str) -> None:
        """One of `tenant`'s requests left the group (finished or aborted, waiting or not)."""
        self._in_group[tenant] -= 1

    def _next(self) -> TenantQueue:
        """The queue of the backlogged tenant furthest under its share (IndexError: none)."""
        if self._only is not None:
            if not self._only:
                raise IndexError("the waiting queue is empty")
            return self._only
        served = self.served
        best, low = None, (0.0, 0.0)
        for tenant, q in self._queues.items():
            if q:
                key = (served.get(tenant, 0.0), q.peek().arrival_time)
                if best is None or key < low:
                    best, low = q, key
        if best is None:
            raise IndexError("the waiting queue is empty")
        return best

    def peek(self) -> Request:
        return self._next().peek()

    def pop(self) -> Request:
        request = self._next().pop()
        self._len -= 1
        return request

    def remove(self, request: Request) -> None:
        self._queues[request.tenant].remove(request)
        self._len -= 1

    def charge(self, tenant: str, tokens: int) -> None:
        """Count `tokens` processed for `tenant` against its share."""
        self.served[tenant] = self.served.get(tenant, 0.0) + tokens / self.weights.get(tenant, 1.0)

    def backlogs(self) -> list[tuple[str, int]]:
        """(tenant, its waiting requests) of each tenant with some, the one furthest under its
        share first."""
        served = self.served.get
        busy = [(t, len(q)) for t, q in self._queues.items() if q]
        return sorted(busy, key=lambda e: (served(e[0], 0.0), self._queues[e[0]].peek().arrival_time))

    def active_tenants(self) -> set[str]:
        """The tenants with requests in the group (waiting or running)."""
        return {t for t, k in self._in_group.items() if k}

    def counter(self, tenant: str) -> float:
        """`tenant`'s tokens processed over its weight (0 while only one tenant sends):
        preemption takes from the tenant furthest over its share first."""
        return self.served.get(tenant, 0.0)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        for q in self._queues.values():
            yield from q
