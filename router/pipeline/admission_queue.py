"""The admission wait queue: most urgent first, aging so nothing starves, fair between tenants.

A waiter's **class** is its priority (lower is more urgent, vLLM's convention; clamped to
``-MAX_PRIORITY..MAX_PRIORITY``) plus the number of whole ``aging_s`` periods elapsed on the
queue's clock when it arrived. All waiters age together, so this is ``priority - floor(waited /
aging_s)`` compared at any instant, to within one level (the periods are counted on a grid, not
from each arrival), and the key never changes while it waits: no re-keying. A waiter that waited
``(p - q + 1) * aging_s`` longer than one of priority ``q < p`` goes first.

Within the most urgent class, the **tenant** with the smallest virtual counter goes first
(weighted fair queueing with virtual counters): a tenant's counter grows by ``units / weight``
each time one of its waiters is admitted, and a tenant that starts waiting again is lifted to
the largest counter a tenant was admitted at, so it gets no credit for the time it was idle. Within
a tenant (and class), the earliest **deadline** goes first, then the earliest arrival. Requests
without a tenant are one anonymous tenant (``""``).

Structure: class -> tenant -> heap of ``(deadline, arrival sequence, waiter)``, and a heap of
the classes. A waiter that leaves is dropped lazily (marked, skipped when it reaches a head; the
heaps are rebuilt when such entries outnumber the live ones), so the queue's memory stays within
twice ``max_queued_requests``. Picking the next waiter is O(log n + tenants in the best class);
finding the least urgent (to shed it when the queue is full) is a scan, done only then.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router.observability.metrics import PRIORITY_BANDS

__all__ = [
    "ANONYMOUS",
    "MAX_PRIORITY",
    "NORMAL",
    "PRIORITY_BANDS",
    "Urgency",
    "WaitQueue",
    "Waiter",
]

MAX_PRIORITY = 8  # priorities are clamped to -8..8 for the queue's order (forwarded as given)
ANONYMOUS = ""  # the tenant of requests without one
_COMPACT_MIN = 64  # stale entries tolerated before the heaps are rebuilt


@dataclass(slots=True, frozen=True)
class Urgency:
    """What a request tells the gate about itself: its ``priority`` (lower is more urgent),
    ``deadline_s`` (how long it may wait; None: the queue timeout), its ``tenant`` and that
    tenant's fairness ``weight``."""

    priority: int = 0
    deadline_s: float | None = None
    tenant: str = ANONYMOUS
    weight: float = 1.0


NORMAL = Urgency()


@dataclass(slots=True, eq=False)
class Waiter:
    """One queued request."""

    future: asyncio.Future[None]
    units: int
    urgency: Urgency
    cls: int = 0
    seq: int = 0
    deadline: float = math.inf  # on the queue's clock
    queued_at: float = 0.0
    band: int = 1
    gone: bool = False  # left the queue (admitted, shed, gave up): skipped at a head


@dataclass(slots=True)
class _Tenant:
    counter: float = 0.0  # virtual: units admitted / weight
    waiting: int = 0


