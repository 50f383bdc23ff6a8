"""The admission wait queue: most urgent first, aging so nothing starves, fair between tenants.

A waiter's **class** is its priority (lower is more urgent, vLLM's convention; clamped to
``-MAX_PRIORITY..MAX_PRIORITY``). The next waiter comes from the class that is most urgent
*now*: a class counts as ``priority - waited / aging_s``, where ``waited`` is how long its oldest
waiter has waited (exact, not on a grid), so a class whose oldest waiter has waited ``(p - q) *
aging_s`` longer than the other's oldest goes before a class of priority ``q < p``, and a waiter
of any priority is served once it waited long enough. Aging moves whole classes, never one
waiter past others of its own class: a tenant's backlog never jumps ahead of another tenant's
newer requests of the same priority.

Within the class, the **tenant** with the smallest virtual counter goes first (weighted fair
queueing with virtual counters): a tenant's counter grows by ``units / weight`` each time one of
its waiters is admitted, and a tenant that starts waiting again is lifted to the largest counter
a tenant was admitted at, so it gets no credit for the time it was idle. Within a tenant (and
class), the earliest **deadline** goes first, then the earliest arrival. Requests without a
tenant are one anonymous tenant (``""``).

Structure: per class, tenant -> heap of ``(deadline, arrival sequence, waiter)`` and the
class's waiters in arrival order (its oldest: its age). A waiter that leaves is dropped lazily
(marked, skipped when it reaches a head; the heaps are rebuilt when such entries outnumber the
live ones), so the queue's memory stays within twice ``max_queued_requests``. Picking the next
waiter is O(classes + tenants in the class + log n), classes being at most ``2 * MAX_PRIORITY
+ 1``; finding the least urgent (to shed it when the queue is full: the largest priority, its
tenant with the largest counter, that tenant's latest deadline) is a scan, done only then.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

from router.interrupt import ClientDisconnected
from router.observability.metrics import PRIORITY_BANDS

__all__ = [
    "ANONYMOUS",
    "await_turn",
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


Entry = tuple[float, int, Waiter]  # (deadline, arrival sequence, waiter): a tenant's heap order


@dataclass(slots=True)
class _Class:
    """The waiters of one priority: by tenant (heaps), and in arrival order (its age)."""

    tenants: dict[str, list[Entry]] = field(default_factory=dict)
    arrivals: deque[Waiter] = field(default_factory=deque)


@dataclass(slots=True)
class WaitQueue:
    """The waiters; ``size`` live ones, ``by_band`` of them per PRIORITY_BANDS."""

    aging_s: float
    clock: Callable[[], float] = time.monotonic
    size: int = 0
    by_band: list[int] = field(default_factory=lambda: [0, 0, 0])
    _classes: dict[int, _Class] = field(default_factory=dict)
    _tenants: dict[str, _Tenant] = field(default_factory=dict)
    _virtual: float = 0.0  # the largest counter a tenant was admitted at
    _seq: int = 0
    _stale: int = 0  # entries of waiters that left, still in the heaps
    _stale_arrivals: int = 0  # ... still in the arrival lists

    def waiter(self, future: asyncio.Future[None], units: int, urgency: Urgency) -> Waiter:
        """A waiter for ``future`` as it would be queued now (not queued yet)."""
        now = self.clock()
        priority = max(-MAX_PRIORITY, min(MAX_PRIORITY, urgency.priority))
        self._seq += 1
        deadline = math.inf if urgency.deadline_s is None else now + urgency.deadline_s
        band = 0 if priority < 0 else 1 if priority == 0 else 2
        return Waiter(future, units, urgency, priority, self._seq, deadline, now, band)

    def waiting_by_tenant(self) -> dict[str, int]:
        """The live waiters of each tenant that has some (``ANONYMOUS``: those without one)."""
        return {name: tenant.waiting for name, tenant in self._tenants.items() if tenant.waiting}

    def push(self, waiter: Waiter) -> None:
        klass = self._classes.get(waiter.cls)
        if klass is None:
            klass = self._classes[waiter.cls] = _Class()
        name = waiter.urgency.tenant
        heapq.heappush(klass.tenants.setdefault(name, []), (waiter.deadline, waiter.seq, waiter))
        klass.arrivals.append(waiter)
        tenant = self._tenants.get(name)
        if tenant is None:
            tenant = self._tenants[name] = _Tenant(self._virtual)
        elif not tenant.waiting:  # no credit for the time it was idle
            tenant.counter = max(tenant.counter, self._virtual)
        tenant.waiting += 1
        self.size += 1
        self.by_band[waiter.band] += 1

    def first(self, excluded: Container[str] = ()) -> Waiter | None:
        """The waiter to admit next: the class most urgent now (its priority, aged by its
        oldest waiter's wait), its tenant with the smallest counter, that tenant's earliest
        deadline, then arrival; none of the ``excluded`` tenants'."""
        classes = self._classes
        if len(classes) == 1:  # the usual one: a single class, no aging to weigh
            return self._first_of(next(iter(classes.values())), excluded)
        now = self.clock()
        best: _Class | None = None
        best_key = (math.inf, 0)
        emptied = []
        for cls, klass in self._classes.items():
            oldest = self._oldest(klass)
            if oldest is None:
                emptied.append(cls)
            elif not excluded or not all(name in excluded for name in klass.tenants):
                key = (self._aged(cls, now - oldest.queued_at), cls)
                if key < best_key:
                    best, best_key = klass, key
        for cls in emptied:
            del self._classes[cls]
        return None if best is None else self._first_of(best, excluded)

    def _first_of(self, klass: _Class, excluded: Container[str]) -> Waiter | None:
        """``klass``'s tenant with the smallest counter (none of the ``excluded``), its
        earliest deadline, then arrival; tenants with no live waiter left are dropped."""
        chosen: list[Entry] | None = None
        chosen_counter = math.inf
        emptied = []
        for name, heap in klass.tenants.items():
            while heap and heap[0][2].gone:
                heapq.heappop(heap)
                self._stale -= 1
            if not heap:
                emptied.append(name)
            elif name not in excluded and (counter := self._tenants[name].counter) < chosen_counter:
                chosen, chosen_counter = heap, counter
        for name in emptied:
            del klass.tenants[name]
        return None if chosen is None else chosen[0][2]

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
        """The waiter to shed first: the largest priority, its tenant with the largest
        counter, that tenant's latest deadline, then arrival (a scan: only when full)."""
        for cls in sorted(self._classes, reverse=True):
            live = [
                (self._tenants[name].counter, entry)
                for name, heap in self._classes[cls].tenants.items()
                for entry in heap
                if not entry[2].gone
            ]
            if live:
                return max(live, key=lambda item: (item[0], item[1][:2]))[1][2]
        return None

    def position(self, urgency: Urgency, units: int = 1) -> int:
        """How many of the waiters would be admitted before a request of ``urgency`` (taking
        ``units``) that arrived now: the queue's order played out on a copy of its counters
        (``first``, ``admit``) at this instant, assuming no later arrivals and nobody leaving.
        A scan of the queue, for ``/admin/explain``."""
        now = self.clock()
        cls = max(-MAX_PRIORITY, min(MAX_PRIORITY, urgency.priority))
        deadline = math.inf if urgency.deadline_s is None else now + urgency.deadline_s
        counters = {name: tenant.counter for name, tenant in self._tenants.items()}
        virtual = self._virtual
        own = self._tenants.get(urgency.tenant)
        if own is None or not own.waiting:
            counters[urgency.tenant] = max(counters.get(urgency.tenant, virtual), virtual)
        probe = Waiter(cast("asyncio.Future[None]", None), units, urgency, cls, -1, deadline, now)
        classes = {c: _copy(k) for c, k in self._classes.items()}
        mine = classes.setdefault(cls, ({}, []))
        heapq.heappush(mine[0].setdefault(urgency.tenant, []), (deadline, self._seq + 1, probe))
        mine[1].append(probe)
        ahead = 0
        while classes:
            _, best = min((self._aged(c, now - k[1][0].queued_at), c) for c, k in classes.items())
            tenants, arrivals = classes[best]
            name = min(tenants, key=counters.__getitem__)  # the first of equals, as first()
            chosen = heapq.heappop(tenants[name])[2]
            if chosen is probe:
                return ahead
            virtual = max(virtual, counters[name])
            counters[name] += chosen.units / chosen.urgency.weight
            ahead += 1
            arrivals.remove(chosen)
            if not tenants[name]:
                del tenants[name]
            if not arrivals:
                del classes[best]
        return ahead

    def _oldest(self, klass: _Class) -> Waiter | None:
        """The class's oldest waiter still waiting (those that left dropped on the way)."""
        arrivals = klass.arrivals
        while arrivals and arrivals[0].gone:
            arrivals.popleft()
            self._stale_arrivals -= 1
        return arrivals[0] if arrivals else None

    def _aged(self, cls: int, waited: float) -> float:
        """A class's urgency now: its priority less its oldest waiter's whole wait in aging
        periods (lower is more urgent)."""
        return cls - waited / self.aging_s if self.aging_s > 0 else float(cls)

    def _leave(self, waiter: Waiter) -> None:
        waiter.gone = True
        self._stale += 1
        self._stale_arrivals += 1
        self.size -= 1
        self.by_band[waiter.band] -= 1
        name = waiter.urgency.tenant
        tenant = self._tenants[name]
        tenant.waiting -= 1
        if not tenant.waiting and tenant.counter <= self._virtual:
            del self._tenants[name]  # nothing owed: forget it
        if max(self._stale, self._stale_arrivals) > max(_COMPACT_MIN, self.size):
            self._compact()

    def _compact(self) -> None:
        """Rebuild the heaps and arrival lists without the waiters that left."""
        classes: dict[int, _Class] = {}
        for cls, klass in self._classes.items():
            kept = _Class(arrivals=deque(w for w in klass.arrivals if not w.gone))
            for name, heap in klass.tenants.items():
                live = [entry for entry in heap if not entry[2].gone]
                if live:
                    heapq.heapify(live)
                    kept.tenants[name] = live
            if kept.arrivals:
                classes[cls] = kept
        self._classes = classes
        self._stale = self._stale_arrivals = 0


def _copy(klass: _Class) -> tuple[dict[str, list[Entry]], list[Waiter]]:
    """A class's live waiters, copied for ``position``'s play-out."""
    tenants = {}
    for name, heap in klass.tenants.items():
        live = [entry for entry in heap if not entry[2].gone]
        if live:
            heapq.heapify(live)
            tenants[name] = live
    return tenants, [w for w in klass.arrivals if not w.gone]


async def await_turn(
    future: asyncio.Future[None],
    disconnected: asyncio.Future[Any],
    limit_s: float,
    late: Callable[[], BaseException],
) -> None:
    """Wait until a queue sets ``future`` (the waiter's turn). It fails with ``late()`` after
    ``limit_s`` and with ClientDisconnected when ``disconnected`` (the client's next ASGI
    message) completes first; raises what it failed with. The caller takes its waiter out."""
    timer = future.get_loop().call_later(limit_s, _fail_late, future, late)
    on_gone = partial(_fail_gone, future)
    disconnected.add_done_callback(on_gone)
    if disconnected.done():
        _fail_gone(future, disconnected)
    try:
        await future
    finally:
        timer.cancel()
        disconnected.remove_done_callback(on_gone)


def _fail_late(future: asyncio.Future[None], late: Callable[[], BaseException]) -> None:
    if not future.done():
        future.set_exception(late())


def _fail_gone(future: asyncio.Future[None], _: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(ClientDisconnected())
