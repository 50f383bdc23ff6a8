"""``StoreTrust``: whether a store listing that removes discovered workers is believed.

An etcd that comes back empty (a new cluster, a wiped prefix, a restore from an old snapshot)
says "no workers" exactly as a fleet that really emptied would. Believing it drops every worker
of every router at once, so a removal is judged first:

* suspect when the listing removes every live discovered worker (not draining, not from the
  command line) after a store outage, when it removes at least 2 of them and more than
  ``suspect_removed_share`` at once, or when the router's own records (its command-line workers,
  which nobody but an operator deletes) are gone from it while any discovered worker would go;
* while suspect the removal is held: the workers stay in the pool and the router re-registers
  its own records; the suspicion ends as soon as a listing no longer trips these rules (the
  store shows the workers again), or after ``suspect_grace_s``, when the store is believed (a
  deliberately emptied fleet drains, one grace late).

Removals of draining workers, and of one worker at a time, are ordinary and never suspect. The
judge is pure: Discovery feeds it counts and applies its verdict.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RemovalBatch", "StoreTrust"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RemovalBatch:
    """What one listing would do to the live discovered workers (not draining, not CLI)."""

    leaving: int  # live discovered workers the listing lacks
    live: int  # live discovered workers in the pool now
    after_outage: bool  # the first listing after the store failed
    own_records_lost: bool  # a command-line worker's record is missing from the store

    def trips(self, share: float) -> bool:
        if self.leaving == 0:
            return False
        emptied = self.leaving >= self.live
        return (
            (emptied and self.after_outage)
            or (self.leaving >= 2 and self.leaving > share * self.live)
            or self.own_records_lost
        )


class StoreTrust:
    """Holds suspect removals for at most ``grace_s``; ``suspect_since`` is set while it does."""

    def __init__(
        self, grace_s: float, removed_share: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._grace_s = grace_s
        self._share = removed_share
        self._clock = clock
        self.suspect_since: float | None = None  # clock() when the current suspicion began
        self.reason = ""

    def hold(self, batch: RemovalBatch) -> bool:
        """Whether to keep the workers this listing removes (the store is suspect)."""
        if not batch.trips(self._share):
            self._clear("the store shows the workers again")
            return False
        now = self._clock()
        if self.suspect_since is None:
            self.suspect_since = now
            self.reason = _describe(batch)
            logger.warning(
                "registry store is suspect: %s; keeping the last good workers for up to %.0f s "
                "unless it shows them again, and re-registering this router's own records",
                self.reason,
                self._grace_s,
            )
            return True
        if now - self.suspect_since < self._grace_s:
            return True
        self._clear(f"its grace of {self._grace_s:.0f} s is over: the store is believed")
        return False

    def remaining_s(self) -> float | None:
        """Seconds until the grace ends (None: not suspect)."""
        if self.suspect_since is None:
            return None
        return max(0.0, self.suspect_since + self._grace_s - self._clock())

    def _clear(self, why: str) -> None:
        if self.suspect_since is not None:
            logger.warning("registry store suspicion ended after %.1f s: %s", self._age(), why)
        self.suspect_since = None
        self.reason = ""

    def _age(self) -> float:
        return 0.0 if self.suspect_since is None else self._clock() - self.suspect_since


def _describe(batch: RemovalBatch) -> str:
    why = f"it lacks {batch.leaving} of the {batch.live} live discovered workers"
    if batch.own_records_lost:
        why += " and this router's own records"
    if batch.after_outage:
        why += " after an outage"
    return why
