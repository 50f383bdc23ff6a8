"""The index's ``max_blocks`` cap: which entries go when the index is full.

Beyond ``max_blocks`` entries (confirmed in every tier + predicted, all locations) the index
evicts in batches from the (location, tier) holding the most blocks (fair share), oldest stored
first, then the oldest predictions. Confirmed blocks go by CLOCK: a key that ``match`` referenced
is moved to the back of its queue once, its reference cleared, then evicted.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from router.kv_cache.lower_tiers import LowerTiers
from router.kv_cache.predictions import Predictions
from router.kv_cache.slots import REF, clear_bit, slot_bit

__all__ = ["Eviction"]

_EVICT_FRACTION = 128  # batch eviction frees about max_blocks / 128 entries beyond the cap
_SCAN_FACTOR = 4  # CLOCK: look at most this many entries per entry freed, per pass

_Queue = tuple[dict[int, int], dict[int, int], int]
"""(engine-hash map, its tier's ``present``, slot bit): one (location, tier)'s blocks."""


class Eviction:
    """Enforces the cap over the index's tables (shared, not copied: the GPU's ``present`` and
    per-slot engine-hash maps, the lower tiers, the predictions); counts what it evicted."""

    __slots__ = (
        "_clock",
        "_engine_maps",
        "_lower",
        "_predictions",
        "_present",
        "evicted",
        "max_blocks",
    )

    def __init__(
        self,
        max_blocks: int,
        present: dict[int, int],
        engine_maps: list[dict[int, int]],
        lower: LowerTiers,
        predictions: Predictions,
        clock: Callable[[], float],
    ) -> None:
        self.max_blocks = max_blocks
        self.evicted = 0
        """Entries dropped by the cap (confirmed and predicted)."""
        self._present = present
        self._engine_maps = engine_maps
        self._lower = lower
        self._predictions = predictions
        self._clock = clock

    def enforce(self) -> None:
        """Evict beyond ``max_blocks``: confirmed blocks from the fullest (location, tier) first,
        then the oldest predictions. Frees a batch past the cap so the work is O(1) amortised."""
        predictions = self._predictions
        total = sum(map(len, self._engine_maps)) + sum(map(len, predictions.by_slot))
        if self._lower.by_tier:
            total += self._lower.blocks()
        if total <= self.max_blocks:
            return
        predictions.sweep(self._clock())
        excess = total - self.max_blocks + self.max_blocks // _EVICT_FRACTION
        queues = self._queues()
        for _ in range(len(queues) * 4 + 4):  # bounded: each pass frees or stops
            if excess <= 0:
                return
            fullest = max(queues, key=lambda queue: len(queue[0]))
            if not fullest[0]:
                break
            excess -= self._evict(*fullest, excess, second_chance=True)
        for queue in queues:  # last resort: no second chances
            if excess > 0:
                excess -= self._evict(*queue, excess, second_chance=False)
        while excess > 0 and predictions.expiry:
            excess -= predictions.expire_oldest()

    def _queues(self) -> list[_Queue]:
        """Every tier at every slot, GPU first in slot order."""
        queues = [(m, self._present, slot_bit(slot)) for slot, m in enumerate(self._engine_maps)]
        for lower in self._lower.by_tier.values():
            queues += [(m, lower.present, slot_bit(slot)) for slot, m in lower.maps.items()]
        return queues

    def _evict(
        self,
        engine_map: dict[int, int],
        present: dict[int, int],
        bit: int,
        wanted: int,
        *,
        second_chance: bool,
    ) -> int:
        """Evict up to ``wanted`` blocks of one tier at one slot (``engine_map``, ``present``,
        ``bit``), oldest stored first; with ``second_chance``, keys that a match referenced are
        moved to the back instead, their reference cleared (CLOCK)."""
        victims: list[tuple[int, int]] = []
        spared: list[tuple[int, int]] = []
        limit = wanted * _SCAN_FACTOR if second_chance else wanted
        for entry in itertools.islice(engine_map.items(), limit):
            value = present.get(entry[1], 0)
            if value & REF and second_chance:
                present[entry[1]] = value & ~REF
                spared.append(entry)
            else:
                victims.append(entry)
                if len(victims) >= wanted:
                    break
        for block_hash, key in victims:
            del engine_map[block_hash]
            clear_bit(present, key, bit)
        for block_hash, key in spared:
            del engine_map[block_hash]
            engine_map[block_hash] = key
        self.evicted += len(victims)
        return len(victims)
