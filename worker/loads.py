"""``GET /v1/loads``: SGLang's JSON load report (sglang PR #16976), built from ``RankSnapshot``s.

Query: ``include`` (comma separated: ``core``, ``memory``, ``spec``, ``lora``, ``disagg``,
``queues``, ``all``; default ``all``; anything else is a 400) and ``dp_rank`` (one rank only).
Shape, as SGLang's ``v1_loads.get_loads``::

    {"timestamp": ISO-8601, "version": "pd-worker", "dp_rank_count": N,
     "loads": [{"dp_rank", "timestamp", "num_running_reqs", "num_waiting_reqs", "num_total_reqs",
                "num_used_tokens", "num_total_tokens", "max_total_num_tokens", "token_usage",
                "gen_throughput", "cache_hit_rate", "utilization", "max_running_requests",
                "memory": {...} | null, "disaggregation": {...} | null, "queues": {...} | null,
                "speculative": null, "lora": null}, ...],
     "aggregate": {"total_running_reqs", "total_waiting_reqs", "total_reqs",
                   "total_used_tokens", "total_tokens", "avg_token_usage", "avg_throughput",
                   "avg_utilization"}}

Meanings: running = in the forward pass or decoding; waiting = queued for KV pages or the forward
pass (a decode's requests waiting for pages are ``disaggregation.decode_prealloc_queue_reqs``,
those waiting for KV ``disaggregation.decode_transfer_queue_reqs``);
``num_used_tokens`` = referenced pages x page size; ``num_total_tokens`` = that plus the prompt
tokens still to compute (SGLang's DP-balance figure); ``token_usage`` = used / max tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from worker.metrics import RankSnapshot

__all__ = ["SECTIONS", "loads_report", "parse_include"]

SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


def parse_include(include: str | None) -> set[str]:
    """The requested sections; raises ``ValueError`` naming unknown ones."""
    wanted = {part.strip() for part in (include or "all").split(",") if part.strip()} or {"all"}
    unknown = wanted - SECTIONS
    if unknown:
        raise ValueError(f"Invalid include sections: {sorted(unknown)}. Valid: {sorted(SECTIONS)}")
    return set(SECTIONS) if "all" in wanted else wanted


def _core(snap: RankSnapshot, now: float) -> dict[str, Any]:
    used = snap.used_pages * snap.page_size
    return {
        "dp_rank": snap.rank,
        "timestamp": now,
        "num_running_reqs": snap.running,
        "num_waiting_reqs": snap.waiting,
        "num_total_reqs": snap.running + snap.waiting,
        "num_used_tokens": used,
        "num_total_tokens": used + snap.waiting_tokens,
        "max_total_num_tokens": snap.total_pages * snap.page_size,
        "token_usage": snap.usage,
        "gen_throughput": 0.0,
        "cache_hit_rate": snap.hit_rate,
        "utilization": snap.usage,
        "max_running_requests": 0,
    }


def _sections(snap: RankSnapshot, mode: str, include: set[str]) -> dict[str, Any]:
    memory = {
        "weight_gb": 0.0,
        "kv_cache_gb": snap.pool_bytes / 1e9,
        "graph_gb": 0.0,
        "token_capacity": snap.total_pages * snap.page_size,
    }
    disagg = {
        "mode": mode,
        "prefill_prealloc_queue_reqs": snap.bootstrap,
        "prefill_inflight_queue_reqs": snap.inflight,
        "decode_prealloc_queue_reqs": snap.prealloc,
        "decode_transfer_queue_reqs": snap.receiving,
        "decode_retracted_queue_reqs": 0,
        "kv_transfer_speed_gb_s": 0.0,
        "kv_transfer_latency_ms": 0.0,
    }
    queues = {"waiting": snap.waiting, "grammar": 0, "paused": 0, "retracted": 0}
    return {
        "memory": memory if "memory" in include else None,
        "speculative": None,
        "lora": None,
        "disaggregation": disagg if "disagg" in include else None,
        "queues": queues if "queues" in include else None,
    }


def _aggregate(loads: Sequence[dict[str, Any]]) -> dict[str, Any]:
    count = len(loads) or 1
    return {
        "total_running_reqs": sum(x["num_running_reqs"] for x in loads),
        "total_waiting_reqs": sum(x["num_waiting_reqs"] for x in loads),
        "total_reqs": sum(x["num_total_reqs"] for x in loads),
        "total_used_tokens": sum(x["num_used_tokens"] for x in loads),
        "total_tokens": sum(x["num_total_tokens"] for x in loads),
        "avg_token_usage": sum(x["token_usage"] for x in loads) / count,
        "avg_throughput": 0.0,
        "avg_utilization": sum(x["utilization"] for x in loads) / count,
    }


def loads_report(
    snapshots: Sequence[RankSnapshot], mode: str, include: set[str], dp_rank: int | None = None
) -> dict[str, Any]:
    """The ``/v1/loads`` JSON for ``snapshots`` (``mode``: prefill, decode or null)."""
    now = time.time()
    loads = [
        {**_core(snap, now), **_sections(snap, mode, include)}
        for snap in snapshots
        if dp_rank is None or snap.rank == dp_rank
    ]
    return {
        "timestamp": datetime.fromtimestamp(now, UTC).isoformat(),
        "version": "pd-worker",
        "dp_rank_count": len(loads),
        "loads": loads,
        "aggregate": _aggregate(loads),
    }
