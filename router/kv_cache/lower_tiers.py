"""The lower tiers of a tiered KV cache (``router.kv_tiers``: host memory, disk) in the index.

Created on a tier's first event (a GPU-only cluster has none and pays nothing): per tier the
GPU's pair of tables, own key -> slot mask and per slot engine hash -> own key (``slots``). A
block in several tiers has an entry in each; removing it from one leaves the others, and a
parent hash resolves in any tier of its location. ``scan`` is ``match_tiers``' loop: each block
counted at the best tier holding it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from router.kv_cache.keys import INT_BYTES
from router.kv_cache.slots import REF, clear_bit, record, slot_bit, slots_in
from router.kv_tiers import Tier

__all__ = ["LowerTier", "LowerTiers"]


class LowerTier:
    """One lower tier's blocks, laid out like the GPU's: own key -> slot mask (bit 0: referenced),
    and per slot engine hash -> own key in stored order (the set there and its eviction queue)."""

    __slots__ = ("maps", "present")

    def __init__(self) -> None:
        self.present: dict[int, int] = {}
        self.maps: dict[int, dict[int, int]] = {}

    def blocks(self) -> int:
        return sum(map(len, self.maps.values()))


def _lower_masks(
    host: dict[int, int], disk: dict[int, int], key: int, gpu: int, alive: int
) -> tuple[int, int, int]:
    """The slots of ``alive`` whose best tier holding ``key`` is the GPU (``gpu``: given), the
    host or the disk; marks ``key`` referenced in the lower tier that counts it."""
    rest = alive & ~gpu
    value = host.get(key, 0)
    on_host = value & rest
    if on_host and not value & REF:
        host[key] = value | REF
    rest &= ~on_host
    if not rest:
        return gpu, on_host, 0
    value = disk.get(key, 0)
    on_disk = value & rest
    if on_disk and not value & REF:
        disk[key] = value | REF
    return gpu, on_host, on_disk


def _add_run(counts: dict[int, list[int]], run: tuple[int, int, int], length: int) -> None:
    """Count ``length`` more blocks for each slot in ``run`` (a slot mask per ``Tier``), in
    that tier."""
    for tier, mask in enumerate(run):
        for slot in slots_in(mask):
            counts[slot][tier] += length


class LowerTiers:
    """The lower tiers that have had an event (``by_tier``: empty in a GPU-only cluster)."""

    __slots__ = ("by_tier",)

    def __init__(self) -> None:
        self.by_tier: dict[Tier, LowerTier] = {}

    def store(self, tier: Tier, slot: int, block_hashes: Sequence[int], keys: list[int]) -> None:
        """Record each (engine hash, own key) in ``tier`` at ``slot``."""
        lower = self.by_tier.get(tier) or self.by_tier.setdefault(tier, LowerTier())
        engine_map = lower.maps.setdefault(slot, {})
        record(engine_map, lower.present, slot_bit(slot), block_hashes, keys)

    def tables(self, tier: Tier, slot: int) -> tuple[dict[int, int], dict[int, int]] | None:
        """(engine-hash map, ``present``) of ``tier`` at ``slot``; ``None`` when it has none."""
        lower = self.by_tier.get(tier)
        found = None if lower is None else lower.maps.get(slot)
        if lower is None or found is None:
            return None
        return found, lower.present

    def clear_slot(self, slot: int) -> None:
        """Forget every block at ``slot`` in every lower tier."""
        bit = slot_bit(slot)
        for lower in self.by_tier.values():
            for key in lower.maps.pop(slot, {}).values():
                clear_bit(lower.present, key, bit)

    def parent_key(self, slot: int, folded: int) -> int | None:
        """The own key of engine hash ``folded`` at ``slot`` in any lower tier."""
        for lower in self.by_tier.values():
            found = lower.maps.get(slot, {}).get(folded)
            if found is not None:
                return found
        return None

    def block_count(self, tier: Tier, slot: int) -> int:
        """Confirmed blocks in ``tier`` at ``slot``."""
        lower = self.by_tier.get(tier)
        return 0 if lower is None else len(lower.maps.get(slot, ()))

    def blocks(self) -> int:
        """Confirmed (location, block) entries in every lower tier."""
        return sum(lower.blocks() for lower in self.by_tier.values())

    def bytes_estimate(self) -> int:
        """Approximate memory held by the lower tiers (dict tables plus key objects)."""
        total = 0
        for lower in self.by_tier.values():
            tables = sys.getsizeof(lower.present) + sum(map(sys.getsizeof, lower.maps.values()))
            total += tables + (len(lower.present) + lower.blocks() * 2) * INT_BYTES
        return total

    def scan(
        self, keys: Sequence[int], alive: int, present: dict[int, int], predicted: dict[int, int]
    ) -> dict[int, list[int]]:
        """Slot -> leading keys held in any tier, counted per ``Tier``, for the slots in
        ``alive`` (``present``: the GPU's table, ``predicted``: the predictions' union); marks the
        keys found as referenced in the tier that counts them. Per key: the slot mask of each tier
        (a slot in its best tier only); counts are added when the masks change (a slot drops out
        or moves tier), so a run in one tier costs no per-slot work, and a key every remaining
        slot holds on the GPU costs what ``KVBlockIndex._scan`` pays. (Inlined: this loop runs
        per prompt block.)"""
        get = present.get
        lower = self.by_tier
        host, disk = (lower[t].present if t in lower else {} for t in (Tier.HOST, Tier.DISK))
        counts = {slot: [0, 0, 0] for slot in slots_in(alive)}
        run = (alive, 0, 0)  # per tier, the slots whose current run is in it (empty so far)
        start = 0
        for index, key in enumerate(keys):
            value = get(key, 0)
            if value & alive and not value & REF:
                present[key] = value | REF
            if value & alive == alive:  # the common case: every remaining slot has it on GPU
                if run[0] == alive:
                    continue  # and the run was all GPU already: nothing changes
                masks = (alive, 0, 0)
            else:
                if predicted:
                    value |= predicted.get(key, 0)
                masks = _lower_masks(host, disk, key, value & alive, alive)
                if masks == run:
                    continue
            _add_run(counts, run, index - start)
            run, start = masks, index
            alive = masks[0] | masks[1] | masks[2]
            if not alive:
                break
        else:
            _add_run(counts, run, len(keys) - start)
        return counts
