"""Which worker rank holds which KV blocks: the index behind KV-cache-aware routing.

Engines report their prefix cache through KV events (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``, PROTOCOLS.md section 7). Their block hashes cannot be reproduced here (the
seed, algorithm and extra keys differ per engine, section 11.2), so, like llm-d's indexer, the index
keys blocks by the router's *own* chained keys (``chain_keys``) computed from the ``token_ids``
every ``BlockStored`` carries, and keeps an engine-hash -> own-key map per location so that
``BlockRemoved`` and the next event's ``parent_block_hash`` can be resolved. A routing decision adds
short-lived *predicted* entries (the race before the engine's first ``BlockStored``, as in Dynamo
and llm-d). ``match`` answers, per location, how many leading blocks of a prompt are cached on the
GPU; ``match_tiers`` also counts the lower tiers of a tiered cache (``router.kv_tiers``: host
memory, disk), each block at the best tier holding it.

Layout, chosen for memory (about 150 bytes per indexed block with the engine-hash map):

* ``_present``: own key -> bitmask: bit ``slot + 1`` per location holding it, and bit 0 when
  ``match`` found the key since the eviction clock last passed it (a second chance). Slots are
  given out per location and reused when a location is cleared, so with up to 7 locations the value
  is always a shared small int (<= 255); with 8, all but referenced keys of the 8th.
* per slot, ``dict`` engine hash -> own key, in stored order: the exact set of confirmed blocks
  there, and the eviction queue (CLOCK: a referenced key is moved to the back once, then evicted).
  Engine hashes are folded to 60 bits, which keeps each int object at 32 bytes.
* predictions: per slot ``dict`` own key -> deadline, a key -> slot-mask union for ``match`` and a
  deque of (deadline, slot, keys) swept lazily; deadlines are compared by identity, so a refreshed
  prediction is not dropped by its older twin. Predictions are GPU blocks.
* lower tiers (host, disk), created on their first event (a GPU-only cluster has none and pays
  nothing): per tier the same pair, own key -> slot mask and per slot engine hash -> own key. A
  block in several tiers has an entry in each; removing it from one leaves the others, and a
  parent hash resolves in any tier of its location.

Beyond ``max_blocks`` entries (confirmed in every tier + predicted, all locations) the index evicts
in batches from the (location, tier) holding the most blocks (fair share), oldest stored first,
then the oldest predictions. Pure data structure: no I/O, no locking (one event loop owns it),
injectable clock.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

from router.kv_tiers import Tier, TierMatch

__all__ = ["KEY_BITS", "ROOT_KEY", "IndexStats", "KVBlockIndex", "Location", "chain_keys"]

Location = tuple[str, int]
"""(worker id, DP rank): one engine scheduler with its own prefix cache."""

KEY_BITS = 60
_KEY_MASK = (1 << KEY_BITS) - 1
ROOT_KEY = 0x0B5E55ED_C0FFEE1
"""The parent of a sequence's first block (an arbitrary fixed constant below 2**60)."""

_REF = 1  # bit 0 of a ``_present`` value: referenced by ``match``
_EVICT_FRACTION = 128  # batch eviction frees about max_blocks / 128 entries beyond the cap
_SCAN_FACTOR = 4  # CLOCK: look at most this many entries per entry freed, per pass
_INT_BYTES = 32  # a 60-bit int object
_PRED_ENTRY_BYTES = 8  # the prediction's share of its deque item (tuple slot per key)