@dataclass(slots=True)
class WaitQueue:
    """The waiters; ``size`` live ones, ``by_band`` of them per PRIORITY_BANDS."""

    aging_s: float
    clock: Callable[[], float] = time.monotonic
    size: int = 0
    by_band: list[int] = field(default_factory=lambda: [0, 0, 0])
    _classes: dict[int, dict[str, list[tuple[float, int, Waiter]]]] = field(default_factory=dict)
    _class_heap: list[int] = field(default_factory=list)
    _tenants: dict[str, _Tenant] = field(default_factory=dict)
    _virtual: float = 0.0  # the largest counter a tenant was admitted at
    _seq: int = 0
    _stale: int = 0
    _origin: float = field(default=0.0)

    def __post_init__(self) -> None:
        self._origin = self.clock()

    def waiter(self, future: asyncio.Future[None], units: int, urgency: Urgency) -> Waiter:
        """A waiter for ``future`` as it would be queued now (not queued yet)."""
        now = self.clock()
        priority = max(-MAX_PRIORITY, min(MAX_PRIORITY, urgency.priority))
        self._seq += 1
        deadline = math.inf if urgency.deadline_s is None else now + urgency.deadline_s
        band = 0 if priority < 0 else 1 if priority == 0 else 2
        cls = self._class_of(priority, now)
        return Waiter(future, units, urgency, cls, self._seq, deadline, now, band)

    def waiting_by_tenant(self) -> dict[str, int]:
        """The live waiters of each tenant that has some (``ANONYMOUS``: those without one)."""
        return {name: tenant.waiting for name, tenant in self._tenants.items() if tenant.waiting}

    def position(self, urgency: Urgency, units: int = 1) -> int:
        """How many of the waiters would be admitted before a request of ``urgency`` (taking
        ``units``) that arrived now: the queue's order played out on a copy of its counters
        (``first``, ``admit``), assuming no later arrivals and nobody leaving. A scan of the
        queue, for ``/admin/explain``."""
        now = self.clock()
        cls = self._class_of(max(-MAX_PRIORITY, min(MAX_PRIORITY, urgency.priority)), now)
        deadline = math.inf if urgency.deadline_s is None else now + urgency.deadline_s
        counters = {name: tenant.counter for name, tenant in self._tenants.items()}
        virtual = self._virtual
        own = self._tenants.get(urgency.tenant)
        if own is None or not own.waiting:
            counters[urgency.tenant] = max(counters.get(urgency.tenant, virtual), virtual)
        probe = (deadline, self._seq + 1, units, urgency.weight)
        ahead = 0
        for waiter_cls in sorted(c for c in self._classes if c <= cls):
            tenants = {
                name: sorted(
                    (e[0], e[1], e[2].units, e[2].urgency.weight) for e in heap if not e[2].gone
                )
                for name, heap in self._classes[waiter_cls].items()
            }
            if waiter_cls == cls:
                tenants.setdefault(urgency.tenant, []).append(probe)
                tenants[urgency.tenant].sort()
            tenants = {name: entries for name, entries in tenants.items() if entries}
            while tenants:
                name = min(tenants, key=counters.__getitem__)  # the first of equals, as first()
                entry = tenants[name].pop(0)
                if entry is probe:
                    return ahead
                virtual = max(virtual, counters[name])
                counters[name] += entry[2] / entry[3]
                ahead += 1
                if not tenants[name]:
                    del tenants[name]
        return ahead

    def _class_of(self, priority: int, now: float) -> int:
        """A (clamped) priority's class for a waiter arriving at ``now``: aged by the whole
        ``aging_s`` periods since the queue's origin."""
        aged = int((now - self._origin) // self.aging_s) if self.aging_s > 0 else 0
        return priority + aged

    def push(self, waiter: Waiter) -> None:
        tenants = self._classes.get(waiter.cls)
        if tenants is None:
            tenants = self._classes[waiter.cls] = {}
            heapq.heappush(self._class_heap, waiter.cls)
        name = waiter.urgency.tenant
        heapq.heappush(tenants.setdefault(name, []), (waiter.deadline, waiter.seq, waiter))
        tenant = self._tenants.get(name)
        if tenant is None:
            tenant = self._tenants[name] = _Tenant(self._virtual)
        elif not tenant.waiting:  # no credit for the time it was idle
            tenant.counter = max(tenant.counter, self._virtual)
        tenant.waiting += 1
        self.size += 1
        self.by_band[waiter.band] += 1

    def first(self) -> Waiter | None:
        """The waiter to admit next: the most urgent class, its tenant with the smallest
        counter, that tenant's earliest deadline, then arrival."""
        while self._class_heap:
            cls = self._class_heap[0]
            tenants = self._classes.get(cls)
            best: list[tuple[float, int, Waiter]] | None = None
            best_counter = math.inf
            for name, heap in list(tenants.items()) if tenants else ():
                while heap and heap[0][2].gone:
                    heapq.heappop(heap)
                    self._stale -= 1
                if not heap:
                    del tenants[name]  # type: ignore[union-attr]
                elif (counter := self._tenants[name].counter) < best_counter:
                    best, best_counter = heap, counter
            if best is not None:
                return best[0][2]
            self._classes.pop(cls, None)
            heapq.heappop(self._class_heap)
        return None

    def admit(self, waiter: Waiter) -> float:
        """Take ``waiter`` (``first()``) out as admitted, charge its tenant; its wait, s."""
        tenant = self._tenants[waiter.urgency.tenant]
        self._virtual = max(self._virtual, tenant.counter)  # never backwards
        tenant.counter += waiter.units / waiter.urgency.weight
        self._leave(waiter)
        return self.clock() - waiter.queued_at

    def remove(self, waiter: Waiter) -> None:
        """Take ``waiter`` out (it gave up or was shed); idempotent."""
        if not waiter.gone:
            self._leave(waiter)

    def least_urgent(self) -> Waiter | None:
        """The waiter to shed first: the least urgent class, its tenant with the largest
        counter, that tenant's latest deadline, then arrival (a scan: only when full)."""
        for cls in sorted(self._classes, reverse=True):
            live = [
                (self._tenants[name].counter, entry)
                for name, heap in self._classes[cls].items()
                for entry in heap
                if not entry[2].gone
            ]
            if live:
                return max(live, key=lambda item: (item[0], item[1][:2]))[1][2]
        return None

    def _leave(self, waiter: Waiter) -> None:
        waiter.gone = True
        self._stale += 1
        self.size -= 1
        self.by_band[waiter.band] -= 1
        name = waiter.urgency.tenant
        tenant = self._tenants[name]
        tenant.waiting -= 1
        if not tenant.waiting and tenant.counter <= self._virtual:
            del self._tenants[name]  # nothing owed: forget it
        if self._stale > max(_COMPACT_MIN, self.size):
            self._compact()

    def _compact(self) -> None:
        """Rebuild the heaps without the entries of waiters that left."""
        classes: dict[int, dict[str, list[tuple[float, int, Waiter]]]] = {}
        for cls, tenants in self._classes.items():
            for name, heap in tenants.items():
                live = [entry for entry in heap if not entry[2].gone]
                if live:
                    heapq.heapify(live)
                    classes.setdefault(cls, {})[name] = live
        self._classes = classes
        self._class_heap = sorted(classes)
        self._stale = 0
