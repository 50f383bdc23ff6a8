"""Does routing on the cache work: the views ``/admin/explain``, ``/ready``, the status page and
``/admin/diagnosis`` share (the agreement per prefill rank, the routing states, the findings)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from registry.admin import ADMIN_RESPONSES, authorizer
from registry.settings import RegistrySettings
from router.api.deps import Context
from router.context import AppContext
from router.kv_cache.index import Location
from router.observability.diagnosis import report

__all__ = ["diagnosis_routes", "recent_agreement", "routing_view"]


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


def diagnosis_routes(settings: RegistrySettings) -> APIRouter:
    routes = APIRouter(
        prefix="/admin", dependencies=[Depends(authorizer(settings))], responses=ADMIN_RESPONSES
    )

    @routes.get("/diagnosis")
    async def diagnosis(ctx: Context) -> JSONResponse:
        """Why routing on the cache does or does not work: each pool's and prefill rank's
        routing state with its recent agreement, and every finding (a named cause, its
        evidence, its remedy). ``router doctor URL`` prints it."""
        states = ctx.telemetry.states
        if states is None:
            return JSONResponse({"pools": [], "ranks": [], "findings": []})
        states.evaluate()  # judged now, not up to a second ago
        return JSONResponse(report(states, ctx.telemetry.pairs))

    return routes
