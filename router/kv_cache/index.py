"""Which worker rank holds which KV blocks: the index behind KV-cache-aware routing.

Engines report their prefix cache through KV events (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``, docs/concepts/protocols.md section 7). Their block hashes cannot be
reproduced here (the
seed, algorithm and extra keys differ per engine, section 11.2), so, like llm-d's indexer, the index
keys blocks by the router's *own* chained keys (``chain_keys``, in ``keys``) computed from the
``token_ids`` every ``BlockStored`` carries, and keeps an engine-hash -> own-key map per location so
that ``BlockRemoved`` and the next event's ``parent_block_hash`` can be resolved. A routing decision
adds short-lived *predicted* entries (the race before the engine's first ``BlockStored``, as in
Dynamo and llm-d: ``predictions``). ``match`` answers, per location, how many leading blocks of a
prompt are cached on the GPU; ``match_tiers`` also counts the lower tiers of a tiered cache
(``router.kv_tiers``: host memory, disk; ``lower_tiers``), each block at the best tier holding it.

Layout, chosen for memory (about 150 bytes per indexed block with the engine-hash map):

* ``_present``: own key -> slot mask (``slots``: bit ``slot + 1`` per location holding it, bit 0
  the reference flag ``match`` sets for the eviction clock). Slots are given out per location and
  reused when a location is cleared (``SlotTable``).
* per slot, ``dict`` engine hash -> own key, in stored order: the exact set of confirmed blocks
  there, and the eviction queue. Engine hashes are folded to 60 bits.
* predictions (``Predictions``) and lower tiers (``LowerTiers``, created on their first event: a
  GPU-only cluster has none and pays nothing) beside them; predictions are GPU blocks.

Beyond ``max_blocks`` entries (confirmed in every tier + predicted, all locations) the index evicts
(``eviction``). Pure data structure: no I/O, no locking (one event loop owns it), injectable clock.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from router.kv_cache.eviction import Eviction
from router.kv_cache.keys import (
    INT_BYTES,
    KEY_BITS,
    KEY_MASK,
    ROOT_KEY,
    adapter_root,
    chain_keys,
)
from router.kv_cache.lower_tiers import LowerTiers
from router.kv_cache.predictions import Predictions
from router.kv_cache.slots import (
    REF,
    Location,
    SlotTable,
    clear_bit,
    forget,
    record,
    slot_bit,
    slots_in,
)
from router.kv_tiers import Tier, TierMatch

__all__ = ["KEY_BITS", "ROOT_KEY", "IndexStats", "KVBlockIndex", "Location", "chain_keys"]


@dataclass(frozen=True, slots=True)
class IndexStats:
    """A snapshot of the index's size and history, for metrics and the benchmark."""

    blocks: int
    """Confirmed GPU (location, block) entries over all locations."""
    predicted: int
    """Unexpired predicted (location, block) entries."""
    locations: int
    orphaned: int
    """Stored blocks skipped because their parent hash was unknown at the location."""
    evicted: int
    """Entries dropped by the ``max_blocks`` cap (confirmed and predicted)."""
    bytes_estimate: int
    """Approximate memory held by the index (dict tables plus key objects)."""
    lower_blocks: int = 0
    """Confirmed (location, block) entries in the lower tiers (host, disk), all locations."""


