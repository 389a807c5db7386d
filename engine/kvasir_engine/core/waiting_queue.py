"""`WaitingQueue`: the scheduler's waiting requests, one FIFO per tenant, in one arrival order.

The fair share picks a tenant first and then that tenant's oldest request; FCFS picks the oldest
request of all. Both need each tenant's queue in order and the order across tenants, so every
request gets a sequence number when it is queued: appended ones count up at the back, preempted
ones (back to the front, as they have waited longest) count down at the front. Each tenant's
deque is then sorted, and the oldest request among some tenants is the smallest of their heads:
O(tenants) per pick, not O(requests).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator, KeysView
from operator import itemgetter

from kvasir_engine.core.request import Request


class WaitingQueue:
    def __init__(self) -> None:
        self._tenant_to_queue: dict[str, deque[tuple[int, Request]]] = {}
        self._num_requests = 0
        self._next_back = 0
        self._next_front = -1

    def __len__(self) -> int:
        return self._num_requests

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, oldest first (FCFS order across tenants)."""
        merged = heapq.merge(*self._tenant_to_queue.values(), key=itemgetter(0))
        return (request for _, request in merged)

    def __getitem__(self, index: int) -> Request:
        """The `index`-th request in FCFS order (O(requests): for inspection, not scheduling)."""
        found = next(itertools.islice(self, index, None), None)
        if index < 0 or found is None:
            raise IndexError(f"waiting queue index {index} out of range ({len(self)} requests)")
        return found

    @property
    def tenant_ids(self) -> KeysView[str]:
        """The tenants with at least one waiting request (the backlogged ones)."""
        return self._tenant_to_queue.keys()

    def num_waiting(self, tenant_id: str) -> int:
        queue = self._tenant_to_queue.get(tenant_id)
        return 0 if queue is None else len(queue)

    def add(self, request: Request, front: bool = False) -> bool:
        """Queue at the back (at the front: a preempted request). True if its tenant had none."""
        queue = self._tenant_to_queue.setdefault(request.tenant_id, deque())
        if front:
            queue.appendleft((self._next_front, request))
            self._next_front -= 1
        else:
            queue.append((self._next_back, request))
            self._next_back += 1
        self._num_requests += 1
        return len(queue) == 1

    def remove(self, request: Request) -> bool:
        """Take a request out (admitted or aborted). True if it was its tenant's last one."""
        queue = self._tenant_to_queue[request.tenant_id]
        index = next(i for i, (_, queued) in enumerate(queue) if queued is request)
        del queue[index]
        self._num_requests -= 1
        if queue:
            return False
        del self._tenant_to_queue[request.tenant_id]
        return True

    def first(self, tenant_ids: Iterable[str]) -> Request | None:
        """The oldest waiting request of these tenants (each must have one); None if none given."""
        heads = (self._tenant_to_queue[tenant_id][0] for tenant_id in tenant_ids)
        head = min(heads, key=itemgetter(0), default=None)
        return None if head is None else head[1]
