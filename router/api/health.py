"""Liveness, readiness and the model list (FastAPI routes, off the hot path)."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from router.context import AppContext
from router.errors import NoWorkerAvailable, UpstreamError, error_body

__all__ = ["get_context", "router"]

router = APIRouter()


def get_context(request: Request) -> AppContext:
    """The one dependency that reads the lifespan-owned context."""
    ctx: AppContext = request.state.ctx
    return ctx


Context = Annotated[AppContext, Depends(get_context)]


@router.get("/health")
async def health() -> Response:
    """The router process is alive (says nothing about workers)."""
    return Response(status_code=200)


@router.get("/ready")
async def ready(ctx: Context) -> JSONResponse:
    """200 once at least one healthy prefill and one healthy decode worker exist, else 503."""
    pool = ctx.pool
    counts = {
        "prefill": {"healthy": len(pool.available_prefill()), "total": len(pool.prefill)},
        "decode": {"healthy": len(pool.available_decode()), "total": len(pool.decode)},
    }
    if pool.ready():
        return JSONResponse({"status": "ready", "workers": counts})
    return JSONResponse({"status": "not_ready", "workers": counts}, status_code=503)


@router.get("/v1/models")
async def models(ctx: Context) -> Response:
    """The union of the healthy decode workers' ``/v1/models`` lists."""
    decodes = ctx.pool.available_decode()
    if not decodes:
        unavailable = NoWorkerAvailable("no healthy decode worker to list models from")
        return Response(
            error_body(unavailable), status_code=unavailable.status, media_type="application/json"
        )
    timeout = ctx.settings.health.timeout_s
    answers = await asyncio.gather(
        *(_models_of(ctx, w.id, timeout) for w in decodes), return_exceptions=True
    )
    merged: dict[str, Any] = {}
    for answer in answers:
        if isinstance(answer, list):
            for entry in answer:
                merged.setdefault(entry["id"], entry)
    if not merged:
        failure = next((a for a in answers if isinstance(a, UpstreamError)), None)
        exc = failure or UpstreamError("no model list", role="decode", url="*")
        return Response(error_body(exc), status_code=exc.status, media_type="application/json")
    return JSONResponse({"object": "list", "data": list(merged.values())})


async def _models_of(ctx: AppContext, worker_id: str, timeout: float) -> list[dict[str, Any]]:
    response = await ctx.upstreams[worker_id].get("/v1/models", timeout)
    data = response.json() if response.status_code == 200 else None
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return []
    return [e for e in entries if isinstance(e, dict) and isinstance(e.get("id"), str)]
