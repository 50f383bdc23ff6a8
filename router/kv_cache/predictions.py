"""Predicted KV entries: the blocks a routing decision expects at a location soon.

A routing decision adds short-lived *predicted* entries (the race before the engine's first
``BlockStored``, as in Dynamo and llm-d); they count as GPU blocks for ``match`` until their
time-to-live passes or a ``BlockStored`` confirms them. Layout: per slot ``dict`` own key ->
deadline, a key -> slot-mask union for ``match`` and a deque of (deadline, slot, keys) swept
lazily; deadlines are compared by identity, so a refreshed prediction is not dropped by its older
twin.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Sequence

from router.kv_cache.slots import slot_bit

__all__ = ["Predictions"]

_PRED_ENTRY_BYTES = 8  # the prediction's share of its deque item (tuple slot per key)


def _drop_bit(union: dict[int, int], key: int, bit: int) -> None:
    mask = union.get(key, 0) & ~bit
    if mask:
        union[key] = mask
    else:
        union.pop(key, None)


class Predictions:
    """The unconfirmed predicted entries of every slot, with their deadlines."""

    __slots__ = ("by_slot", "expiry", "ttl", "union")

    def __init__(self, ttl_s: float) -> None:
        self.ttl = ttl_s
        self.by_slot: list[dict[int, float]] = []
        """Per slot, own key -> deadline."""
        self.union: dict[int, int] = {}
        """Own key -> mask of the slots it is predicted at (``match`` reads it)."""
        self.expiry: deque[tuple[float, int, tuple[int, ...]]] = deque()

    def add_slot(self) -> None:
        """Make room for a new slot (numbered ``len(by_slot)``)."""
        self.by_slot.append({})

    def add(self, slot: int, keys: Sequence[int], present: dict[int, int], now: float) -> bool:
        """Predict ``keys`` at ``slot`` until ``now`` + the time-to-live, except those confirmed
        there in ``present`` (sweeping expired predictions first); whether any key was new."""
        self.sweep(now)
        deadline = now + self.ttl
        bit = slot_bit(slot)
        by_slot = self.by_slot[slot]
        predicted = self.union
        fresh = []
        for key in keys:
            if present.get(key, 0) & bit:
                continue  # already confirmed there
            by_slot[key] = deadline
            predicted[key] = predicted.get(key, 0) | bit
            fresh.append(key)
        if fresh:
            self.expiry.append((deadline, slot, tuple(fresh)))
        return bool(fresh)

    def confirm(self, slot: int, keys: Sequence[int]) -> None:
        """``keys`` were stored on the GPU at ``slot``: they are no longer predictions there."""
        by_slot = self.by_slot[slot]
        if by_slot:
            predicted = self.union
            bit = slot_bit(slot)
            for key in keys:
                if by_slot.pop(key, None) is not None:
                    _drop_bit(predicted, key, bit)

    def clear_slot(self, slot: int) -> None:
        """Forget every prediction at ``slot`` (its deque items expire as no-ops)."""
        predicted = self.union
        bit = slot_bit(slot)
        for key in self.by_slot[slot]:
            _drop_bit(predicted, key, bit)
        self.by_slot[slot] = {}

    def sweep(self, now: float) -> None:
        """Drop predictions whose deadline has passed (oldest first; the deque is in order)."""
        expiry = self.expiry
        while expiry and expiry[0][0] <= now:
            self._expire(*expiry.popleft())

    def expire_oldest(self) -> int:
        """Drop the oldest ``predict`` call's predictions before their deadline (eviction); how
        many entries went."""
        return self._expire(*self.expiry.popleft())

    def _expire(self, deadline: float, slot: int, keys: tuple[int, ...]) -> int:
        """Forget the predictions of one ``predict`` call that were not refreshed since."""
        by_slot = self.by_slot[slot]
        predicted = self.union
        bit = slot_bit(slot)
        dropped = 0
        for key in keys:
            if by_slot.get(key) is deadline:
                del by_slot[key]
                _drop_bit(predicted, key, bit)
                dropped += 1
        return dropped

    def count(self) -> int:
        """Unconfirmed (location, block) entries, expired ones not yet swept included."""
        return sum(map(len, self.by_slot))

    def bytes_estimate(self, count: int) -> int:
        """Approximate memory held for ``count`` entries (from ``count()``)."""
        tables = sys.getsizeof(self.union) + sum(map(sys.getsizeof, self.by_slot))
        return tables + count * _PRED_ENTRY_BYTES
