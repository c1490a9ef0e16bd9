"""Scheduling policies: the order of the waiting queue and the choice of preemption victim.

A policy owns the waiting queue. Adding a policy: write a class and register it in
``make_policy`` (the slo policy, with its step-time model, lives in slo.py).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Any, ClassVar

from iterserve.config import SchedulerConfig
from iterserve.core.outputs import SchedulerOutput
from iterserve.core.request import Request


class Policy:
    """Base: FCFS order, newest-first victims, no preemption to admit."""

    name: ClassVar[str] = "base"

    def __init__(self, config: SchedulerConfig) -> None:
        self.max_preemptions = config.max_preemptions_per_request

    # -- waiting queue -------------------------------------------------------------
    def add(self, request: Request) -> None:
        raise NotImplementedError

    def push_front(self, request: Request) -> None:
        """A preempted request returns ahead of the requests that arrived after it."""
        raise NotImplementedError

    def peek(self) -> Request | None:
        raise NotImplementedError

    def pop(self) -> Request:
        raise NotImplementedError

    def remove(self, request: Request) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Request]:
        raise NotImplementedError

    def backfill_candidates(self, limit: int) -> list[Request]:
        """Up to ``limit`` waiting requests behind the head, in policy order (for
        backfill; heap policies sort the top of their heap, so the order is exact
        for the best ``limit`` and the cost is bounded)."""
        head = self.peek()
        out: list[Request] = []
        for r in self:
            if r is not head:
                out.append(r)
                if len(out) >= limit:
                    break
        return out

    # -- per-step hooks (for policies that plan the step: slo) ---------------------
    def begin_step(
        self, now: float, num_running: int, max_budget: int, num_prefill_pending: int
    ) -> int:
        """Called at the start of schedule() (``num_prefill_pending``: prompt tokens the
        running requests still had to prefill at the last step); returns this step's
        token budget."""
        return max_budget

    def can_admit(self, request: Request, num_running: int) -> bool:
        """Whether ``request`` may join a running set of ``num_running`` now."""
        return True

    def check_admission(self, request: Request) -> None:
        """add_request: raise (AdmissionRefused) to refuse ``request`` outright."""

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The step ``out`` took ``seconds`` (measured by the engine, or simulated)."""

    # -- running set hooks (for policies that count what runs) ---------------------
    def on_start(self, request: Request) -> None:
        """``request`` entered the running set."""

    def on_stop(self, request: Request) -> None:
        """``request`` left the running set (finished or preempted)."""

    # -- preemption ----------------------------------------------------------------
    def rank(self, request: Request) -> tuple[Any, ...]:
        """Smaller is better: the victim is the running request with the largest rank."""
        return (request.arrival_time,)

    def select_victim(self, running: list[Request]) -> Request | None:
        """The worst-ranked running request that has not hit the preemption bound;
        if all have, the worst-ranked of all (someone must yield or nothing moves)."""
        if not running:
            return None
        eligible = [r for r in running if r.num_preemptions < self.max_preemptions]
        return max(eligible or running, key=self.rank)

    def should_preempt_to_admit(self, waiting: Request, victim: Request) -> bool:
        return False


class FCFSPolicy(Policy):
    name = "fcfs"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self.queue.append(request)

    def push_front(self, request: Request) -> None:
        self.queue.appendleft(request)

    def peek(self) -> Request | None:
        return self.queue[0] if self.queue else None

    def pop(self) -> Request:
        return self.queue.popleft()

    def remove(self, request: Request) -> None:
        self.queue.remove(request)

    def __len__(self) -> int:
        return len(self.queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.queue)

    def backfill_candidates(self, limit: int) -> list[Request]:
        return list(itertools.islice(self.queue, 1, 1 + limit))


