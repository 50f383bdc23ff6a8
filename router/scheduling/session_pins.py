"""The session pin table: session key -> the prefill DP rank and decode its last request took.

Bounded two ways: a pin lives ``ttl_s`` after its session's last request (each use refreshes
it), and at most ``max_entries`` pins are kept, the least recently used going first. Both come
from one ``OrderedDict`` kept in use order: with one TTL for every pin and each use moving its
pin to the end, use order is also expiry order, so expired pins are dropped from the front as
new ones arrive (amortized O(1)) and an expired pin met by a lookup is dropped there. One table
per router process (no global state: the pipeline builds it with its ``RouteChooser``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Pin", "SessionAsk", "SessionPins"]


@dataclass(frozen=True, slots=True)
class SessionAsk:
    """What a request says about its session: its key and whether it asks for a hard pin
    (``X-Session-Affinity``; None: the router's ``--session-affinity``)."""

    key: str
    hard: bool | None = None


@dataclass(frozen=True, slots=True)
class Pin:
    """Where a session's requests go: worker ids (prefill None: none pinned yet, its requests
    skipped the prefill leg), the prefill's DP rank, the prompt tokens of its last request
    (what the pinned rank is expected to hold; 0 unknown) and when it expires."""

    prefill: str | None
    rank: int
    decode: str
    prompt_tokens: int
    expires_at: float


class SessionPins:
    """A bounded LRU table of pins with a TTL refreshed on use; ``clock``: time.monotonic."""

    def __init__(
        self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._pins: OrderedDict[str, Pin] = OrderedDict()
        self.evicted = 0  # pins dropped for room (not expired): the table is too small

    def __len__(self) -> int:
        return len(self._pins)

    def get(self, key: str) -> Pin | None:
        """The session's live pin, or None (an expired one is dropped)."""
        pin = self._pins.get(key)
        if pin is not None and pin.expires_at <= self._clock():
            del self._pins[key]
            return None
        return pin

    def pin(self, key: str, prefill: str | None, rank: int, decode: str, prompt_tokens: int) -> Pin:
        """Pin (or re-pin, refreshing its TTL) the session; the table stays within its
        bounds: expired pins go, then the least recently used while it is full."""
        now = self._clock()
        pins = self._pins
        pins.pop(key, None)
        while pins:
            oldest = next(iter(pins.values()))
            if oldest.expires_at > now and len(pins) < self.max_entries:
                break
            if oldest.expires_at > now:
                self.evicted += 1
            pins.popitem(last=False)
        pinned = pins[key] = Pin(prefill, rank, decode, prompt_tokens, now + self.ttl_s)
        return pinned

    def now(self) -> float:
        """The table's clock now (what ``Pin.expires_at`` is measured on)."""
        return self._clock()

    def drop(self, key: str) -> None:
        self._pins.pop(key, None)

    def stats(self) -> dict[str, Any]:
        """The table's size and bounds (``/admin/explain``, the status data)."""
        return {
            "entries": len(self._pins),
            "max_entries": self.max_entries,
            "ttl_s": self.ttl_s,
            "evicted": self.evicted,
        }
