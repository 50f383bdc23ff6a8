"""Circuit breakers per worker and per prefill -> decode pair, with half-open recovery.

``CircuitBreaker`` is the state machine (pure, clock injected):

- closed: traffic flows; ``failure_threshold`` failed requests in a row open it;
- open: no new traffic for the back-off (``open_s`` at first, doubled after every failed trial,
  at most ``max_open_s``); results of requests sent before it opened are ignored;
- half-open: once the back-off is over, one trial request at a time goes through: its success
  closes the breaker (back-off reset), its failure re-opens it with twice the back-off. A trial
  that ends without a verdict (the client left, the engine was full, a 4xx) frees the permit
  for the next request.

``Circuits`` keeps the router's breakers: one per worker (fed by requests that failed by the
worker's fault) and one per (prefill, decode) pair (fed by KV transfers that failed while the
prefill leg succeeded). Breakers are created at a target's first failure, logged at every
transition, and forgotten when a worker leaves the pool (``live_ids``), so the breakers and
their metric series stay bounded by the pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from router.settings import CircuitBreakerSettings, HealthSettings
from router.workers import Worker

__all__ = [
    "BreakerPolicy",
    "CircuitBreaker",
    "CircuitState",
    "Circuits",
    "Tripped",
    "build_circuits",
]

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
Listener = Callable[["CircuitState", str], None]
PairKey = tuple[str, str]  # (prefill worker id, decode worker id)
# a breaker opened or closed: (worker id,) or a pair's ids, opened, its back-off, the reason
Verdict = Callable[[tuple[str, ...], bool, float, str], None]


class CircuitState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    """When a breaker opens (``failure_threshold`` failures in a row) and for how long."""

    failure_threshold: int
    open_s: float
    max_open_s: float


class CircuitBreaker:
    """One target's breaker. Owned by the event loop (no locks); ``listener`` hears every
    transition with its reason."""

    def __init__(
        self,
        policy: BreakerPolicy,
        *,
        clock: Clock = time.monotonic,
        listener: Listener | None = None,
    ) -> None:
        self._policy = policy
        self._clock = clock
        self._listener = listener
        self._state = CircuitState.CLOSED
        self._failures = 0  # in a row, while closed
        self._backoff = policy.open_s
        self._retry_at = 0.0
        self._trial = False  # a half-open trial request is in flight
        self.reason = ""  # why it last opened

    def state(self) -> CircuitState:
        """The state now (an open breaker whose back-off is over is half-open)."""
        if self._state is CircuitState.OPEN and self._clock() >= self._retry_at:
            self._state = CircuitState.HALF_OPEN
            self._trial = False
            self._notify(f"open for {self._backoff:g}s: one trial request may go through")
        return self._state

    def allows(self) -> bool:
        """Whether a new request may go to the target now (half-open: no trial in flight)."""
        state = self.state()
        if state is CircuitState.CLOSED:
            return True
        return state is CircuitState.HALF_OPEN and not self._trial

    def begin_trial(self) -> bool:
        """Take the half-open breaker's one trial permit; False when not half-open or taken."""
        if self.state() is not CircuitState.HALF_OPEN or self._trial:
            return False
        self._trial = True
        return True

    def end_trial(self) -> None:
        """The trial request ended; without a verdict its permit goes to the next request."""
        self._trial = False

    def success(self) -> None:
        state = self.state()
        if state is CircuitState.CLOSED:
            self._failures = 0
        elif state is CircuitState.HALF_OPEN:
            self._state = CircuitState.CLOSED
            self._failures = 0
            self._backoff = self._policy.open_s
            self._trial = False
            self._notify("a request succeeded while half-open")

    def failure(self, reason: str) -> None:
        state = self.state()
        if state is CircuitState.CLOSED:
            self._failures += 1
            if self._failures >= self._policy.failure_threshold:
                self._open(f"{self._failures} requests in a row failed (last: {reason})")
        elif state is CircuitState.HALF_OPEN:
            self._backoff = min(self._backoff * 2, self._policy.max_open_s)
            self._open(f"a request failed while half-open: {reason}")

    def adopt(self, opened: bool, open_s: float, reason: str) -> None:
        """Another router process's or replica's verdict on the same target: open for
        ``open_s`` (unless this one is open longer), or closed."""
        now = self._clock()
        if opened:
            if self._state is CircuitState.OPEN and self._retry_at >= now + open_s:
                return
            self._backoff = open_s
            self._open(f"{reason} (in another router process)")
        elif self._state is not CircuitState.CLOSED:
            self._state = CircuitState.CLOSED
            self._failures = 0
            self._backoff = self._policy.open_s
            self._trial = False
            self._notify("another router process's request succeeded while half-open")

    @property
    def open_s(self) -> float:
        return self._backoff

    def retry_in(self) -> float | None:
        """Seconds until the next trial may go through; None unless open."""
        if self.state() is not CircuitState.OPEN:
            return None
        return max(self._retry_at - self._clock(), 0.0)

    def describe(self) -> dict[str, Any]:
        """The breaker as ``/ready`` and the status page show it."""
        retry_in = self.retry_in()
        return {
            "state": self.state().value,
            "reason": self.reason,
            "retry_in_s": None if retry_in is None else round(retry_in, 3),
            "open_s": self._backoff,
            "trial_in_flight": self._trial,
        }

    def _open(self, reason: str) -> None:
        self._state = CircuitState.OPEN
        self._failures = 0
        self._trial = False
        self._retry_at = self._clock() + self._backoff
        self.reason = reason
        self._notify(f"{reason}; next trial in {self._backoff:g}s")

    def _notify(self, reason: str) -> None:
        if self._listener is not None:
            self._listener(self._state, reason)


