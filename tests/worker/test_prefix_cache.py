"""The per-rank prefix cache (``worker.prefix_cache``), its block keys (``worker.block_hash``)."""

from __future__ import annotations

import hashlib
import struct

import pytest

from transfer.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from worker.block_hash import sglang_block_keys, vllm_block_hasher
from worker.prefix_cache import PoolExhausted, PrefixCache

PAGE = 4


def _cache(pages: int) -> tuple[PrefixCache, list[list[KVEvent]]]:
    cache = PrefixCache(pages, PAGE)
    batches: list[list[KVEvent]] = []
    cache.events = batches.append
    return cache, batches


def _run(cache: PrefixCache, tokens: list[int]) -> tuple[int, list[int]]:
    """A whole request: acquire, compute everything, release; its cached tokens and pages."""
    lease = cache.acquire(tokens, sglang_block_keys(tokens, PAGE))
    cache.commit(lease, len(tokens))
    cache.release(lease.pages)
    return lease.cached_tokens, lease.pages


def _stored(batches: list[list[KVEvent]]) -> list[BlockStored]:
    return [e for batch in batches for e in batch if isinstance(e, BlockStored)]


def test_a_shared_prefix_is_reused_and_only_whole_pages_count() -> None:
    cache, _ = _cache(16)
    first = list(range(100, 114))  # 3 full pages + 2 tokens
    cached, pages = _run(cache, first)
    assert cached == 0
    again, pages_again = _run(cache, first[:12] + [7, 8, 9])
    assert again == 12  # the three full pages, shared
    assert pages_again[:3] == pages[:3]
    assert cache.free_pages == 16  # cached but unreferenced pages are free to take


def test_at_least_one_token_is_always_computed() -> None:
    cache, _ = _cache(16)
    tokens = list(range(12))  # exactly 3 pages
    _run(cache, tokens)
    cached, _ = _run(cache, tokens)
    assert cached == 8  # the last page is recomputed: the engine needs the last logits


def test_shared_pages_are_reference_counted() -> None:
    cache, _ = _cache(8)
    tokens = list(range(9))
    _run(cache, tokens)
    keys = sglang_block_keys(tokens, PAGE)
    a = cache.acquire(tokens, keys)
    b = cache.acquire(tokens, keys)
    assert a.pages[:2] == b.pages[:2] and a.cached_tokens == b.cached_tokens == 8
    assert cache.used_pages == 4  # 2 shared + 1 own each
    cache.release(a.pages)
    assert cache.used_pages == 3  # b still holds the shared pages
    with pytest.raises(PoolExhausted):
        cache.allocate(6)  # 5 free: b's shared pages cannot be evicted
    cache.release(b.pages)
    assert cache.used_pages == 0 and cache.cached_pages == 2


def test_unreferenced_pages_are_evicted_least_recently_used_first() -> None:
    cache, batches = _cache(6)
    old, new = [1] * 8 + [0], [2] * 8 + [0]
    _run(cache, old)  # 2 cached pages, released first
    _run(cache, new)  # 2 more, released later
    old_keys = [k.event_id for k in sglang_block_keys(old, PAGE)]
    batches.clear()
    taken = cache.allocate(4)  # 2 free pages + 2 evicted: the older prompt's, its tail first
    assert batches == [[BlockRemoved(block_hashes=[old_keys[1], old_keys[0]])]]
    cache.release(taken)
    assert _run(cache, new[:8] + [5])[0] == 8  # the recent prompt is still cached


def test_a_cache_hit_refreshes_recency() -> None:
    cache, batches = _cache(6)
    a, b = [1] * 8 + [0], [2] * 8 + [0]
    _run(cache, a)
    _run(cache, b)
    _run(cache, a)  # a is now the most recently used
    batches.clear()
    cache.allocate(4)
    removed = [e for batch in batches for e in batch if isinstance(e, BlockRemoved)]
    assert removed[0].block_hashes == [k.event_id for k in sglang_block_keys(b, PAGE)][::-1]


