"""The prefills' own prefix-cache counters and block size, read from the ``/metrics`` text the
load monitor fetches anyway (``router.fleet.engine_load``): no extra request.

- vLLM: ``vllm:prefix_cache_hits_total`` and ``vllm:prefix_cache_queries_total`` (prompt tokens
  found cached, and looked up), per DP engine (label ``engine``), and the block size from
  ``vllm:cache_config_info{block_size=...}``;
- SGLang: ``sglang:cached_tokens_total`` and ``sglang:prompt_tokens_total`` per ``dp_rank``.

Per (worker, DP rank) the last ``READINGS`` readings are kept: the engine's hit rate over them
(for engines that do not report cached tokens per request) and when the engine last computed
prompt tokens (queries minus hits grew: it stored new blocks and should have published them).
A line scan, not a full parse: a few tens of microseconds per read, off the request path.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

import msgspec

__all__ = ["READINGS", "CacheReading", "EngineCache", "EngineCaches", "parse_cache_lines"]

READINGS = 64  # readings kept per rank (one per load poll)
_HITS = ("vllm:prefix_cache_hits_total", "sglang:cached_tokens_total")
_QUERIES = ("vllm:prefix_cache_queries_total", "sglang:prompt_tokens_total")
_CONFIG = "vllm:cache_config_info"
_PREFIXES = (*_HITS, *_QUERIES, _CONFIG)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
MAX_RANKS = 1024  # DP indexes read from one engine at most


class CacheReading(msgspec.Struct, array_like=True):
    """A rank's block size and its last (read time, hits, queries), as one process read them."""

    block_size: int | None
    last: tuple[float, float, float] | None


@dataclass(slots=True)
class EngineCache:
    """One rank's counters as last read, and the readings they moved through."""

    block_size: int | None = None
    last_computed_at: float | None = None  # time.monotonic() when queries - hits last grew
    readings: deque[tuple[float, float, float]] = field(
        default_factory=lambda: deque(maxlen=READINGS)
    )  # (at, hits, queries)

    def record(self, at: float, hits: float, queries: float) -> None:
        if self.readings:
            _, old_hits, old_queries = self.readings[-1]
            if queries < old_queries or hits < old_hits:  # the engine restarted
                self.readings.clear()
            elif queries - hits > old_queries - old_hits:
                self.last_computed_at = at
        self.readings.append((at, hits, queries))

    def hit_rate(self) -> tuple[float, float] | None:
        """(hit rate, prompt tokens looked up) over the kept readings; None: none looked up."""
        if len(self.readings) < 2:
            return None
        _, first_hits, first_queries = self.readings[0]
        _, hits, queries = self.readings[-1]
        looked_up = queries - first_queries
        return None if looked_up <= 0 else ((hits - first_hits) / looked_up, looked_up)


def parse_cache_lines(text: str) -> tuple[dict[int, tuple[float, float]], int | None]:
    """Per DP index, (hits, queries) summed over its series, and the block size; from a
    Prometheus text exposition (lines of the wanted names only)."""
    counts: dict[int, list[float]] = {}
    block_size: int | None = None
    for line in text.splitlines():
        if not line.startswith(_PREFIXES):
            continue
        name, _, rest = line.partition("{")
        labels, _, value = rest.rpartition("}") if rest else ("", "", line.split()[-1])
        found = dict(_LABEL.findall(labels))
        if name.split()[0] == _CONFIG:
            size = found.get("block_size", "")
            block_size = int(size) if size.isdigit() else block_size
            continue
        try:
            number = float(value.split()[0])
            index = int(found.get("engine") or found.get("dp_rank") or 0)
        except (ValueError, IndexError):
            continue
        if not math.isfinite(number) or not 0 <= index < MAX_RANKS:
            continue
        slot = counts.setdefault(index, [0.0, 0.0])
        slot[0 if name.split()[0] in _HITS else 1] += number
    return {index: (hits, queries) for index, (hits, queries) in counts.items()}, block_size


class EngineCaches:
    """Every prefill rank's ``EngineCache``, keyed by (worker id, DP rank); pruned to the pool."""

    def __init__(self) -> None:
        self._ranks: dict[tuple[str, int], EngineCache] = {}

    def record(self, worker_id: str, dp_size: int, text: str, at: float) -> None:
        """One ``/metrics`` text of a prefill: its counters per DP rank (as many indexes as
        ranks: in index order; one rank: every index summed)."""
        counts, block_size = parse_cache_lines(text)
        if not counts and block_size is None:
            return
        if dp_size <= 1:
            counts = {0: (sum(h for h, _ in counts.values()), sum(q for _, q in counts.values()))}
        elif len(counts) == dp_size:
            counts = {rank: counts[index] for rank, index in enumerate(sorted(counts))}
        for rank in range(max(dp_size, 1)):
            cache = self._ranks.setdefault((worker_id, rank), EngineCache())
            cache.block_size = block_size or cache.block_size
            if rank in counts:
                cache.record(at, *counts[rank])

    def get(self, location: tuple[str, int]) -> EngineCache | None:
        return self._ranks.get(location)

    def latest(self, location: tuple[str, int]) -> CacheReading | None:
        """The rank's block size and last reading (what ``router --workers N``'s process 0
        passes on to the others, ``router.fleet.host_probes``); None: nothing read."""
        cache = self._ranks.get(location)
        if cache is None or (not cache.readings and cache.block_size is None):
            return None
        return CacheReading(cache.block_size, cache.readings[-1] if cache.readings else None)

    def take(self, location: tuple[str, int], reading: CacheReading) -> None:
        """Another process's reading of the rank (once: an older or the same one is skipped)."""
        cache = self._ranks.setdefault(location, EngineCache())
        cache.block_size = reading.block_size or cache.block_size
        last = reading.last
        if last is not None and (not cache.readings or last[0] > cache.readings[-1][0]):
            cache.record(*last)

    def prune(self, live_ids: Collection[str]) -> None:
        for key in [key for key in self._ranks if key[0] not in live_ids]:
            del self._ranks[key]
