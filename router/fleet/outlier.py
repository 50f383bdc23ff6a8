"""Request-path outlier detection (Envoy's model): a worker whose legs stopped completing is
ejected within a few checks, whatever its health probes say.

``OutlierDetector.check`` runs every ``interval_s`` (a lifespan task, ``run``) and reads what the
request path left in each worker's ``LegStats`` (two clock reads per leg, nothing per chunk):

- **overdue** (prefills): at least ``overdue_min_legs`` legs are in flight, its oldest is older
  than max(``overdue_floor_s``, ``overdue_factor`` x its recent leg latency) and no leg of it
  completed for that long either. A frozen engine (SIGSTOP, a wedged GPU) accepts connections
  and never answers while legs pile up; a busy one still completes legs, and one long prompt
  alone on an idle prefill (a 100k-token prefill takes seconds) is no evidence. Nor is a prefill
  that answered a load read (``--load-interval``) within that time: its requests queue (for KV
  pages, behind a long batch), it is not frozen. Decodes are not judged by age: their legs last
  as long as the generation;
- **timeouts**: its last ``consecutive_timeouts`` legs timed out (any role).

Ejecting marks the worker down (``Worker.mark_down``): legs waiting on it end at once
(``worker_lost``, ``kv_lost``: retried elsewhere before any byte reached the client) and routing
skips it. It stays out for at least ``ejection_s`` and comes back through the health probes'
healthy threshold (``router.fleet.health``). At most ``max_ejection_percent`` of a role's
workers are ejected at a time, and never the last one in service, so outlier detection cannot
empty a pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from router.settings import OutlierSettings
from router.workers import Role, Worker, WorkerPool

__all__ = ["OutlierDetector"]

logger = logging.getLogger(__name__)

Clock = Callable[[], float]


class OutlierDetector:
    """Ejects the outliers of a pool; ``on_eject(role, reason)`` hears each ejection (metrics)."""

    def __init__(
        self,
        pool: WorkerPool[Any],
        settings: OutlierSettings,
        *,
        clock: Clock = time.monotonic,
        on_eject: Callable[[str, str], None] | None = None,
    ) -> None:
        self._pool = pool
        self._settings = settings
        self._clock = clock
        self._on_eject = on_eject
        # tells the siblings and the replica peers this process's ejections
        # (``router.fleet.shared_ejections``): the worker, and why
        self.on_verdict: Callable[[Worker, str], None] | None = None

    @property
    def ejection_s(self) -> float:
        """How long an ejected worker stays out, at least."""
        return self._settings.ejection_s

    async def run(self) -> None:
        """Check every ``interval_s`` until cancelled (never when it is 0)."""
        interval = self._settings.interval_s
        if interval <= 0:
            return
        while True:
            await asyncio.sleep(interval)
            self.check()

    def check(self) -> list[Worker]:
        """Eject the outliers found now (within the ejection budget); returns them."""
        now = self._clock()
        ejected = self._check_role(self._pool.prefill, now, judge_age=True)
        return ejected + self._check_role(self._pool.decode, now, judge_age=False)

    def allowance_s(self, worker: Worker) -> float:
        """How long ``worker`` may go without completing a leg while one is in flight."""
        settings = self._settings
        return max(settings.overdue_floor_s, settings.overdue_factor * worker.legs.latency_s)

    def outlier_reason(
        self, worker: Worker, now: float, *, judge_age: bool
    ) -> tuple[str, str] | None:
        """Why ``worker`` is an outlier now (``overdue`` or ``timeouts``, and the details);
        None when it is not."""
        legs = worker.legs
        threshold = self._settings.consecutive_timeouts
        if legs.timeouts_in_row >= threshold:
            return "timeouts", f"its last {legs.timeouts_in_row} legs timed out"
        oldest = legs.oldest_start() if judge_age else None
        if oldest is None or len(legs.started) < self._settings.overdue_min_legs:
            return None
        allowance = self.allowance_s(worker)
        age = now - oldest
        if age <= allowance or now - legs.last_completed <= allowance:
            return None
        if _answered_a_load_read(worker, now - allowance):
            return None  # busy (its requests queue), not frozen: it still answers its metrics
        quiet = min(now - legs.last_completed, age)
        return "overdue", (
            f"no leg completed for {quiet:.1f}s while one has been in flight for {age:.1f}s "
            f"(allowance {allowance:.1f}s)"
        )

    def adopt(self, worker: Worker, ejection_s: float, reason: str) -> bool:
        """A sibling's or a replica peer's ejection of ``worker`` (``ejection_s`` from now): out
        here too, within this process's own budget (``max_ejection_percent``, never the last
        worker in service), and not told on again. Whether it is out here now."""
        now = self._clock()
        if worker.ejected or not worker.healthy:
            # out already: it stays out at least as long as the sender's verdict says
            worker.ejected = True
            worker.ejected_until = max(worker.ejected_until, now + ejection_s)
            return True
        pool = self._pool
        role = pool.prefill if worker.role is Role.PREFILL else pool.decode
        budget, in_service = self._room(role)
        if worker.draining or budget <= 0 or in_service <= 1:
            return False
        self._eject(worker, "shared", f"ejected by a sibling or peer: {reason}", now, ejection_s)
        return True

    def _room(self, workers: list[Worker]) -> tuple[int, int]:
        """How many more of ``workers`` may be ejected, and how many are in service."""
        budget = len(workers) * self._settings.max_ejection_percent // 100
        budget -= sum(1 for w in workers if w.ejected)
        return budget, sum(1 for w in workers if w.healthy and not w.draining)

    def _check_role(self, workers: list[Worker], now: float, *, judge_age: bool) -> list[Worker]:
        budget, in_service = self._room(workers)
        ejected: list[Worker] = []
        for worker in workers:
            if budget <= 0 or in_service <= 1:
                break
            if not worker.healthy or worker.draining:
                continue
            found = self.outlier_reason(worker, now, judge_age=judge_age)
            if found is None:
                continue
            kind, reason = found
            self._eject(worker, kind, reason, now, self._settings.ejection_s)
            ejected.append(worker)
            budget -= 1
            in_service -= 1
        return ejected

    def _eject(self, worker: Worker, kind: str, reason: str, now: float, ejection_s: float) -> None:
        role = worker.role.value
        logger.warning(
            "%s worker %s ejected for at least %gs (outlier detection): %s",
            role,
            worker.public_url,
            ejection_s,
            reason,
        )
        worker.ejected = True
        worker.ejected_until = now + ejection_s
        worker.legs.timeouts_in_row = 0
        worker.mark_down(f"ejected by outlier detection: {reason}")
        if kind == "shared":
            return  # the sender counted it and told the others
        if self._on_eject is not None:
            self._on_eject(role, kind)
        if self.on_verdict is not None:
            self.on_verdict(worker, reason)


def _answered_a_load_read(worker: Worker, since: float) -> bool:
    """Whether the engine answered a load read (``router.fleet.engine_load``) since ``since``: a
    frozen engine answers nothing, a busy one whose requests queue for KV pages still does."""
    return any(reading is not None and reading.at >= since for reading in worker.engine_load)
