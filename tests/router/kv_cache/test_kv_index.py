"""router.kv_cache.index: the KV block index fed by engine events and queried per request."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

from router.kv_cache import keys as kv_keys
from router.kv_cache.index import KVBlockIndex
from router.kv_cache.keys import KEY_BITS, ROOT_KEY, adapter_root, chain_keys
from router.kv_cache.slots import Location
from router.kv_tiers import Tier, TierMatch

BS = 4
A: Location = ("a", 0)
B: Location = ("b", 0)


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def prompt(seed: int, blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * BS)]


def store(
    index: KVBlockIndex,
    location: Location,
    tokens: list[int],
    hashes: list[int],
    parent: int | None = None,
) -> None:
    index.apply_stored(location, hashes, parent, tokens, BS)


def test_chain_keys_cover_full_blocks_only_and_chain_on_the_prefix() -> None:
    tokens = prompt(1, 3)
    keys = chain_keys(tokens + [7, 8], BS)  # a trailing partial block has no key
    assert len(keys) == 3
    assert all(0 <= key < 2**KEY_BITS for key in keys)
    assert chain_keys(tokens[:8], BS) == keys[:2]
    assert chain_keys(tokens[8:], BS, parent=keys[1]) == keys[2:]
    changed = chain_keys([99] + tokens[1:], BS)
    assert all(x != y for x, y in zip(changed, keys, strict=True))  # a change upstream moves all


def test_chain_keys_do_not_depend_on_the_hash_seed() -> None:
    # Load the module file alone: importing the ``router`` package would start the whole app.
    code = (
        "import importlib.util as u, sys; s = u.spec_from_file_location('kv', sys.argv[1]); "
        "m = sys.modules['kv'] = u.module_from_spec(s); s.loader.exec_module(m); "
        "print(m.chain_keys(range(40), 4), m.adapter_root('sql-lora'))"
    )
    path = str(Path(kv_keys.__file__))
    children = [
        subprocess.Popen(
            [sys.executable, "-c", code, path],
            env={**os.environ, "PYTHONHASHSEED": seed},
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed in ("1", "2")
    ]
    outputs = {child.communicate(timeout=30)[0] for child in children}
    assert outputs == {f"{chain_keys(list(range(40)), 4)} {adapter_root('sql-lora')}\n"}


def test_locations_with_different_engine_hashes_match_the_same_prompt() -> None:
    index = KVBlockIndex(max_blocks=100)
    tokens = prompt(1, 3)
    store(index, A, tokens, [11, 12, 13])
    store(index, B, tokens[:8], [-5, 2**63 + 7])  # other seed, other algorithm: other hashes
    assert index.match(chain_keys(tokens, BS), BS) == {A: 3, B: 2}


def test_blocks_chain_through_parent_hashes_across_events() -> None:
    index = KVBlockIndex(max_blocks=100)
    tokens = prompt(1, 6)
    store(index, A, tokens[:8], [1, 2])
    store(index, A, tokens[8:16], [3, 4], parent=2)
    store(index, A, tokens[16:], [5, 6], parent=4)
    assert index.match(chain_keys(tokens, BS), BS) == {A: 6}
    diverging = tokens[:12] + [0] * 12
    assert index.match(chain_keys(diverging, BS), BS) == {A: 3}
    assert index.block_count(A) == 6


def test_unknown_parent_blocks_are_orphaned_and_skipped() -> None:
    index = KVBlockIndex(max_blocks=100)
    tokens = prompt(1, 4)
    store(index, A, tokens[8:], [3, 4], parent=2)  # the parent's event was missed
    assert index.stats.orphaned == 2
    assert index.block_count(A) == 0
    assert index.match(chain_keys(tokens, BS), BS) == {}


def test_block_removed_drops_exactly_those_blocks() -> None:
    index = KVBlockIndex(max_blocks=100)
    tokens = prompt(1, 4)
    store(index, A, tokens, [1, 2, 3, 4])
    store(index, B, tokens, [1, 2, 3, 4])  # the same engine hashes at another location
    index.apply_removed(A, [3, 999])  # an unknown hash is ignored
    keys = chain_keys(tokens, BS)
    assert index.match(keys, BS) == {A: 2, B: 4}  # A's match stops at the hole
    assert index.match(keys[3:], BS) == {A: 1, B: 1}  # the blocks after it stay
    assert index.block_count(A) == 3
    assert index.block_count(B) == 4


def test_clear_forgets_blocks_predictions_and_engine_hashes() -> None:
    index = KVBlockIndex(max_blocks=100)
    tokens = prompt(1, 4)
    store(index, A, tokens[:8], [1, 2])
    index.predict(A, chain_keys(prompt(2, 2), BS), BS)
    store(index, B, tokens[:8], [1, 2])
    index.clear(A)
    assert index.match(chain_keys(tokens, BS), BS) == {B: 2}
    assert index.match(chain_keys(prompt(2, 2), BS), BS) == {}
    assert index.locations() == [B]
    assert index.block_size_of(A) is None
    store(index, A, tokens[8:], [3, 4], parent=2)  # the old hash -> key map went with it
    assert index.stats.orphaned == 2
    assert index.stats.blocks == 2


def test_clear_worker_clears_every_rank_of_that_worker_only() -> None:
    index = KVBlockIndex(max_blocks=100)
    tokens = prompt(1, 2)
    ranks = [("w", 0), ("w", 1), ("v", 0)]
    for rank in ranks:
        store(index, rank, tokens, [1, 2])
    index.clear_worker("w")
    assert index.match(chain_keys(tokens, BS), BS) == {("v", 0): 2}
    assert index.locations() == [("v", 0)]
    store(index, ("w", 1), tokens, [1, 2])  # a freed slot is reused cleanly
    assert index.match(chain_keys(tokens, BS), BS) == {("v", 0): 2, ("w", 1): 2}


def test_predictions_match_until_they_expire() -> None:
    clock = FakeClock()
    index = KVBlockIndex(max_blocks=100, prediction_ttl_s=2.0, clock=clock)
    keys = chain_keys(prompt(1, 3), BS)
    index.predict(A, keys, BS)
    assert index.match(keys, BS) == {A: 3}
    assert index.stats.predicted == 3
    clock.now += 1.0
    index.predict(A, keys[:1], BS)  # re-predicted: the first block lives on
    clock.now += 1.5
    assert index.match(keys, BS) == {A: 1}
    clock.now += 1.0
    assert index.match(keys, BS) == {}
    assert index.stats.predicted == 0
    assert index.block_count(A) == 0


def test_block_stored_confirms_a_prediction() -> None:
    clock = FakeClock()
    index = KVBlockIndex(max_blocks=100, prediction_ttl_s=2.0, clock=clock)
    tokens = prompt(1, 3)
    keys = chain_keys(tokens, BS)
    index.predict(A, keys, BS)
    store(index, A, tokens[:8], [1, 2])
    assert index.stats.predicted == 1
    clock.now += 5.0
    assert index.match(keys, BS) == {A: 2}
    assert index.stats.predicted == 0


def test_predictions_and_confirmed_blocks_combine_into_one_prefix() -> None:
    clock = FakeClock()
    index = KVBlockIndex(max_blocks=100, clock=clock)
    tokens = prompt(1, 4)
    keys = chain_keys(tokens, BS)
    store(index, A, tokens[:8], [1, 2])
    index.predict(A, keys, BS)  # routed here: the rest is on its way
    assert index.match(keys, BS) == {A: 4}
    clock.now += 10.0
    assert index.match(keys, BS) == {A: 2}


def test_only_locations_of_the_requested_block_size_match() -> None:
    index = KVBlockIndex(max_blocks=100)
    tokens = prompt(1, 4)
    index.apply_stored(A, [1, 2, 3, 4], None, tokens, 4)
    index.apply_stored(B, [1, 2], None, tokens, 8)
    assert index.block_size_of(A) == 4
    assert index.block_size_of(B) == 8
    assert index.match(chain_keys(tokens, 4), 4) == {A: 4}
    assert index.match(chain_keys(tokens, 8), 8) == {B: 2}
    unknown: Location = ("c", 0)  # only predictions so far: no block size, accepts any
    index.predict(unknown, chain_keys(tokens, 4), 4)
    assert index.block_size_of(unknown) is None
    assert index.match(chain_keys(tokens, 4), 4) == {A: 4, unknown: 4}


def test_match_can_be_restricted_to_given_locations() -> None:
    index = KVBlockIndex(max_blocks=100)
    tokens = prompt(1, 2)
    for location in (A, B, ("c", 0)):
        store(index, location, tokens, [1, 2])
    keys = chain_keys(tokens, BS)
    assert index.match(keys, BS, locations=[B, ("zz", 0)]) == {B: 2}
    assert index.match(keys, BS, locations=[]) == {}


def test_mismatched_event_lengths_use_only_full_hashed_blocks() -> None:
    index = KVBlockIndex(max_blocks=100)
    tokens = prompt(1, 3)
    store(index, A, tokens + [1, 2], [1, 2, 3])  # a trailing partial block
    store(index, B, tokens, [1, 2])  # more tokens than hashes
    assert index.match(chain_keys(tokens, BS), BS) == {A: 3, B: 2}
    assert index.stats.blocks == 5


def test_the_cap_bounds_entries_under_a_stream_of_unique_prompts() -> None:
    clock = FakeClock()
    index = KVBlockIndex(max_blocks=1000, clock=clock)
    locations = [(f"w{n}", 0) for n in range(4)]
    hashes = iter(range(1, 10**9))
    stored = 0
    for number in range(300):
        location = locations[number % 4]
        tokens = prompt(number, 8)
        store(index, location, tokens, [next(hashes) for _ in range(8)])
        index.predict(location, chain_keys(prompt(10**6 + number, 2), BS), BS)
        stored += 8
        stats = index.stats
        assert stats.blocks + stats.predicted <= 1000
    stats = index.stats
    assert stats.evicted >= stored - 1000
    assert stats.blocks == sum(index.block_count(loc) for loc in locations)
    assert index.match(chain_keys(prompt(299, 8), BS), BS) == {locations[3]: 8}  # newest kept
    assert index.match(chain_keys(prompt(0, 8), BS), BS) == {}  # oldest gone
    assert 0 < stats.bytes_estimate < 1000 * 400


def test_the_cap_evicts_blocks_that_matches_keep_using_last() -> None:
    index = KVBlockIndex(max_blocks=400)
    hot = prompt(0, 8)
    store(index, A, hot, list(range(1, 9)))
    hot_keys = chain_keys(hot, BS)
    for number in range(1, 200):  # 8 * 199 blocks: the cap evicts many times over
        store(index, A, prompt(number, 8), [number * 100 + i for i in range(8)])
        assert index.match(hot_keys, BS) == {A: 8}  # the hot system prompt stays
    assert index.match(chain_keys(prompt(1, 8), BS), BS) == {}
    assert index.stats.blocks <= 400


def test_the_cap_takes_from_the_location_holding_most() -> None:
    index = KVBlockIndex(max_blocks=200)
    small = prompt(0, 10)
    store(index, B, small, list(range(1, 11)))
    for number in range(1, 40):
        store(index, A, prompt(number, 8), [number * 100 + i for i in range(8)])
    assert index.match(chain_keys(small, BS), BS) == {B: 10}
    assert index.block_count(A) <= 190
    assert ROOT_KEY not in chain_keys(small, BS)


def test_matches_agree_with_a_brute_force_model() -> None:
    rng = random.Random(5)
    clock = FakeClock()
    locations: list[Location] = [("a", 0), ("a", 1), ("b", 0)]
    sequences = [[rng.randrange(3) for _ in range(16)] for _ in range(6)]
    for _ in range(30):  # bounded: 30 indexes of 80 steps
        index = KVBlockIndex(max_blocks=10**6, prediction_ttl_s=2.0, clock=clock)
        stored: dict[Location, dict[int, int]] = {loc: {} for loc in locations}
        predicted: dict[Location, dict[int, float]] = {loc: {} for loc in locations}
        for _ in range(80):
            location, tokens, roll = rng.choice(locations), rng.choice(sequences), rng.random()
            keys = chain_keys(tokens, BS)
            if roll < 0.5:
                count = rng.randint(1, 4)
                hashes = [hash((location, tuple(tokens[: (i + 1) * BS]))) for i in range(count)]
                store(index, location, tokens[: count * BS], hashes)
                stored[location].update(zip(hashes, keys, strict=False))
                for key in keys[:count]:
                    predicted[location].pop(key, None)
            elif roll < 0.65 and stored[location]:
                removed = rng.choice(list(stored[location]))
                index.apply_removed(location, [removed])
                del stored[location][removed]
            elif roll < 0.8:
                index.predict(location, keys, BS)
                have = set(stored[location].values())
                predicted[location].update((k, clock.now + 2.0) for k in keys if k not in have)
            elif roll < 0.85:
                index.clear(location)
                stored[location], predicted[location] = {}, {}
            else:
                clock.now += rng.choice([0.5, 1.0, 2.5])
            query = chain_keys(rng.choice(sequences), BS)
            expected = {}
            for loc in locations:
                live = {k for k, until in predicted[loc].items() if until > clock.now}
                have = set(stored[loc].values()) | live
                expected[loc] = next((i for i, k in enumerate(query) if k not in have), len(query))
            assert index.match(query, BS) == {loc: n for loc, n in expected.items() if n}


# --------------------------------------------------------------------------- tiered caches


def tiered(*counts: int) -> TierMatch:
    """A TierMatch of (GPU, host, disk) block counts."""
    return TierMatch((counts[0], counts[1], counts[2]))


def test_a_block_in_several_tiers_leaves_them_one_at_a_time() -> None:
    index = KVBlockIndex(max_blocks=100)
    tokens = prompt(1, 3)
    keys = chain_keys(tokens, BS)
    for tier in (Tier.GPU, Tier.HOST, Tier.DISK):  # write-through: the same blocks everywhere
        index.apply_stored(A, [1, 2, 3], None, tokens, BS, tier)
    assert index.match_tiers(keys, BS) == {A: tiered(3, 0, 0)}  # each block at its best tier
    assert [index.block_count(A, tier) for tier in Tier] == [3, 3, 3]
    index.apply_removed(A, [3], Tier.GPU)
    assert index.match_tiers(keys, BS) == {A: tiered(2, 1, 0)}
    assert index.match(keys, BS) == {A: 2}  # match: the GPU only
    index.apply_removed(A, [3], Tier.HOST)
    assert index.match_tiers(keys, BS) == {A: tiered(2, 0, 1)}
    index.apply_removed(A, [3], Tier.DISK)
    assert index.match_tiers(keys, BS) == {A: tiered(2, 0, 0)}
    assert [index.block_count(A, tier) for tier in Tier] == [2, 2, 2]
    assert index.stats.blocks == 2 and index.stats.lower_blocks == 4


def test_leading_runs_cross_tiers_and_stop_at_a_block_no_tier_holds() -> None:
    index = KVBlockIndex(max_blocks=100)
    tokens = prompt(1, 6)
    keys = chain_keys(tokens, BS)
    index.apply_stored(A, [1, 2], None, tokens[:8], BS, Tier.GPU)
    index.apply_stored(A, [3, 4], 2, tokens[8:16], BS, Tier.HOST)  # parent found on the GPU
    index.apply_stored(A, [6], 5, tokens[20:], BS, Tier.DISK)  # parent 5 unknown: orphaned
    assert index.stats.orphaned == 1
    assert index.match_tiers(keys, BS) == {A: tiered(2, 2, 0)}
    index.apply_stored(A, [5, 6], 4, tokens[16:], BS, Tier.DISK)  # parent found on the host
    assert index.match_tiers(keys, BS) == {A: tiered(2, 2, 2)}
    index.apply_removed(A, [2], Tier.GPU)  # a hole on the GPU no other tier fills
    assert index.match_tiers(keys, BS) == {A: tiered(1, 0, 0)}
    index.apply_stored(B, [7], None, tokens[:4], BS, Tier.HOST)
    index.apply_stored(B, [8, 9, 10], 7, tokens[4:16], BS, Tier.GPU)  # parent on the host only
    index.apply_stored(B, [11], 10, tokens[16:20], BS, Tier.DISK)
    assert index.match_tiers(keys, BS) == {A: tiered(1, 0, 0), B: tiered(3, 1, 1)}
    assert index.match_tiers(keys, BS, locations=[B]) == {B: tiered(3, 1, 1)}
    assert index.match(keys, BS) == {A: 1}  # B's first block is not on its GPU


def test_clear_forgets_every_tier() -> None:
    index = KVBlockIndex(max_blocks=100)
    tokens = prompt(1, 2)
    index.apply_stored(A, [1], None, tokens[:4], BS, Tier.HOST)
    index.apply_stored(A, [2], 1, tokens[4:], BS, Tier.DISK)
    index.apply_stored(B, [1, 2], None, tokens, BS, Tier.DISK)
    index.clear(A)
    assert index.match_tiers(chain_keys(tokens, BS), BS) == {B: tiered(0, 0, 2)}
    assert [index.block_count(A, tier) for tier in Tier] == [0, 0, 0]
    index.apply_stored(A, [3], 2, prompt(2, 1), BS, Tier.DISK)  # the hash maps went with it
    assert index.stats.orphaned == 1 and index.stats.lower_blocks == 2


def test_predictions_count_as_gpu_blocks_in_tier_matches() -> None:
    index = KVBlockIndex(max_blocks=100, clock=FakeClock())
    tokens = prompt(1, 4)
    keys = chain_keys(tokens, BS)
    index.apply_stored(A, [1, 2, 3, 4], None, tokens, BS, Tier.DISK)
    index.predict(A, keys[:3], BS)  # routed here: the engine loads them back to the GPU
    assert index.match_tiers(keys, BS) == {A: tiered(3, 0, 1)}


def test_a_gpu_only_index_keeps_no_lower_tier_state() -> None:
    index = KVBlockIndex(max_blocks=100)
    tokens = prompt(1, 2)
    store(index, A, tokens, [1, 2])
    index.apply_removed(A, [2], Tier.DISK)  # nothing there: no tier is created
    assert index.tiers() == [Tier.GPU]
    assert index.match_tiers(chain_keys(tokens, BS), BS) == {A: tiered(2, 0, 0)}
    index.apply_stored(A, [1], None, tokens[:4], BS, Tier.DISK)
    assert index.tiers() == [Tier.GPU, Tier.DISK]


def test_the_cap_counts_lower_tiers_and_takes_from_the_fullest_first() -> None:
    index = KVBlockIndex(max_blocks=200)
    hot = prompt(0, 10)
    store(index, A, hot, list(range(1, 11)))
    for number in range(1, 40):  # a disk tier far larger than the GPU's
        index.apply_stored(
            A, [number * 100 + i for i in range(8)], None, prompt(number, 8), BS, Tier.DISK
        )
    stats = index.stats
    assert stats.blocks + stats.lower_blocks <= 200 and stats.evicted > 0
    assert index.block_count(A) == 10  # the GPU's blocks stay
    assert index.match_tiers(chain_keys(hot, BS), BS) == {A: tiered(10, 0, 0)}
    assert index.match_tiers(chain_keys(prompt(39, 8), BS), BS) == {A: tiered(0, 0, 8)}
    assert index.match_tiers(chain_keys(prompt(1, 8), BS), BS) == {}  # oldest disk blocks gone


def test_tier_matches_agree_with_a_brute_force_model() -> None:
    rng = random.Random(7)
    locations: list[Location] = [("a", 0), ("a", 1), ("b", 0)]
    sequences = [[rng.randrange(3) for _ in range(16)] for _ in range(6)]
    for _ in range(30):  # bounded: 30 indexes of 80 steps
        index = KVBlockIndex(max_blocks=10**6)
        # per location and tier: engine hash -> own key
        held: dict[tuple[Location, Tier], dict[int, int]] = {
            (loc, tier): {} for loc in locations for tier in Tier
        }
        for _ in range(80):
            location, tokens, tier = (
                rng.choice(locations),
                rng.choice(sequences),
                rng.choice(list(Tier)),
            )
            keys, roll = chain_keys(tokens, BS), rng.random()
            mine = held[location, tier]
            if roll < 0.6:
                first, count = rng.randint(0, 2), rng.randint(1, 3)
                hashes = [hash((location, tuple(tokens[: (i + 1) * BS]))) for i in range(4)]
                parent = hashes[first - 1] if first else None
                known = parent is None or any(parent in held[location, t] for t in Tier)
                chunk = tokens[first * BS : (first + count) * BS]
                index.apply_stored(location, hashes[first : first + count], parent, chunk, BS, tier)
                if known:
                    mine.update(zip(hashes[first : first + count], keys[first:], strict=False))
            elif roll < 0.85 and mine:
                removed = rng.choice(list(mine))
                index.apply_removed(location, [removed], tier)
                del mine[removed]
            elif roll < 0.9:
                index.clear(location)
                for t in Tier:
                    held[location, t] = {}
            query = chain_keys(rng.choice(sequences), BS)
            expected = {}
            for loc in locations:
                by_tier = [0, 0, 0]
                for key in query:
                    best = next((t for t in Tier if key in held[loc, t].values()), None)
                    if best is None:
                        break
                    by_tier[best] += 1
                if any(by_tier):
                    expected[loc] = tiered(*by_tier)
            assert index.match_tiers(query, BS) == expected


def test_a_lora_adapters_blocks_are_apart_from_the_base_models_and_other_adapters() -> None:
    """The engines key an adapter's blocks apart (the events' ``lora_name``): the same tokens
    match only requests through the same adapter."""
    index = KVBlockIndex(max_blocks=100)
    tokens = prompt(1, 3)
    index.apply_stored(A, [1, 2], None, tokens[:8], BS, lora_name="sql-lora")
    index.apply_stored(A, [3], 2, tokens[8:], BS, lora_name="sql-lora")  # chained on its parent
    index.apply_stored(B, [7, 8, 9], None, tokens, BS)  # the base model's
    base, own = chain_keys(tokens, BS), chain_keys(tokens, BS, adapter_root("sql-lora"))
    assert index.match(base, BS) == {B: 3}
    assert index.match(own, BS) == {A: 3}
    assert index.match(chain_keys(tokens, BS, adapter_root("other-lora")), BS) == {}
    assert adapter_root(None) == ROOT_KEY