def chain_keys(token_ids: Sequence[int], block_size: int, parent: int = ROOT_KEY) -> list[int]:
    """The router's chained keys of the full blocks of ``token_ids`` (a trailing partial block has
    none): ``key_i = hash((key_{i-1}, hash(tokens of block i))) mod 2**60``, ``key_{-1}`` being
    ``parent``.

    Python's hash of ints and of tuples of ints does not depend on ``PYTHONHASHSEED`` (only
    str/bytes hashing is salted), so keys agree across the router's processes (same CPython build).
    The blocks are cut and hashed in C; about 0.2 us a block.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    keys: list[int] = []
    append = keys.append
    key = parent
    # zip over one iterator taken block_size times: the full blocks as tuples, built in C
    for block in map(hash, zip(*[iter(token_ids)] * block_size, strict=False)):
        key = hash((key, block)) & _KEY_MASK
        append(key)
    return keys


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


def _bit(slot: int) -> int:
    return 2 << slot


def _slots_in(mask: int) -> Iterator[int]:
    """The slots whose bits are set in ``mask`` (bit 0, the reference flag, is skipped)."""
    mask &= ~_REF
    while mask:
        low = mask & -mask
        yield low.bit_length() - 2
        mask ^= low


def _record(
    engine_map: dict[int, int],
    present: dict[int, int],
    bit: int,
    block_hashes: Sequence[int],
    keys: list[int],
) -> None:
    """Record each (engine hash, own key) in one tier of one slot, moving re-stored hashes to
    the back of the eviction queue."""
    for block_hash, key in zip(block_hashes, keys, strict=False):  # keys may be fewer
        folded = block_hash & _KEY_MASK
        engine_map.pop(folded, None)
        engine_map[folded] = key
        present[key] = present.get(key, 0) | bit


def _clear_bit(present: dict[int, int], key: int, bit: int) -> None:
    """Clear a slot's bit of ``key`` in one tier's ``present``; drop the key when no slot is
    left."""
    value = present.get(key)
    if value is None:
        return
    value &= ~bit
    if value & ~_REF:
        present[key] = value
    else:
        del present[key]


def _lower_masks(
    host: dict[int, int], disk: dict[int, int], key: int, gpu: int, alive: int
) -> tuple[int, int, int]:
    """The slots of ``alive`` whose best tier holding ``key`` is the GPU (``gpu``: given), the
    host or the disk; marks ``key`` referenced in the lower tier that counts it."""
    rest = alive & ~gpu
    value = host.get(key, 0)
    on_host = value & rest
    if on_host and not value & _REF:
        host[key] = value | _REF
    rest &= ~on_host
    if not rest:
        return gpu, on_host, 0
    value = disk.get(key, 0)
    on_disk = value & rest
    if on_disk and not value & _REF:
        disk[key] = value | _REF
    return gpu, on_host, on_disk


def _add_run(counts: dict[int, list[int]], run: tuple[int, int, int], length: int) -> None:
    """Count ``length`` more blocks for each slot in ``run`` (a slot mask per ``Tier``), in
    that tier."""
    for tier, mask in enumerate(run):
        for slot in _slots_in(mask):
            counts[slot][tier] += length


class _LowerTier:
    """One lower tier's blocks, laid out like the GPU's: own key -> slot mask (bit 0: referenced),
    and per slot engine hash -> own key in stored order (the set there and its eviction queue)."""

    __slots__ = ("maps", "present")

    def __init__(self) -> None:
        self.present: dict[int, int] = {}
        self.maps: dict[int, dict[int, int]] = {}

    def blocks(self) -> int:
        return sum(map(len, self.maps.values()))


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
        self._max_blocks = max_blocks
        self._ttl = prediction_ttl_s
        self._clock = clock
        self._present: dict[int, int] = {}
        self._slots: dict[Location, int] = {}
        self._slot_locations: list[Location | None] = []
        self._free_slots: list[int] = []
        self._block_sizes: list[int | None] = []
        self._engine_maps: list[dict[int, int]] = []
        self._predicted_by_slot: list[dict[int, float]] = []
        self._predicted: dict[int, int] = {}
        self._expiry: deque[tuple[float, int, tuple[int, ...]]] = deque()
        self._lower: dict[Tier, _LowerTier] = {}  # created on a tier's first event
        self._orphaned = 0
        self._evicted = 0

    # -- engine events -------------------------------------------------------------------------

    def apply_stored(
        self,
        location: Location,
        block_hashes: Sequence[int],
        parent_block_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
        tier: Tier = Tier.GPU,
    ) -> None:
        """An engine's ``BlockStored``: mark the blocks present in ``tier`` at ``location``.

        Own keys chain from the own key of ``parent_block_hash`` at this location, in any tier
        (``None``: the root). An unknown parent cannot be chained: the blocks are counted as
        ``orphaned`` and skipped. Only full blocks that have a hash are used when ``token_ids``
        and ``block_hashes`` disagree in length. A block stored on the GPU replaces a prediction
        for it, and ``block_size`` becomes the location's block size.
        """
        if block_size <= 0:
            return
        slot = self._slot_for(location)
        self._block_sizes[slot] = block_size
        if parent_block_hash is None:
            parent = ROOT_KEY
        else:
            found = self._parent_key(slot, parent_block_hash & _KEY_MASK)
            if found is None:
                self._orphaned += len(block_hashes)
                return
            parent = found
        count = min(len(block_hashes), len(token_ids) // block_size)
        keys = chain_keys(token_ids[: count * block_size], block_size, parent)
        if tier is Tier.GPU:
            self._store(slot, block_hashes, keys)
        else:
            lower = self._lower.get(tier) or self._lower.setdefault(tier, _LowerTier())
            engine_map = lower.maps.setdefault(slot, {})
            _record(engine_map, lower.present, _bit(slot), block_hashes, keys)
        self._enforce_cap()

    def apply_removed(
        self, location: Location, block_hashes: Sequence[int], tier: Tier = Tier.GPU
    ) -> None:
        """An engine's ``BlockRemoved``: forget those blocks in ``tier`` at ``location`` (unknown
        ones are ignored); the other tiers keep theirs."""
        slot = self._slots.get(location)
        if slot is None:
            return
        if tier is Tier.GPU:
            engine_map, present = self._engine_maps[slot], self._present
        else:
            lower = self._lower.get(tier)
            found = None if lower is None else lower.maps.get(slot)
            if lower is None or found is None:
                return
            engine_map, present = found, lower.present
        bit = _bit(slot)
        for block_hash in block_hashes:
            key = engine_map.pop(block_hash & _KEY_MASK, None)
            if key is not None:
                _clear_bit(present, key, bit)

    def clear(self, location: Location) -> None:
        """``AllBlocksCleared``, or purging a worker rank (reconnect, restart, drain, removal):
        forget every block in every tier, prediction, the engine-hash maps and the block size of
        ``location``, and free its slot for reuse."""
        slot = self._slots.pop(location, None)
        if slot is None:
            return
        bit = _bit(slot)
        present = self._present
        for key in self._engine_maps[slot].values():
            _clear_bit(present, key, bit)
        for lower in self._lower.values():
            for key in lower.maps.pop(slot, {}).values():
                _clear_bit(lower.present, key, bit)
        predicted = self._predicted
        for key in self._predicted_by_slot[slot]:
            self._drop_predicted_bit(predicted, key, bit)
        self._engine_maps[slot] = {}
        self._predicted_by_slot[slot] = {}
        self._block_sizes[slot] = None
        self._slot_locations[slot] = None
        self._free_slots.append(slot)

    def clear_worker(self, worker_id: str) -> None:
        """``clear`` every rank of ``worker_id``."""
        for location in [loc for loc in self._slots if loc[0] == worker_id]:
            self.clear(location)

    # -- routing -------------------------------------------------------------------------------

    def predict(self, location: Location, keys: Sequence[int], block_size: int) -> None:
        """A routing decision: the blocks ``keys`` will soon be at ``location``.

        The entries count for ``match`` until ``prediction_ttl_s`` passes or a ``BlockStored``
        confirms them. Ignored when the location's known block size is not ``block_size`` (such
        keys could never match there).
        """
        slot = self._slot_for(location)
        known = self._block_sizes[slot]
        if known is not None and known != block_size:
            return
        now = self._clock()
        self._sweep(now)
        deadline = now + self._ttl
        bit = _bit(slot)
        present = self._present
        by_slot = self._predicted_by_slot[slot]
        predicted = self._predicted
        fresh = []
        for key in keys:
            if present.get(key, 0) & bit:
                continue  # already confirmed there
            by_slot[key] = deadline
            predicted[key] = predicted.get(key, 0) | bit
            fresh.append(key)
        if fresh:
            self._expiry.append((deadline, slot, tuple(fresh)))
            self._enforce_cap()

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
        alive = self._candidates(block_size, locations)
        if not alive:
            return {}
        self._sweep(self._clock())
        found = self._scan(keys, alive)
        return self._by_location(found)

    def match_tiers(
        self,
        keys: Sequence[int],
        block_size: int,
        locations: Collection[Location] | None = None,
    ) -> dict[Location, TierMatch]:
        """Like ``match``, but the leading run of ``keys`` held in any tier (GPU, predicted,
        host or disk) at each location, with its blocks counted per tier, each at the best tier
        holding it there. Without lower tiers it costs what ``match`` does."""
        alive = self._candidates(block_size, locations)
        if not alive:
            return {}
        self._sweep(self._clock())
        if not self._lower:
            found = self._scan(keys, alive)
            return {loc: TierMatch((n, 0, 0)) for loc, n in self._by_location(found).items()}
        result: dict[Location, TierMatch] = {}
        for slot, counts in self._scan_tiers(keys, alive).items():
            location = self._slot_locations[slot]
            if location is not None and any(counts):
                result[location] = TierMatch((counts[0], counts[1], counts[2]))
        return result

    # -- inspection ----------------------------------------------------------------------------

    def block_count(self, location: Location, tier: Tier = Tier.GPU) -> int:
        """Confirmed blocks in ``tier`` at ``location``."""
        slot = self._slots.get(location)
        if slot is None:
            return 0
        if tier is Tier.GPU:
            return len(self._engine_maps[slot])
        lower = self._lower.get(tier)
        return 0 if lower is None else len(lower.maps.get(slot, ()))

    def tiers(self) -> list[Tier]:
        """The tiers any event has stored blocks in (GPU always), best first."""
        return [Tier.GPU, *sorted(self._lower)]

    def block_size_of(self, location: Location) -> int | None:
        """The block size ``location``'s events reported, ``None`` when none yet."""
        slot = self._slots.get(location)
        return None if slot is None else self._block_sizes[slot]

    def locations(self) -> list[Location]:
        """Locations with state (stored or predicted since they were last cleared)."""
        return list(self._slots)

    @property
    def stats(self) -> IndexStats:
        """Counts and a memory estimate; O(locations)."""
        self._sweep(self._clock())
        blocks = sum(map(len, self._engine_maps))
        predicted = sum(map(len, self._predicted_by_slot))
        return IndexStats(
            blocks=blocks,
            predicted=predicted,
            locations=len(self._slots),
            orphaned=self._orphaned,
            evicted=self._evicted,
            bytes_estimate=self._bytes_estimate(blocks, predicted),
            lower_blocks=sum(lower.blocks() for lower in self._lower.values()),
        )

    # -- internals -----------------------------------------------------------------------------

    def _scan(self, keys: Sequence[int], alive: int) -> dict[int, int]:
        """Slot -> leading keys present, for the slots in ``alive``; marks the keys found as
        referenced. One dict lookup per key (predictions add one while any exist), stopping at
        the first key no remaining slot holds. (A plain loop: in CPython 3.11 it beats chains of
        ``map``/``accumulate`` over ``operator`` functions, and it can stop early.)"""
        present = self._present
        get = present.get
        predicted = self._predicted
        found: dict[int, int] = {}
        index = -1
        for index, key in enumerate(keys):
            value = get(key, 0)
            if not value & _REF and value & alive:
                present[key] = value | _REF
            if value & alive == alive:
                continue  # the common case: every remaining slot holds it
            if predicted:
                value |= predicted.get(key, 0)
            value &= alive
            if value != alive:
                for slot in _slots_in(alive & ~value):
                    found[slot] = index
                alive = value
                if not alive:
                    return found
        for slot in _slots_in(alive):
            found[slot] = index + 1
        return found

    def _scan_tiers(self, keys: Sequence[int], alive: int) -> dict[int, list[int]]:
        """Slot -> leading keys held in any tier, counted per ``Tier``, for the slots in
        ``alive``; marks the keys found as referenced in the tier that counts them. Per key: the
        slot mask of each tier (a slot in its best tier only); counts are added when the masks
        change (a slot drops out or moves tier), so a run in one tier costs no per-slot work,
        and a key every remaining slot holds on the GPU costs what ``_scan`` pays. (Inlined:
        this loop runs per prompt block.)"""
        present = self._present
        get = present.get
        lower = self._lower
        host, disk = (lower[t].present if t in lower else {} for t in (Tier.HOST, Tier.DISK))
        predicted = self._predicted
        counts = {slot: [0, 0, 0] for slot in _slots_in(alive)}
        run = (alive, 0, 0)  # per tier, the slots whose current run is in it (empty so far)
        start = 0
        for index, key in enumerate(keys):
            value = get(key, 0)
            if value & alive and not value & _REF:
                present[key] = value | _REF
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

    def _by_location(self, found: dict[int, int]) -> dict[Location, int]:
        result: dict[Location, int] = {}
        for slot, count in found.items():
            location = self._slot_locations[slot]
            if count and location is not None:
                result[location] = count
        return result

    def _slot_for(self, location: Location) -> int:
        slot = self._slots.get(location)
        if slot is not None:
            return slot
        if self._free_slots:
            slot = self._free_slots.pop()
            self._slot_locations[slot] = location
        else:
            slot = len(self._slot_locations)
            self._slot_locations.append(location)
            self._block_sizes.append(None)
            self._engine_maps.append({})
            self._predicted_by_slot.append({})
        self._slots[location] = slot
        return slot

    def _parent_key(self, slot: int, folded: int) -> int | None:
        """The own key of engine hash ``folded`` at ``slot``, in any tier."""
        found = self._engine_maps[slot].get(folded)
        if found is None:
            for lower in self._lower.values():
                found = lower.maps.get(slot, {}).get(folded)
                if found is not None:
                    break
        return found

    def _store(self, slot: int, block_hashes: Sequence[int], keys: list[int]) -> None:
        """Record each (engine hash, own key) on the GPU at ``slot`` and confirm any prediction
        for those keys."""
        bit = _bit(slot)
        _record(self._engine_maps[slot], self._present, bit, block_hashes, keys)
        by_slot = self._predicted_by_slot[slot]
        if by_slot:
            predicted = self._predicted
            for key in keys:
                if by_slot.pop(key, None) is not None:
                    self._drop_predicted_bit(predicted, key, bit)

    @staticmethod
    def _drop_predicted_bit(predicted: dict[int, int], key: int, bit: int) -> None:
        mask = predicted.get(key, 0) & ~bit
        if mask:
            predicted[key] = mask
        else:
            predicted.pop(key, None)

    def _candidates(self, block_size: int, locations: Collection[Location] | None) -> int:
        """The slot mask of locations that may answer a match at ``block_size``."""
        sizes = self._block_sizes
        slots = self._slots
        chosen = slots.values() if locations is None else (slots.get(loc) for loc in locations)
        mask = 0
        for slot in chosen:
            if slot is not None and sizes[slot] in (None, block_size):
                mask |= _bit(slot)
        return mask

    def _sweep(self, now: float) -> None:
        """Drop predictions whose deadline has passed (oldest first; the deque is in order)."""
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            self._expire(*expiry.popleft())

    def _expire(self, deadline: float, slot: int, keys: tuple[int, ...]) -> int:
        """Forget the predictions of one ``predict`` call that were not refreshed since."""
        by_slot = self._predicted_by_slot[slot]
        predicted = self._predicted
        bit = _bit(slot)
        dropped = 0
        for key in keys:
            if by_slot.get(key) is deadline:
                del by_slot[key]
                self._drop_predicted_bit(predicted, key, bit)
                dropped += 1
        return dropped

    def _enforce_cap(self) -> None:
        """Evict beyond ``max_blocks``: confirmed blocks from the fullest (location, tier) first,
        then the oldest predictions. Frees a batch past the cap so the work is O(1) amortised."""
        total = sum(map(len, self._engine_maps)) + sum(map(len, self._predicted_by_slot))
        if self._lower:
            total += sum(lower.blocks() for lower in self._lower.values())
        if total <= self._max_blocks:
            return
        self._sweep(self._clock())
        excess = total - self._max_blocks + self._max_blocks // _EVICT_FRACTION
        queues = self._eviction_queues()
        for _ in range(len(queues) * 4 + 4):  # bounded: each pass frees or stops
            if excess <= 0:
                return
            fullest = max(queues, key=lambda queue: len(queue[0]))
            if not fullest[0]:
                break
            excess -= self._evict_confirmed(*fullest, excess, second_chance=True)
        for queue in queues:  # last resort: no second chances
            if excess > 0:
                excess -= self._evict_confirmed(*queue, excess, second_chance=False)
        while excess > 0 and self._expiry:
            excess -= self._expire(*self._expiry.popleft())

    def _eviction_queues(self) -> list[tuple[dict[int, int], dict[int, int], int]]:
        """(engine-hash map, its tier's ``present``, slot bit) of every tier at every slot, GPU
        first in slot order."""
        queues = [(m, self._present, _bit(slot)) for slot, m in enumerate(self._engine_maps)]
        for lower in self._lower.values():
            queues += [(m, lower.present, _bit(slot)) for slot, m in lower.maps.items()]
        return queues

    def _evict_confirmed(
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
            if value & _REF and second_chance:
                present[entry[1]] = value & ~_REF
                spared.append(entry)
            else:
                victims.append(entry)
                if len(victims) >= wanted:
                    break
        for block_hash, key in victims:
            del engine_map[block_hash]
            _clear_bit(present, key, bit)
        for block_hash, key in spared:
            del engine_map[block_hash]
            engine_map[block_hash] = key
        self._evicted += len(victims)
        return len(victims)

    def _bytes_estimate(self, blocks: int, predicted: int) -> int:
        tables = sys.getsizeof(self._present) + sys.getsizeof(self._predicted)
        tables += sum(map(sys.getsizeof, self._engine_maps))
        tables += sum(map(sys.getsizeof, self._predicted_by_slot))
        objects = (len(self._present) + blocks * 2) * _INT_BYTES
        for lower in self._lower.values():
            tables += sys.getsizeof(lower.present) + sum(map(sys.getsizeof, lower.maps.values()))
            objects += (len(lower.present) + lower.blocks() * 2) * _INT_BYTES
        return tables + objects + predicted * _PRED_ENTRY_BYTES
