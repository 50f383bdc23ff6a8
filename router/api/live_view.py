"""A worker as this router sees it live, for the admin API's worker listing."""

from __future__ import annotations

from typing import Any

from router.context import AppContext

__all__ = ["live_view"]


def live_view(ctx: AppContext, worker_id: str) -> dict[str, Any] | None:
    """This router's live state of a worker, for the admin API."""
    worker = ctx.pool.get(worker_id)
    if worker is None:
        return None
    view: dict[str, Any] = {
        "healthy": worker.healthy,
        "draining": worker.draining,
        "inflight": worker.host_inflight(),
    }
    if worker.role.value == "prefill":
        view["dp_size"] = worker.dp_size
        view["ranks"] = [
            {
                "dp_rank": rank,
                "inflight": worker.rank_load(rank),
                # prompt tokens this router's in-flight prefill legs there will compute
                "pending_prefill_tokens": worker.pending_tokens(rank),
                "engine_id": worker.engine_ids[rank] if rank < len(worker.engine_ids) else None,
                # confirmed blocks the KV index holds for this rank, and its event stream
                "kv_blocks": ctx.kv.index.block_count((worker.id, rank)),
                "kv_events": ctx.kv.feed.stats((worker.id, rank)),
            }
            for rank in range(len(worker.rank_inflight))
        ]
    return view