def test_allocation_under_pressure_evicts_only_what_it_needs() -> None:
    cache, _ = _cache(8)
    for prompt in range(3):  # 3 x 2 cached pages, 2 free pages left
        _run(cache, [prompt + 1] * 8 + [0])
    assert cache.cached_pages == 6 and cache.free_pages == 8
    cache.allocate(3)
    assert cache.cached_pages == 5  # one eviction was enough
    with pytest.raises(PoolExhausted):
        cache.allocate(6)
    assert cache.cached_pages == 5  # a failed allocation evicts nothing


def test_referenced_pages_are_never_evicted() -> None:
    cache, _ = _cache(4)
    tokens = [9] * 8 + [1]
    lease = cache.acquire(tokens, sglang_block_keys(tokens, PAGE))
    cache.commit(lease, len(tokens))  # cached while the request still holds them
    with pytest.raises(PoolExhausted):
        cache.allocate(2)
    assert cache.match(sglang_block_keys(tokens, PAGE)) == 2
    cache.release(lease.pages)
    cache.allocate(4)
    assert cache.match(sglang_block_keys(tokens, PAGE)) == 0


def test_block_stored_events_chain_and_carry_the_tokens() -> None:
    cache, batches = _cache(16)
    base = list(range(50, 62))  # 3 pages
    _run(cache, base + [0])
    _run(cache, base + list(range(70, 79)))  # reuses 3 pages, stores 2 more
    first, second = _stored(batches)
    keys = [k.event_id for k in sglang_block_keys(base + list(range(70, 79)), PAGE)]
    assert first.parent_block_hash is None and first.block_hashes == keys[:3]
    assert first.token_ids == base and first.block_size == PAGE and first.lora_id is None
    assert second.parent_block_hash == keys[2] and second.block_hashes == keys[3:5]
    assert second.token_ids == list(range(70, 78)) and first.medium == "GPU"


def test_a_duplicate_page_stays_private() -> None:
    cache, batches = _cache(16)
    tokens = [3] * 8 + [1]
    keys = sglang_block_keys(tokens, PAGE)
    a, b = cache.acquire(tokens, keys), cache.acquire(tokens, keys)  # both miss
    cache.commit(a, len(tokens))
    cache.commit(b, len(tokens))
    assert len(_stored(batches)) == 1 and cache.cached_pages == 2
    cache.release(a.pages)
    cache.release(b.pages)
    assert cache.free_pages == 16 and cache.cached_pages == 2


def test_clear_forgets_every_block() -> None:
    cache, batches = _cache(8)
    tokens = [4] * 8 + [1]
    _run(cache, tokens)
    held = cache.acquire(tokens, sglang_block_keys(tokens, PAGE))
    cache.clear()
    assert batches[-1] == [AllBlocksCleared()]
    assert cache.cached_pages == 0
    cache.release(held.pages)
    assert cache.free_pages == 8 and cache.cached_pages == 0


def test_sglang_keys_are_sglangs_chained_sha256() -> None:
    tokens = [1, 2, 3, 300, 5, 6, 7, 70000]
    keys = sglang_block_keys(tokens, 4)
    first = hashlib.sha256(struct.pack("<4I", 1, 2, 3, 300)).hexdigest()
    second = hashlib.sha256(bytes.fromhex(first) + struct.pack("<4I", 5, 6, 7, 70000)).hexdigest()
    for key, digest in zip(keys, (first, second), strict=True):
        high = int(digest[:16], 16)
        assert key.event_id == (high - (1 << 64) if high >= 1 << 63 else high)
    assert len(sglang_block_keys(tokens[:7], 4)) == 1  # full pages only


def test_vllm_keys_are_stable_per_seed_and_differ_between_seeds() -> None:
    tokens = list(range(40))
    seeded = vllm_block_hasher("1234")
    assert seeded(tokens, 16) == vllm_block_hasher("1234")(tokens, 16)
    assert seeded(tokens, 16) != vllm_block_hasher("99")(tokens, 16)
    assert vllm_block_hasher(None)(tokens, 16) != vllm_block_hasher(None)(tokens, 16)
    ids = [key.event_id for key in seeded(tokens, 16)]
    assert len(ids) == 2 and all(0 <= i < 1 << 64 for i in ids)
    # chained: the second block's key depends on the first block's tokens
    assert seeded([999] + tokens[1:], 16)[1] != seeded(tokens, 16)[1]
