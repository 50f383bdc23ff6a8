"""What each prefill <-> decode pair did lately: requests, errors, and PD recomputes.

A recompute is a decode that computed the prompt itself although a prefill was sent it: the KV
transfer silently did nothing (the most reported PD failure). A pair that recomputed within
``suspect_window_s`` is suspect (``/ready``, the status page, ``pdr_pd_pair_suspect``). Pairs
whose workers left the pool (``live_ids``) are dropped whenever the ledger is read, so the
ledger and its metric series stay bounded by the pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

__all__ = ["PairLedger", "PairStats"]

PairKey = tuple[str, str]  # (prefill worker id, decode worker id)


@dataclass(slots=True)
class PairStats:
    prefill_url: str
    decode_url: str
    requests: int = 0
    errors: int = 0
    recomputes: int = 0
    last_error: str | None = None
    last_error_at: float | None = None  # time.monotonic()
    last_recompute_at: float | None = None

    def suspect(self, now: float, window_s: float) -> bool:
        at = self.last_recompute_at
        return at is not None and now - at < window_s


class PairLedger:
    def __init__(
        self,
        suspect_window_s: float = 300.0,
        live_ids: Callable[[], Collection[str]] | None = None,
    ) -> None:
        self.suspect_window_s = suspect_window_s
        self._live_ids = live_ids
        self._pairs: dict[PairKey, PairStats] = {}

    def _stats(self, key: PairKey, prefill_url: str, decode_url: str) -> PairStats:
        stats = self._pairs.get(key)
        if stats is None:
            stats = self._pairs[key] = PairStats(prefill_url, decode_url)
        return stats

    def served(self, key: PairKey, prefill_url: str, decode_url: str) -> None:
        self._stats(key, prefill_url, decode_url).requests += 1

    def failed(self, key: PairKey, prefill_url: str, decode_url: str, message: str) -> None:
        stats = self._stats(key, prefill_url, decode_url)
        stats.requests += 1
        stats.errors += 1
        stats.last_error = message[:300]
        stats.last_error_at = time.monotonic()

    def recomputed(self, key: PairKey, prefill_url: str, decode_url: str) -> None:
        stats = self._stats(key, prefill_url, decode_url)
        stats.recomputes += 1
        stats.last_recompute_at = time.monotonic()

    def _prune(self) -> None:
        """Forget pairs with a worker no longer in the pool."""
        if self._live_ids is None:
            return
        live = self._live_ids()
        gone = [k for k in self._pairs if k[0] not in live or k[1] not in live]
        for key in gone:
            del self._pairs[key]

    def pairs(self) -> list[PairStats]:
        self._prune()
        return list(self._pairs.values())

    def suspects(self) -> list[PairStats]:
        now = time.monotonic()
        return [s for s in self.pairs() if s.suspect(now, self.suspect_window_s)]

    def snapshot(self) -> list[dict[str, Any]]:
        """Every pair's counters, for the status page."""
        now = time.monotonic()

        def age(at: float | None) -> float | None:
            return None if at is None else round(now - at, 3)

        return [
            {
                "prefill": s.prefill_url,
                "decode": s.decode_url,
                "requests": s.requests,
                "errors": s.errors,
                "recomputes": s.recomputes,
                "last_error": s.last_error,
                "last_error_age_s": age(s.last_error_at),
                "last_recompute_age_s": age(s.last_recompute_at),
                "suspect": s.suspect(now, self.suspect_window_s),
            }
            for s in self.pairs()
        ]