@dataclass(frozen=True, slots=True)
class Tripped:
    """A breaker that is not closed, for ``/ready``, the status page and metrics."""

    scope: str  # "worker" or "pair"
    labels: tuple[str, ...]  # (role, url) or (prefill url, decode url)
    breaker: CircuitBreaker

    def describe(self) -> dict[str, Any]:
        """``{"scope": "worker", "role", "worker"}`` or ``{"scope": "pair", "prefill",
        "decode"}``, plus the breaker's state, reason, ``retry_in_s``, ``open_s`` and
        ``trial_in_flight``."""
        if self.scope == "worker":
            role, url = self.labels
            target: dict[str, Any] = {"scope": "worker", "role": role, "worker": url}
        else:
            prefill, decode = self.labels
            target = {"scope": "pair", "prefill": prefill, "decode": decode}
        return {**target, **self.breaker.describe()}


class Circuits:
    """The router's worker and pair breakers (``pair_policy`` None: no pair breakers)."""

    def __init__(
        self,
        worker_policy: BreakerPolicy,
        pair_policy: BreakerPolicy | None,
        *,
        live_ids: Callable[[], Collection[str]] | None = None,
        clock: Clock = time.monotonic,
        on_transition: Callable[[str, CircuitState], None] | None = None,
        enabled: bool = True,
    ) -> None:
        self._enabled = enabled  # off: failures open no breaker
        self._worker_policy = worker_policy
        self._pair_policy = pair_policy
        self._live_ids = live_ids
        self._clock = clock
        self._on_transition = on_transition
        self._workers: dict[str, tuple[tuple[str, ...], CircuitBreaker]] = {}
        self._pairs: dict[PairKey, tuple[tuple[str, ...], CircuitBreaker]] = {}
        # router --workers N: told of this process's breakers opening and closing
        self.on_verdict: Verdict | None = None
        self._adopting = False

    # --------------------------------------------------------------- routing

    def worker_allows(self, worker: Worker) -> bool:
        entry = self._workers.get(worker.id)
        return entry is None or entry[1].allows()

    def pair_allows(self, prefill: Worker, decode: Worker) -> bool:
        entry = self._pairs.get((prefill.id, decode.id))
        return entry is None or entry[1].allows()

    def trials(self, prefill: Worker | None, decode: Worker) -> tuple[CircuitBreaker, ...]:
        """Take the trial permits of the route's half-open breakers (the attempt hands them
        back with ``end_trial`` when it ends)."""
        entries = [self._workers.get(decode.id)]
        if prefill is not None:
            entries += [self._workers.get(prefill.id), self._pairs.get((prefill.id, decode.id))]
        return tuple(e[1] for e in entries if e is not None and e[1].begin_trial())

    def any_worker_breaker(self) -> bool:
        """Whether any worker has a breaker (only those may keep a worker out of routing)."""
        return bool(self._workers)

    def any_pair_breaker(self) -> bool:
        return bool(self._pairs)

    # --------------------------------------------------------------- outcomes

    def worker_success(self, worker: Worker) -> None:
        entry = self._workers.get(worker.id)
        if entry is not None:
            entry[1].success()

    def worker_failure(self, worker: Worker, reason: str) -> None:
        if not self._enabled:
            return
        self._worker_entry(worker)[1].failure(reason)

    def _worker_entry(self, worker: Worker) -> tuple[tuple[str, ...], CircuitBreaker]:
        entry = self._workers.get(worker.id)
        if entry is None:
            labels = (worker.role.value, worker.public_url)
            what = f"{worker.role.value} worker {worker.public_url}"
            breaker = self._breaker("worker", (worker.id,), what, self._worker_policy)
            entry = self._workers[worker.id] = (labels, breaker)
        return entry

    def pair_success(self, prefill: Worker, decode: Worker) -> None:
        entry = self._pairs.get((prefill.id, decode.id))
        if entry is not None:
            entry[1].success()

    def pair_failure(self, prefill: Worker, decode: Worker, reason: str) -> None:
        if self._pair_policy is None or not self._enabled:
            return
        self._pair_entry(prefill, decode, self._pair_policy)[1].failure(reason)

    def _pair_entry(
        self, prefill: Worker, decode: Worker, policy: BreakerPolicy
    ) -> tuple[tuple[str, ...], CircuitBreaker]:
        key = (prefill.id, decode.id)
        entry = self._pairs.get(key)
        if entry is None:
            labels = (prefill.public_url, decode.public_url)
            what = f"pair {prefill.public_url} -> {decode.public_url}"
            entry = self._pairs[key] = (labels, self._breaker("pair", key, what, policy))
        return entry

    def adopt(self, workers: tuple[Worker, ...], opened: bool, open_s: float, reason: str) -> None:
        """Another router process's breaker on ``workers`` (one: a worker; two: a pair)
        opened or closed: this process's follows (``CircuitBreaker.adopt``), quietly."""
        if not self._enabled:
            return
        if len(workers) == 1:
            entry = self._worker_entry(workers[0])
        elif self._pair_policy is not None:
            entry = self._pair_entry(workers[0], workers[1], self._pair_policy)
        else:
            return
        self._adopting = True
        try:
            entry[1].adopt(opened, open_s, reason)
        finally:
            self._adopting = False

    # --------------------------------------------------------------- views

    def next_trial_in(self, workers: list[Worker]) -> float | None:
        """The soonest a trial may go to one of ``workers`` (open ones), None when unknown."""
        waits = [
            entry[1].retry_in() for w in workers if (entry := self._workers.get(w.id)) is not None
        ]
        known = [wait for wait in waits if wait is not None]
        return min(known) if known else None

    def tripped(self) -> list[Tripped]:
        """Every breaker that is open or half-open (pruned to the live pool first)."""
        self._prune()
        found = [
            Tripped("worker", labels, breaker)
            for labels, breaker in self._workers.values()
            if breaker.state() is not CircuitState.CLOSED
        ]
        found += [
            Tripped("pair", labels, breaker)
            for labels, breaker in self._pairs.values()
            if breaker.state() is not CircuitState.CLOSED
        ]
        return found

    def worker_states(self) -> list[tuple[tuple[str, ...], CircuitState]]:
        self._prune()
        return [(labels, breaker.state()) for labels, breaker in self._workers.values()]

    def pair_states(self) -> list[tuple[tuple[str, ...], CircuitState]]:
        self._prune()
        return [(labels, breaker.state()) for labels, breaker in self._pairs.values()]

    def worker_back(self, worker: Worker) -> None:
        """The worker came back up (its probes, after it was marked down): it starts afresh,
        its breaker and its pairs' forgotten (their failures were those of the process that
        went down)."""
        self._workers.pop(worker.id, None)
        for pair in [k for k in self._pairs if worker.id in k]:
            del self._pairs[pair]

    def _prune(self) -> None:
        """Forget the breakers of workers no longer in the pool (and their pairs)."""
        if self._live_ids is None:
            return
        live = self._live_ids()
        for worker_id in [k for k in self._workers if k not in live]:
            del self._workers[worker_id]
        for pair in [k for k in self._pairs if k[0] not in live or k[1] not in live]:
            del self._pairs[pair]

    def _breaker(
        self, scope: str, key: tuple[str, ...], what: str, policy: BreakerPolicy
    ) -> CircuitBreaker:
        def listener(state: CircuitState, reason: str) -> None:
            level = logging.WARNING if state is CircuitState.OPEN else logging.INFO
            logger.log(level, "circuit of %s is now %s: %s", what, state.value, reason)
            if self._on_transition is not None:
                self._on_transition(scope, state)
            told = self.on_verdict
            if told is not None and not self._adopting and state is not CircuitState.HALF_OPEN:
                told(key, state is CircuitState.OPEN, breaker.open_s, breaker.reason)

        breaker = CircuitBreaker(policy, clock=self._clock, listener=listener)
        return breaker


def build_circuits(
    health: HealthSettings,
    breaker: CircuitBreakerSettings,
    *,
    live_ids: Callable[[], Collection[str]] | None = None,
    on_transition: Callable[[str, CircuitState], None] | None = None,
    enabled: bool = True,
) -> Circuits:
    """Worker breakers opening after ``health.failure_threshold`` failed requests in a row,
    pair breakers after ``breaker.pair_failure_threshold`` (none when it is 0); none at all
    when not ``enabled`` (the CPU ledger)."""
    worker = BreakerPolicy(health.failure_threshold, breaker.open_s, breaker.max_open_s)
    threshold = breaker.pair_failure_threshold
    pair = BreakerPolicy(threshold, breaker.open_s, breaker.max_open_s) if threshold else None
    return Circuits(worker, pair, live_ids=live_ids, on_transition=on_transition, enabled=enabled)
