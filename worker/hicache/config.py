"""The tiered KV cache's configuration (``pd-worker --hicache-*``) and its L3 store per rank.

``TierConfig`` holds the flags, validated; its defaults configure no tier at all (the worker runs
as without tiers), and with L2 on, SGLang's HiCache defaults where SGLang has the setting
(``write_through``, 2 hits for ``write_through_selective``, ``best_effort`` prefetch from 256
tokens). ``open_rank_store`` opens one DP rank's L3
(``worker.hicache.stores.open_page_store``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from worker.hicache.stores import open_page_store
from worker.hicache.stores.base import EvictCallback, FsyncPolicy, PageStore

__all__ = ["PrefetchPolicy", "StorageBackend", "TierConfig", "WritePolicy", "open_rank_store"]

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
StorageBackend = Literal["none", "file", "mooncake"]


@dataclass(frozen=True, slots=True)
class TierConfig:
    """The ``--hicache-*`` flags (defaults: no tier; with L2 on, SGLang's policies)."""

    host_pages: int = 0  # L2 capacity in pages (0: no tiers at all)
    write_policy: WritePolicy = "write_through"
    selective_hits: int = 2  # write_through_selective: hits before a backup
    storage_backend: StorageBackend = "none"  # L3
    storage_dir: str | None = None  # file backend; DP rank i of a DP>1 prefill: <dir>/rank<i>
    storage_pages: int = 0  # L3 capacity (0: unbounded)
    storage_fsync: FsyncPolicy = "never"
    mooncake_master: str | None = None
    mooncake_metadata: str = "P2PHANDSHAKE"
    prefetch_policy: PrefetchPolicy = "best_effort"
    prefetch_threshold_tokens: int = 256
    prefetch_timeout_s: float = 1.0
    prefetch_rate: float = 0.0  # bytes/s (0: no limit)
    host_bandwidth: float = 25e9  # bytes/s of the L1 <-> L2 link (0: free)
    storage_bandwidth: float = 0.0  # bytes/s cap on L3 I/O (0: the real I/O only)
    layerwise: bool = True

    def __post_init__(self) -> None:
        counts = (self.host_pages, self.storage_pages, self.prefetch_threshold_tokens)
        rates = (self.prefetch_timeout_s, self.prefetch_rate)
        if min(counts) < 0 or min(rates) < 0 or min(self.bandwidths) < 0:
            raise ValueError("hicache sizes, thresholds, rates and bandwidths must be >= 0")
        if self.selective_hits < 1:
            raise ValueError("--hicache-selective-hits must be >= 1")
        if self.storage and not self.host_pages:
            raise ValueError("a hicache storage backend needs host pages (--hicache-host-pages)")
        if self.storage_backend == "file" and not self.storage_dir:
            raise ValueError("--hicache-storage-backend file needs --hicache-storage-dir")
        if self.storage_backend == "mooncake" and not self.mooncake_master:
            raise ValueError("--hicache-storage-backend mooncake needs --hicache-mooncake-master")

    @property
    def bandwidths(self) -> tuple[float, float]:
        return self.host_bandwidth, self.storage_bandwidth

    @property
    def enabled(self) -> bool:
        return self.host_pages > 0

    @property
    def storage(self) -> bool:
        return self.storage_backend != "none"

    @property
    def backup_hits(self) -> int:
        """Hits that trigger an L1 -> L2 backup (0: only eviction does, ``write_back``)."""
        policy = self.write_policy
        return 1 if policy == "write_through" else self.selective_hits * (policy != "write_back")


def open_rank_store(
    config: TierConfig, rank: int, dp_size: int, key_prefix: str, on_evict: EvictCallback
) -> PageStore:
    """Rank ``rank``'s L3 store: ``<dir>`` (``<dir>/rank<i>`` when ``dp_size`` > 1)."""
    directory = None
    if config.storage_dir is not None:
        root = Path(config.storage_dir)
        directory = root / f"rank{rank}" if dp_size > 1 else root
    return open_page_store(
        config.storage_backend,
        directory=directory,
        capacity_pages=config.storage_pages or None,
        fsync=config.storage_fsync,
        mooncake_master=config.mooncake_master,
        mooncake_metadata=config.mooncake_metadata,
        mooncake_key_prefix=f"{key_prefix}rank{rank}/",
        on_evict=on_evict,
    )
