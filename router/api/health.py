"""Liveness, readiness and the model list (FastAPI routes, off the hot path)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from registry.models import redact_url
from router.api.completions_doc import error_response
from router.api.deps import Context
from router.api.routing_health import routing_view
from router.context import AppContext
from router.errors import NoWorkerAvailable, UpstreamError, error_body
from router.workers import Role, Worker

__all__ = ["router"]

router = APIRouter()


@router.get(
    "/health",
    response_class=Response,
    responses={200: {"description": "Alive (an empty body)", "content": {}}},
)
async def health() -> Response:
    """The router process is alive (says nothing about workers)."""
    return Response(status_code=200)


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}}},
)
async def metrics(ctx: Context) -> Response:
    """The router's Prometheus metrics (requests, stages, routing, workers, pairs, feeds); with
    `--workers N`, every process's merged (`pdr_router_processes`: how many answered)."""
    siblings = ctx.telemetry.siblings
    body = ctx.telemetry.metrics.render() if siblings is None else await siblings.metrics()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/ready", responses={503: {"description": "Not ready (the same body)"}})
async def ready(ctx: Context) -> JSONResponse:
    """200 once at least one healthy prefill and one healthy decode worker exist, else 503 (and
    503 from the moment the router begins shutting down).

    The body lists every worker with its health, in-flight requests and DP layout, and the
    circuit breakers that are open or half-open (a worker or a prefill->decode pair, the reason,
    seconds until the next trial); URLs are shown without credentials (this route needs no
    auth). An open breaker does not make the router not ready: it is retried by itself. With
    `--replica-listen`, `replicas` says what this replica hears of its peers; one cut off from
    a peer stays ready (it routes on its own state) and says why it is `degraded`. `routing`:
    each prefill rank's and pool's routing state (`exact`, `degraded`, `fallback`) and why; a
    degraded routing state does not make the router not ready.
    """
    pool = ctx.pool
    registry = ctx.fleet.discovery.status
    watcher, replicas = ctx.fleet.pod_watcher, ctx.fleet.replicas
    ready = pool.ready() and not ctx.lifecycle.shutting_down
    status = "ready" if ready else "not_ready"
    body = {
        "status": "shutting_down" if ctx.lifecycle.shutting_down else status,
        "prefill": [_describe(w) for w in pool.prefill],
        "decode": [_describe(w) for w in pool.decode],
        "registry": {"url": redact_url(registry.url), "ok": registry.ok, "error": registry.error},
        # --discovery k8s: whether the engine pods are listed and watched now
        **({} if watcher is None else {"kubernetes": watcher.status.as_dict()}),
        # --replica-listen: the peers heard, and why this replica is degraded (null: it is not)
        **({} if replicas is None else {"replicas": replicas.stats()}),
        # P<->D pairs whose decode recomputed the prompt lately: PD did not happen there
        # circuit breakers that keep traffic away now (open or half-open), with the reason
        "circuits": [t.describe() for t in ctx.pipeline.circuits.tripped()],
        "suspect_pairs": [
            {
                "prefill": redact_url(pair.prefill_url),
                "decode": redact_url(pair.decode_url),
                "recomputes": pair.recomputes,
                "requests": pair.requests,
            }
            for pair in ctx.telemetry.pairs.suspects()
        ],
        # routing on the cache: EXACT / DEGRADED / FALLBACK per prefill rank and pool, and why
        "routing": routing_view(ctx),
    }
    return JSONResponse(body, status_code=200 if ready else 503)


def _describe(worker: Worker) -> dict[str, Any]:
    info: dict[str, Any] = {
        "id": worker.id,
        "url": redact_url(worker.url),
        "healthy": worker.healthy,
        "inflight": worker.host_inflight(),
        "draining": worker.draining,
        "ejected": worker.ejected,
    }
    if worker.models:  # several models: the names it serves, its LoRA adapters among them
        info["models"], info["adapters"] = sorted(worker.models), sorted(worker.adapters)
    if worker.role is Role.PREFILL:
        info["bootstrap_port"] = worker.bootstrap_port
        info["dp_size"] = worker.dp_size
        if worker.engine_ids:
            info["engine_ids"] = list(worker.engine_ids)
    return info


@router.get(
    "/v1/models",
    responses={
        401: error_response("--api-keys: no API key, or an unknown one"),
        502: error_response("No decode worker answered with a model list"),
        503: error_response("No healthy decode worker"),
        504: error_response("A decode worker timed out"),
    },
)
async def models(ctx: Context, request: Request) -> Response:
    """The models served, each once with its pools (the workers serving it, and the aliases
    naming it) when workers name their models; else the union of the healthy decode workers'
    ``/v1/models`` lists, read with the ``Authorization`` a completion's legs carry."""
    authorization = request.headers.get("authorization")
    if ctx.clients is not None:  # --api-keys: clients list models with their key
        ctx.clients.tenant(authorization)
        authorization = None  # the engines get --engine-api-key, not the client's key
    if ctx.pool.models:
        return JSONResponse({"object": "list", "data": _served_models(ctx)})
    decodes = ctx.pool.usable_decode()
    if not decodes:
        unavailable = NoWorkerAvailable("no healthy decode worker to list models from")
        return Response(
            error_body(unavailable), status_code=unavailable.status, media_type="application/json"
        )
    answers = await asyncio.gather(
        *(_models_of(ctx, w.id, authorization) for w in decodes), return_exceptions=True
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


def _served_models(ctx: AppContext) -> list[dict[str, Any]]:
    """One entry per served name and alias, OpenAI's model object with the pools added."""
    pool, aliases = ctx.pool, ctx.pipeline.models.aliases

    def entry(name: str, root: str) -> dict[str, Any]:
        pools = {
            "prefill": [w.public_url for w in pool.prefill if root in w.models],
            "decode": [w.public_url for w in pool.decode if root in w.models],
        }
        return {"id": name, "object": "model", "owned_by": "pd-router", "root": root, **pools}

    served = [entry(name, name) for name in sorted(pool.models)]
    return served + [entry(alias, aliases[alias]) for alias in sorted(aliases)]


async def _models_of(
    ctx: AppContext, worker_id: str, authorization: str | None
) -> list[dict[str, Any]]:
    """The worker's ``/v1/models`` entries, read as the health probes read them (with
    ``authorization``, else ``--engine-api-key``'s)."""
    worker = ctx.pool.get(worker_id)
    if worker is None:
        return []
    return await ctx.fleet.prober.read_models(worker, authorization)
