"""``POST /admin/explain``: where a completion would go, and why, without sending it.

Takes a completion body (``messages``: chat, else completions), computes its prompt features as
a request would (tokenizing it when the policy needs token ids) and returns the candidates with
what the policies weigh (load, prefill tokens pending, predicted cached tokens, cost; with
precise ``cache_aware`` also the matched blocks per cache tier, ``cached_blocks_by_tier``, and
their tier-weighted worth, ``credited_blocks``) and the route the router would choose now. With
session affinity on, also the pin table's size and bounds and, when the request names its
session (``X-Session-Id``, ``--session-header``), that session's pin (explain neither pins nor
refreshes it). ``admission``: the request's tenant (``?tenant=NAME``, one of ``--api-keys``),
priority, deadline and weight as the admission queue would take them, and its place: admitted at
once, or ``queue_position`` waiters ahead of it (an estimate: no later arrivals); with
``--queue-at-worker-caps`` also its place in its model's worker queue (``worker_queue``).
``agreement``: each prefill rank's recent predicted against actual cached tokens
(``router.observability.agreement``). Admin auth, like the rest of ``/admin``.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from registry.admin import ADMIN_RESPONSES, authorizer, read_bounded_body
from registry.settings import RegistrySettings
from router.api.completions_doc import error_response
from router.api.deps import get_context
from router.api.openai import read_headers
from router.api.routing_health import recent_agreement
from router.api.urgency import request_urgency
from router.context import AppContext
from router.errors import InvalidRequest
from router.schemas import Endpoint, ParsedRequest, RequestLimits, parse_request

__all__ = ["explain_routes"]


# documented only: the route reads its body itself (bounded), after auth
_COMPLETION_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
}


def explain_routes(settings: RegistrySettings) -> APIRouter:
    routes = APIRouter(
        prefix="/admin", dependencies=[Depends(authorizer(settings))], responses=ADMIN_RESPONSES
    )

    @routes.post(
        "/explain",
        openapi_extra=_COMPLETION_BODY,
        responses={413: error_response("Body over --max-body-bytes")},
    )
    async def explain(request: Request) -> JSONResponse:
        """The route a completion body would take now, with every candidate's scores."""
        ctx = get_context(request)
        raw = await read_bounded_body(request, ctx.settings.server.max_body_bytes)
        try:
            data = msgspec.json.decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
        endpoint = _endpoint_of(data)
        parsed = parse_request(endpoint, raw, RequestLimits.from_settings(ctx.settings.server))
        sessions = ctx.pipeline.sessions
        session = None
        if sessions is not None:
            *_, bad_header, session = read_headers(
                request.scope, ctx.settings.server.max_request_id_bytes, False,
                sessions.header_name, sessions.max_key_bytes,
            )  # fmt: skip
            if bad_header is not None:
                raise bad_header
        chooser = ctx.pipeline.models.chooser_for(parsed)  # its model's pool (404: none)
        features = await chooser.features(parsed)
        answer: dict[str, Any] = {
            "endpoint": endpoint.value,
            "engine": ctx.settings.engine.value,
            "admission": _admission(ctx, parsed, request, chooser.model),
            **chooser.explain(features, session),
            # predicted against actual cached tokens, per prefill rank, over its recent window
            "agreement": recent_agreement(ctx),
        }
        return JSONResponse(answer)

    return routes


def _admission(
    ctx: AppContext, parsed: ParsedRequest, request: Request, model: str | None
) -> dict[str, Any]:
    """The request's tenant (``?tenant=NAME``, one of ``--api-keys``; else none), its urgency
    as the queue would take it (the body's ``priority``, ``X-Priority``, ``X-Deadline-Ms``, the
    tenant's defaults) and its place: admitted at once, or how many waiters go first."""
    tenant = request.query_params.get("tenant")
    if tenant is not None:
        clients = ctx.clients
        if clients is None or tenant not in clients.keys.table.specs:
            raise InvalidRequest(f"no tenant {tenant[:64]!r} in --api-keys", param="tenant")
    urgency = request_urgency(ctx, parsed, tenant, request.scope["headers"])
    place = ctx.admission.place(urgency, parsed.sample_count)
    limiter = None if ctx.clients is None else ctx.clients.limiter
    in_flight = None if tenant is None or limiter is None else limiter.in_flight(tenant)
    workers = ctx.pipeline.worker_queue
    return {
        "tenant": tenant,
        "priority": urgency.priority,
        "deadline_ms": None if urgency.deadline_s is None else round(urgency.deadline_s * 1000),
        "weight": urgency.weight,
        "tenant_in_flight": in_flight,
        **place,
        # --queue-at-worker-caps: its place in its model's worker queue (null: off)
        "worker_queue": None if workers is None else workers.place(model, urgency),
    }


def _endpoint_of(body: object) -> Endpoint:
    """The completion endpoint a body is for, by its fields: ``input`` (Responses),
    ``messages`` (chat; a Messages body routes alike), else completions."""
    if not isinstance(body, dict):
        return Endpoint.COMPLETIONS
    if "input" in body:
        return Endpoint.RESPONSES
    if "messages" in body:
        return Endpoint.CHAT
    return Endpoint.COMPLETIONS
