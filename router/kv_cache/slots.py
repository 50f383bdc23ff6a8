"""Slots: the small ints the index numbers its locations by, and the slot masks its tables hold.

A location's slot is given out on its first event or prediction and reused once the location is
cleared. A table of blocks (one per tier: ``present``) maps an own key to a bitmask: bit
``slot + 1`` per location holding it, and bit 0 (``REF``) when ``match`` found the key since the
eviction clock last passed it (a second chance). With up to 7 locations the value is always a
shared small int (<= 255); with 8, all but referenced keys of the 8th. Beside it, per slot, a
``dict`` engine hash (folded to 60 bits) -> own key in stored order: the exact set of confirmed
blocks there, and the eviction queue.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence

from router.kv_cache.keys import KEY_MASK

__all__ = ["REF", "Location", "SlotTable", "clear_bit", "forget", "record", "slot_bit", "slots_in"]

Location = tuple[str, int]
"""(worker id, DP rank): one engine scheduler with its own prefix cache."""

REF = 1  # bit 0 of a ``present`` value: referenced by ``match``


def slot_bit(slot: int) -> int:
    """The bit of ``slot`` in a slot mask."""
    return 2 << slot


def slots_in(mask: int) -> Iterator[int]:
    """The slots whose bits are set in ``mask`` (bit 0, the reference flag, is skipped)."""
    mask &= ~REF
    while mask:
        low = mask & -mask
        yield low.bit_length() - 2
        mask ^= low


def record(
    engine_map: dict[int, int],
    present: dict[int, int],
    bit: int,
    block_hashes: Sequence[int],
    keys: list[int],
) -> None:
    """Record each (engine hash, own key) in one tier of one slot, moving re-stored hashes to
    the back of the eviction queue."""
    for block_hash, key in zip(block_hashes, keys, strict=False):  # keys may be fewer
        folded = block_hash & KEY_MASK
        engine_map.pop(folded, None)
        engine_map[folded] = key
        present[key] = present.get(key, 0) | bit


def forget(
    engine_map: dict[int, int], present: dict[int, int], bit: int, block_hashes: Sequence[int]
) -> None:
    """Forget the blocks of ``block_hashes`` in one tier of one slot (unknown ones are
    ignored)."""
    for block_hash in block_hashes:
        key = engine_map.pop(block_hash & KEY_MASK, None)
        if key is not None:
            clear_bit(present, key, bit)


def clear_bit(present: dict[int, int], key: int, bit: int) -> None:
    """Clear a slot's bit of ``key`` in one tier's ``present``; drop the key when no slot is
    left."""
    value = present.get(key)
    if value is None:
        return
    value &= ~bit
    if value & ~REF:
        present[key] = value
    else:
        del present[key]


class SlotTable:
    """Location <-> slot, freed slots for reuse, and each slot's block size (``None`` until an
    event reports it)."""

    __slots__ = ("block_sizes", "by_location", "free", "locations")

    def __init__(self) -> None:
        self.by_location: dict[Location, int] = {}
        self.locations: list[Location | None] = []
        self.free: list[int] = []
        self.block_sizes: list[int | None] = []

    def add(self, location: Location) -> int:
        """Give ``location`` (which has none) a slot: a freed one, else a new one, numbered
        ``len(locations)`` before the call."""
        if self.free:
            slot = self.free.pop()
            self.locations[slot] = location
        else:
            slot = len(self.locations)
            self.locations.append(location)
            self.block_sizes.append(None)
        self.by_location[location] = slot
        return slot

    def release(self, location: Location) -> int | None:
        """Free the slot of ``location`` and forget its block size; the slot, ``None`` when
        ``location`` has none."""
        slot = self.by_location.pop(location, None)
        if slot is not None:
            self.block_sizes[slot] = None
            self.locations[slot] = None
            self.free.append(slot)
        return slot

    def candidates(self, block_size: int, locations: Collection[Location] | None) -> int:
        """The slot mask of locations that may answer a match at ``block_size``."""
        sizes = self.block_sizes
        slots = self.by_location
        chosen = slots.values() if locations is None else (slots.get(loc) for loc in locations)
        mask = 0
        for slot in chosen:
            if slot is not None and sizes[slot] in (None, block_size):
                mask |= slot_bit(slot)
        return mask

    def named(self, found: dict[int, int]) -> dict[Location, int]:
        """``found`` (slot -> count) by location, without zero counts and freed slots."""
        result: dict[Location, int] = {}
        for slot, count in found.items():
            location = self.locations[slot]
            if count and location is not None:
                result[location] = count
        return result