class KVBlockIndex:
    """Per-location sets of cached blocks keyed by the router's own chained keys.

    Not thread-safe: one event loop owns it. Every method is O(blocks in the call) amortised, apart
    from ``clear`` (O(blocks at the location)) and ``stats`` (O(locations)).
    """

    def __init__(
        self,
        max_blocks: int,
        prediction_ttl_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self._clock = clock
        self._present: dict[int, int] = {}
        self._engine_maps: list[dict[int, int]] = []  # per slot
        self._slots = SlotTable()
        self._predictions = Predictions(prediction_ttl_s)
        self._lower = LowerTiers()
        self._eviction = Eviction(
            max_blocks, self._present, self._engine_maps, self._lower, self._predictions, clock
        )
        self._orphaned = 0
        self.on_predict: Callable[[Location, Sequence[int], int], None] | None = None

    # -- engine events -------------------------------------------------------------------------

    def apply_stored(
        self,
        location: Location,
        block_hashes: Sequence[int],
        parent_block_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
        tier: Tier = Tier.GPU,
        lora_name: str | None = None,
    ) -> None:
        """An engine's ``BlockStored``: mark the blocks present in ``tier`` at ``location``.

        Own keys chain from the own key of ``parent_block_hash`` at this location, in any tier
        (``None``: the root of ``lora_name``'s blocks, ``adapter_root``). An unknown parent
        cannot be chained: the blocks are counted as ``orphaned`` and skipped. Only full blocks
        that have a hash are used when ``token_ids`` and ``block_hashes`` disagree in length. A
        block stored on the GPU replaces a prediction for it; ``block_size`` is the location's."""
        if block_size <= 0:
            return
        slot = self._slot_for(location)
        self._slots.block_sizes[slot] = block_size
        if parent_block_hash is None:
            parent = ROOT_KEY if lora_name is None else adapter_root(lora_name)
        else:
            folded = parent_block_hash & KEY_MASK
            found = self._engine_maps[slot].get(folded)
            if found is None:
                found = self._lower.parent_key(slot, folded)
            if found is None:
                self._orphaned += len(block_hashes)
                return
            parent = found
        count = min(len(block_hashes), len(token_ids) // block_size)
        keys = chain_keys(token_ids[: count * block_size], block_size, parent)
        if tier is Tier.GPU:
            record(self._engine_maps[slot], self._present, slot_bit(slot), block_hashes, keys)
            self._predictions.confirm(slot, keys)
        else:
            self._lower.store(tier, slot, block_hashes, keys)
        self._eviction.enforce()

    def apply_removed(
        self, location: Location, block_hashes: Sequence[int], tier: Tier = Tier.GPU
    ) -> None:
        """An engine's ``BlockRemoved``: forget those blocks in ``tier`` at ``location`` (unknown
        ones are ignored); the other tiers keep theirs."""
        slot = self._slots.by_location.get(location)
        if slot is None:
            return
        gpu = tier is Tier.GPU
        tables = (self._engine_maps[slot], self._present) if gpu else self._lower.tables(tier, slot)
        if tables is not None:
            forget(*tables, slot_bit(slot), block_hashes)

    def clear(self, location: Location) -> None:
        """``AllBlocksCleared``, or purging a worker rank (reconnect, restart, drain, removal):
        forget every block in every tier, prediction, the engine-hash maps and the block size of
        ``location``, and free its slot for reuse."""
        slot = self._slots.release(location)
        if slot is None:
            return
        bit = slot_bit(slot)
        present = self._present
        for key in self._engine_maps[slot].values():
            clear_bit(present, key, bit)
        self._lower.clear_slot(slot)
        self._predictions.clear_slot(slot)
        self._engine_maps[slot] = {}

    def clear_worker(self, worker_id: str) -> None:
        """``clear`` every rank of ``worker_id``."""
        for location in [loc for loc in self._slots.by_location if loc[0] == worker_id]:
            self.clear(location)

    # -- routing -------------------------------------------------------------------------------

    def predict(
        self, location: Location, keys: Sequence[int], block_size: int, *, own: bool = True
    ) -> None:
        """A routing decision: the blocks ``keys`` will soon be at ``location``, for ``match``
        until ``prediction_ttl_s`` passes or a ``BlockStored`` confirms them; ignored when the
        location's known block size is not ``block_size`` (such keys could never match there).
        ``own``: decided here (``on_predict`` is told), not by a sibling process."""
        slot = self._slot_for(location)
        known = self._slots.block_sizes[slot]
        if known is not None and known != block_size:
            return
        if self._predictions.add(slot, keys, self._present, self._clock()):
            self._eviction.enforce()
        if own and self.on_predict is not None:
            self.on_predict(location, keys, block_size)

    def match(
        self,
        keys: Sequence[int],
        block_size: int,
        locations: Collection[Location] | None = None,
    ) -> dict[Location, int]:
        """For each location (only those in ``locations`` when given) whose block size is
        ``block_size`` or unknown, the number of leading ``keys`` present there, confirmed or
        predicted and unexpired: its longest cached prefix in blocks. Locations at 0 are omitted.

        Stops as soon as no candidate location holds the next key. Keys found are marked
        referenced, so the cap evicts them last.
        """
        alive = self._slots.candidates(block_size, locations)
        if not alive:
            return {}
        self._predictions.sweep(self._clock())
        found = self._scan(keys, alive)
        return self._slots.named(found)

    def match_tiers(
        self,
        keys: Sequence[int],
        block_size: int,
        locations: Collection[Location] | None = None,
    ) -> dict[Location, TierMatch]:
        """Like ``match``, but the leading run of ``keys`` held in any tier (GPU, predicted,
        host or disk) at each location, with its blocks counted per tier, each at the best tier
        holding it there. Without lower tiers it costs what ``match`` does."""
        alive = self._slots.candidates(block_size, locations)
        if not alive:
            return {}
        self._predictions.sweep(self._clock())
        if not self._lower.by_tier:
            found = self._scan(keys, alive)
            return {loc: TierMatch((n, 0, 0)) for loc, n in self._slots.named(found).items()}
        result: dict[Location, TierMatch] = {}
        scanned = self._lower.scan(keys, alive, self._present, self._predictions.union)
        for slot, counts in scanned.items():
            location = self._slots.locations[slot]
            if location is not None and any(counts):
                result[location] = TierMatch((counts[0], counts[1], counts[2]))
        return result

    # -- inspection ----------------------------------------------------------------------------

    def block_count(self, location: Location, tier: Tier = Tier.GPU) -> int:
        """Confirmed blocks in ``tier`` at ``location``."""
        slot = self._slots.by_location.get(location)
        if slot is None:
            return 0
        if tier is Tier.GPU:
            return len(self._engine_maps[slot])
        return self._lower.block_count(tier, slot)

    def tiers(self) -> list[Tier]:
        """The tiers any event has stored blocks in (GPU always), best first."""
        return [Tier.GPU, *sorted(self._lower.by_tier)]

    def block_size_of(self, location: Location) -> int | None:
        """The block size ``location``'s events reported, ``None`` when none yet."""
        slot = self._slots.by_location.get(location)
        return None if slot is None else self._slots.block_sizes[slot]

    def locations(self) -> list[Location]:
        """Locations with state (stored or predicted since they were last cleared)."""
        return list(self._slots.by_location)

    @property
    def stats(self) -> IndexStats:
        """Counts and a memory estimate; O(locations)."""
        predictions = self._predictions
        predictions.sweep(self._clock())
        blocks = sum(map(len, self._engine_maps))
        predicted = predictions.count()
        tables = sys.getsizeof(self._present) + sum(map(sys.getsizeof, self._engine_maps))
        objects = (len(self._present) + blocks * 2) * INT_BYTES
        lower = self._lower
        memory = tables + objects + predictions.bytes_estimate(predicted) + lower.bytes_estimate()
        return IndexStats(
            blocks=blocks,
            predicted=predicted,
            locations=len(self._slots.by_location),
            orphaned=self._orphaned,
            evicted=self._eviction.evicted,
            bytes_estimate=memory,
            lower_blocks=lower.blocks(),
        )

    # -- internals -----------------------------------------------------------------------------

    def _scan(self, keys: Sequence[int], alive: int) -> dict[int, int]:
        """Slot -> leading keys present, for the slots in ``alive``; marks the keys found as
        referenced. One dict lookup per key (predictions add one while any exist), stopping at
        the first key no remaining slot holds. (A plain loop: in CPython 3.11 it beats chains of
        ``map``/``accumulate`` over ``operator`` functions, and it can stop early.)"""
        present = self._present
        get = present.get
        predicted = self._predictions.union
        found: dict[int, int] = {}
        index = -1
        for index, key in enumerate(keys):
            value = get(key, 0)
            if not value & REF and value & alive:
                present[key] = value | REF
            if value & alive == alive:
                continue  # the common case: every remaining slot holds it
            if predicted:
                value |= predicted.get(key, 0)
            value &= alive
            if value != alive:
                for slot in slots_in(alive & ~value):
                    found[slot] = index
                alive = value
                if not alive:
                    return found
        for slot in slots_in(alive):
            found[slot] = index + 1
        return found

    def _slot_for(self, location: Location) -> int:
        slot = self._slots.by_location.get(location)
        if slot is None:
            slot = self._slots.add(location)
            if slot == len(self._engine_maps):  # a new slot, not a reused one
                self._engine_maps.append({})
                self._predictions.add_slot()
        return slot
