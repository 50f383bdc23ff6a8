"""The prefills' own prefix-cache counters and block size (``router.fleet.engine_cache``), read
from the ``/metrics`` text the load monitor fetches."""

from __future__ import annotations

from router.fleet.engine_cache import EngineCache, EngineCaches, parse_cache_lines

VLLM = """# HELP vllm:prefix_cache_queries_total Prefix cache queries
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 640.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 448.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 64.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 0.0
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 1.0
"""
SGLANG = """sglang:prompt_tokens_total{dp_rank="0",model_name="m"} 300.0
sglang:cached_tokens_total{dp_rank="0",model_name="m"} 150.0
sglang:cached_tokens_total 5.0
"""


def test_vllm_counters_and_block_size_are_read_per_engine() -> None:
    assert parse_cache_lines(VLLM) == ({0: (448.0, 640.0), 1: (0.0, 64.0)}, 32)


def test_sglang_counters_are_read_per_dp_rank() -> None:
    assert parse_cache_lines(SGLANG) == ({0: (155.0, 300.0)}, None)


def test_the_hit_rate_and_the_last_computation_follow_the_readings() -> None:
    cache = EngineCache()
    assert cache.hit_rate() is None
    cache.record(10.0, 0.0, 100.0)
    cache.record(11.0, 50.0, 150.0)  # all of it a hit: nothing computed
    assert cache.last_computed_at is None
    cache.record(12.0, 60.0, 300.0)
    assert cache.last_computed_at == 12.0
    assert cache.hit_rate() == (0.3, 200.0)
    cache.record(13.0, 0.0, 10.0)  # the engine restarted: its counters began again
    assert cache.hit_rate() is None and len(cache.readings) == 1


def test_one_rank_sums_every_engine_and_ranks_take_indexes_in_order() -> None:
    caches = EngineCaches()
    caches.record("p", 1, VLLM, 1.0)
    single = caches.get(("p", 0))
    assert single is not None and single.block_size == 32
    assert single.readings[-1] == (1.0, 448.0, 704.0)
    caches.record("q", 2, VLLM, 1.0)
    second = caches.get(("q", 1))
    assert second is not None and second.readings[-1] == (1.0, 0.0, 64.0)
    caches.prune({"q"})
    assert caches.get(("p", 0)) is None and caches.get(("q", 0)) is not None