class HeapPolicy(Policy):
    """A waiting queue ordered by a static key, with O(log n) lazy deletion.

    Keys never change while a request waits, so a heap stays valid; aging is
    expressed as a static key too (see AgingPolicy).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.heap: list[list[Any]] = []
        self.entries: dict[str, list[Any]] = {}
        self.counter = itertools.count()

    def key(self, request: Request) -> tuple[Any, ...]:
        raise NotImplementedError

    def rank(self, request: Request) -> tuple[Any, ...]:
        return self.key(request)

    def add(self, request: Request) -> None:
        entry = [*self.key(request), next(self.counter), request]
        self.entries[request.request_id] = entry
        heapq.heappush(self.heap, entry)

    def rekey(self, request: Request) -> None:
        """Give a waiting request a new place (its key changed)."""
        self.entries[request.request_id][-1] = None
        self.add(request)

    def push_front(self, request: Request) -> None:
        # A preempted request's key already places it before later arrivals of its class.
        # (A method, not ``push_front = add``: mypyc's vtable ignores class-level aliases.)
        self.add(request)

    def _clean(self) -> None:
        heap = self.heap
        while heap and heap[0][-1] is None:
            heapq.heappop(heap)

    def peek(self) -> Request | None:
        self._clean()
        return self.heap[0][-1] if self.heap else None

    def pop(self) -> Request:
        self._clean()
        request: Request = heapq.heappop(self.heap)[-1]
        del self.entries[request.request_id]
        return request

    def remove(self, request: Request) -> None:
        entry = self.entries.pop(request.request_id)
        entry[-1] = None

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[Request]:
        return (e[-1] for e in self.entries.values())

    def backfill_candidates(self, limit: int) -> list[Request]:
        # The top levels of the heap hold its best entries: sort 2 * limit of them.
        top = sorted(e for e in self.heap[: 2 * limit + 1] if e[-1] is not None)
        return [e[-1] for e in top[1 : limit + 1]]


class PriorityPolicy(HeapPolicy):
    """Lower ``priority`` value first, ties by arrival; a better request preempts the
    worst running one when memory is full."""

    name = "priority"

    def key(self, request: Request) -> tuple[Any, ...]:
        return (request.priority, request.arrival_time)

    def should_preempt_to_admit(self, waiting: Request, victim: Request) -> bool:
        return bool(self.key(waiting)[0] < self.key(victim)[0])


class SJFPolicy(HeapPolicy):
    """Shortest job first by what the scheduler may know: prompt length + max_tokens
    (true output lengths are unknown until EOS)."""

    name = "sjf"

    def key(self, request: Request) -> tuple[Any, ...]:
        return (request.num_prompt_tokens + request.max_tokens, request.arrival_time)


class AgingPolicy(HeapPolicy):
    """Priority (or SJF) whose effective value improves by ``aging_rate`` per second
    waited, so nothing starves.

    effective(now) = base - rate * (now - arrival) = (base + rate * arrival) - rate * now;
    the last term is common to all requests, so ``base + rate * arrival`` orders the
    queue at every instant and the key never has to be recomputed.
    """

    name = "aging"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.rate = config.aging_rate
        self.base_is_priority = config.aging_base == "priority"

    def key(self, request: Request) -> tuple[Any, ...]:
        if self.base_is_priority:
            base = request.priority
        else:
            base = request.num_prompt_tokens + request.max_tokens
        return (base + self.rate * request.arrival_time, request.arrival_time)

    def should_preempt_to_admit(self, waiting: Request, victim: Request) -> bool:
        return self.base_is_priority and self.key(waiting)[0] < self.key(victim)[0] - 1e-9


class FairSharePolicy(Policy):
    """Weighted fair share across tenants: the next admission goes to the waiting
    tenant with the fewest running requests per unit weight, so under contention each
    tenant's running share converges to its weight; victims come from the tenant most
    over its share (its newest request)."""

    name = "fair"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.weights = dict(config.tenant_weights)
        self.queues: dict[str, deque[Request]] = {}
        self.num_running: dict[str, int] = {}
        self.num_waiting = 0
        self._next_tenant: str | None = None

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def add(self, request: Request) -> None:
        self.queues.setdefault(request.tenant, deque()).append(request)
        self.num_waiting += 1

    def push_front(self, request: Request) -> None:
        self.queues.setdefault(request.tenant, deque()).appendleft(request)
        self.num_waiting += 1

    def _share(self, tenant: str) -> float:
        return self.num_running.get(tenant, 0) / self.weight(tenant)

    def peek(self) -> Request | None:
        best: tuple[Any, ...] | None = None
        for tenant, queue in self.queues.items():
            if queue:
                cand = (self._share(tenant), queue[0].arrival_time, tenant)
                if best is None or cand < best:
                    best = cand
        if best is None:
            return None
        self._next_tenant = best[2]
        return self.queues[best[2]][0]

    def pop(self) -> Request:
        if self._next_tenant is None:
            self.peek()
        request = self.queues[self._next_tenant].popleft()  # type: ignore[index]
        self._next_tenant = None
        self.num_waiting -= 1
        return request

    def remove(self, request: Request) -> None:
        self.queues[request.tenant].remove(request)
        self.num_waiting -= 1
        self._next_tenant = None

    def __len__(self) -> int:
        return self.num_waiting

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain.from_iterable(self.queues.values())

    def on_start(self, request: Request) -> None:
        self.num_running[request.tenant] = self.num_running.get(request.tenant, 0) + 1

    def on_stop(self, request: Request) -> None:
        self.num_running[request.tenant] -= 1

    def rank(self, request: Request) -> tuple[Any, ...]:
        return (self._share(request.tenant), request.arrival_time)


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (FCFSPolicy, PriorityPolicy, SJFPolicy, AgingPolicy, FairSharePolicy)
}


def make_policy(config: SchedulerConfig, block_size: int = 16) -> Policy:
    if config.scheduling_policy == "slo":
        from iterserve.core.slo import SLOPolicy

        return SLOPolicy(config, block_size)
    try:
        return POLICIES[config.scheduling_policy](config)
    except KeyError:
        raise ValueError(
            f"scheduling_policy must be one of {', '.join(POLICIES)}, slo, "
            f"got {config.scheduling_policy!r}"
        ) from None
