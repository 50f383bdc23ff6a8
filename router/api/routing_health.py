"""Does routing on the cache work: the views ``/admin/explain``, ``/ready``, the status page and
``/admin/diagnosis`` share (the agreement per prefill rank, the routing states, the findings)."""

from __future__ import annotations

from typing import Any

from router.context import AppContext
from router.kv_cache.index import Location

__all__ = ["recent_agreement", "routing_view"]


def _block_size(ctx: AppContext) -> Any:
    configured = ctx.settings.observability.engine_block_size

    def size(location: Location) -> int | None:
        return ctx.kv.index.block_size_of(location) or configured

    return size


def recent_agreement(ctx: AppContext) -> list[dict[str, Any]]:
    """Each prefill rank's recent predicted against actual cached tokens (this process's)."""
    board = ctx.telemetry.agreement
    board.prune({w.id for w in ctx.pool.prefill})
    tolerance = ctx.settings.observability.agreement_tolerance
    return board.describe(tolerance, _block_size(ctx))


def routing_view(ctx: AppContext) -> dict[str, Any] | None:
    """The routing states at their last evaluation: per prefill rank and per pool, the state
    (``exact``, ``degraded``, ``fallback``) and why; None when not judged."""
    states = ctx.telemetry.states
    return None if states is None else states.describe()
