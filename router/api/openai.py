"""The hot path: ``POST /v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` and
``/v1/messages`` as a raw ASGI handler.

FastAPI's routing and validation cost more CPU than the whole proxy step, so these routes
bypass it; everything else (health, models, admin) goes through FastAPI.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from router.api.request_body import BodyShare, parse_in_turn, read_body
from router.api.tenant_admission import admit_tenant
from router.api.urgency import admit_request, request_urgency
from router.context import AppContext
from router.errors import (
    InvalidRequest,
    MethodNotAllowed,
    Overloaded,
    RouterError,
    ShuttingDown,
)
from router.interrupt import ClientDisconnected
from router.observability.logs import REQUEST_ID
from router.observability.receipt import RoutingReceipt
from router.observability.tracing import TraceSpan
from router.pipeline.admission_queue import Urgency
from router.pipeline.responder import Responder
from router.scheduling.session_pins import SessionAsk
from router.schemas import (
    LAZY_BODY_BYTES,
    Endpoint,
    ParsedRequest,
    RequestLimits,
    parse_request,
)
from router.tenancy.limiter import Admitted
from router.types import CLIENT_GONE, WHOLE_RESPONSE, Receive, Scope, Send

__all__ = [
    "CLIENT_GONE_STATUS",
    "HOT_ROUTES",
    "authenticate",
    "client_gone",
    "handle_completion",
    "read_headers",
    "responder_for",
    "upstream_headers",
]

logger = logging.getLogger(__name__)

HOT_ROUTES = {endpoint.value: endpoint for endpoint in Endpoint}
_TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})
_REQUEST_ID = re.compile(rb"[\x21-\x7e]+")  # printable ASCII: it goes into headers and logs
_MAX_TRACE_HEADER = 512  # W3C: tracestate may be cut beyond 512 chars; longer ones are dropped
_SESSION_AFFINITY = b"x-session-affinity"  # a request's own choice: soft or hard
_AFFINITIES = {b"soft": False, b"hard": True}
_MESSAGES = Endpoint.MESSAGES.value
CLIENT_GONE_STATUS = 499  # nginx's "client closed request": counted for a client that left


async def handle_completion(
    ctx: AppContext, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send
) -> None:
    """Serve one completion request; never raises (errors are rendered to the client)."""
    started = time.monotonic()
    request_id, authorization, content_length, trace_context, bad_header, session = (
        _completion_headers(ctx, scope)
    )
    token = REQUEST_ID.set(request_id)
    responder = responder_for(scope, send, request_id, anthropic=endpoint is Endpoint.MESSAGES)
    receipt = RoutingReceipt()
    span = _request_span(ctx, endpoint, trace_context)
    stream = False
    status = 0
    task = ctx.lifecycle.track()
    share = BodyShare(ctx.admission.body_memory)
    try:
        # --api-keys: the caller's tenant, before the body is read
        tenant, authorization = authenticate(ctx, scope, endpoint.value, authorization)
        request = await _read_request(
            ctx, scope, receive, endpoint, content_length, share, bad_header
        )
        stream = request.stream
        headers = upstream_headers(request_id, authorization, trace_context)
        routing = _Routing(
            responder, client_gone(scope, receive), receipt, span, session, tenant, scope["headers"]
        )
        await _admit_and_route(ctx, request, headers, routing)
        status = responder.status or 500
    except ClientDisconnected:
        status = CLIENT_GONE_STATUS
        logger.info("client disconnected; upstream requests cancelled")
    except asyncio.CancelledError:
        if not ctx.lifecycle.stopping or task is None:
            raise
        task.uncancel()  # the router's own cut-off at the end of the shutdown grace period
        stopped = ShuttingDown("the router is shutting down; the request was cut off")
        status = stopped.status
        await responder.fail(stopped)
    except RouterError as exc:
        status = exc.status
        if isinstance(exc, Overloaded):  # shed: counted, not logged (a line each under overload)
            metrics = ctx.telemetry.metrics
            metrics.count(metrics.admission_rejected, exc.reason)
        elif exc.status >= 500:
            logger.warning("request failed: %s", exc.message)
        await responder.fail(exc)
    except Exception:  # noqa: BLE001 - the one catch-all: log it, answer 500, keep serving
        status = 500
        logger.exception("unexpected error while routing a request")
        await responder.fail(RouterError("internal router error (logged)"))
    finally:
        share.release()
        ctx.lifecycle.untrack(task)
        ctx.telemetry.accounting.finish(
            endpoint.value, stream, status, started, responder.started_at, receipt
        )
        if span is not None:
            _end_span(span, status)
        REQUEST_ID.reset(token)


@dataclass(slots=True)
class _Routing:
    """What routing one request needs besides its body and upstream headers. ``disconnected``:
    the client leaving, queued or served (cancelled at the end); ``session``: the session the
    request names."""

    responder: Responder
    disconnected: asyncio.Future[Any]
    receipt: RoutingReceipt
    span: TraceSpan | None
    session: SessionAsk | None
    tenant: str | None  # --api-keys: the caller's tenant
    client_headers: list[tuple[bytes, bytes]]  # read for its priority when it must wait


async def _admit_and_route(
    ctx: AppContext, request: ParsedRequest, headers: dict[str, str], routing: _Routing
) -> None:
    """Wait for admission, a unit per sequence (429 when overloaded; the queue orders by
    urgency, ``router.api.urgency``), then route; the units are held until the response ended
    (a stream's last byte), whatever happens."""
    sequences = request.sample_count
    disconnected = routing.disconnected
    admitted = None
    try:
        tenant = routing.tenant
        if tenant is not None:  # its tenant's limits first (--api-keys)
            made = admit_tenant(ctx, tenant, request, routing.responder, routing.receipt)
            admitted = made if made is None or isinstance(made, Admitted) else await made
        settings = ctx.settings
        # off: the CPU ledger's "admission off"; the fast path: free units, nobody waiting
        if settings.features.admission and (
            settings.admission.forward_priority or not ctx.admission.try_acquire(sequences)
        ):
            await admit_request(ctx, request, routing.tenant, routing.client_headers, disconnected)
        try:
            await ctx.pipeline.handle(
                request,
                headers,
                routing.responder,
                disconnected,
                routing.receipt,
                routing.span,
                routing.session,
                urgency_of(ctx, request, routing),
            )
        finally:
            if settings.features.admission:
                ctx.admission.release(sequences)
    finally:
        disconnected.cancel()
        # corrected by the usage the answer reported (if any); the memory storage: no await
        used = routing.receipt.used_tokens
        if admitted is not None and not admitted.finish_local(used):
            await admitted.finish(used)


def urgency_of(
    ctx: AppContext, request: ParsedRequest, routing: _Routing
) -> Callable[[], Urgency] | None:
    """The request's urgency, worked out only if it waits in the worker queue (None: the
    router has none)."""
    if ctx.pipeline.worker_queue is None:
        return None
    return partial(request_urgency, ctx, request, routing.tenant, routing.client_headers)


def authenticate(
    ctx: AppContext, scope: Scope, path: str, authorization: str | None
) -> tuple[str | None, str | None]:
    """With ``--api-keys``: the caller's tenant (raises Unauthorized) and the ``Authorization``
    the engines get in place of the client's (``--engine-api-key``, or none), counted per
    tenant; without: no tenant, and the client's own ``Authorization``."""
    clients = ctx.clients
    if clients is None:
        return None, authorization
    api_key = None
    if authorization is None and path == _MESSAGES:  # Anthropic clients send x-api-key
        api_key = next(
            (v.decode("latin-1") for n, v in scope["headers"] if n == b"x-api-key"), None
        )
    tenant = clients.tenant(authorization, api_key)
    metrics = ctx.telemetry.metrics
    metrics.count(metrics.tenant_requests, tenant)
    return tenant, clients.engine_authorization


def responder_for(
    scope: Scope, send: Send, request_id: str, *, anthropic: bool = False
) -> Responder:
    """The request's responder; whole answers go as one message where the server takes it;
    ``anthropic``: errors in Anthropic's envelope (``/v1/messages``)."""
    whole_message = WHOLE_RESPONSE in scope.get("extensions", ())
    return Responder(
        send,
        [(b"x-request-id", request_id.encode())],
        whole_message=whole_message,
        anthropic=anthropic,
    )


def client_gone(scope: Scope, receive: Receive) -> asyncio.Future[Any]:
    """Resolved when the client leaves: our server's future (``CLIENT_GONE``), else a task
    waiting in ``receive()`` (whose next message, once the body is read, is the disconnect)."""
    gone: asyncio.Future[Any] | None = scope.get(CLIENT_GONE)
    return gone if gone is not None else asyncio.ensure_future(receive())


def upstream_headers(
    request_id: str, authorization: str | None, trace_context: dict[str, str]
) -> dict[str, str]:
    """What both legs get from the client: its request id, authorization and W3C trace
    context."""
    headers = {"content-type": "application/json", "x-request-id": request_id}
    if authorization is not None:
        headers["authorization"] = authorization
    headers.update(trace_context)
    return headers


def _request_span(
    ctx: AppContext, endpoint: Endpoint, trace_context: dict[str, str]
) -> TraceSpan | None:
    """The request's server span, when tracing is on."""
    tracer = ctx.telemetry.tracer
    if tracer is None:
        return None
    return tracer.request_span(
        endpoint.value, trace_context.get("traceparent"), trace_context.get("tracestate")
    )


def _end_span(span: TraceSpan, status: int) -> None:
    span.set("http.response.status_code", status)
    if status >= 500:
        span.fail(RouterError(f"status {status}"))
    span.end()


async def _read_request(
    ctx: AppContext,
    scope: Scope,
    receive: Receive,
    endpoint: Endpoint,
    content_length: int | None,
    share: BodyShare,
    bad_header: InvalidRequest | None,
) -> ParsedRequest:
    """The parsed request; its body counts in the body memory budget through ``share`` (by its
    Content-Length, if any, before a byte is read)."""
    if scope["method"] != "POST":
        raise MethodNotAllowed(f"method {scope['method']} is not allowed on {endpoint.value}")
    if bad_header is not None:
        raise bad_header
    server = ctx.settings.server
    raw = await read_body(receive, server.max_body_bytes, content_length, share)
    if len(raw) > LAZY_BODY_BYTES:
        turn = ctx.admission.body_memory.parse_turn
        return await parse_in_turn(turn, endpoint, raw, RequestLimits.from_settings(server))
    return parse_request(endpoint, raw, RequestLimits.from_settings(server))


def _completion_headers(
    ctx: AppContext, scope: Scope
) -> tuple[str, str | None, int | None, dict[str, str], InvalidRequest | None, SessionAsk | None]:
    """``read_headers`` with the router's settings (the session header, when affinity is on)."""
    settings, sessions = ctx.settings, ctx.pipeline.sessions
    return read_headers(
        scope,
        settings.server.max_request_id_bytes,
        settings.features.trace_headers,
        sessions.header_name if sessions is not None else b"",
        sessions.max_key_bytes if sessions is not None else 0,
    )


def read_headers(
    scope: Scope,
    max_id_bytes: int,
    trace_headers: bool,
    session_header: bytes = b"",
    max_session_key_bytes: int = 0,
) -> tuple[str, str | None, int | None, dict[str, str], InvalidRequest | None, SessionAsk | None]:
    """The request id, authorization, content length, W3C trace context headers, the 400 owed
    for a bad X-Request-Id (the request then gets a generated id: a bad one is never echoed,
    forwarded or logged) or session key, and the session the request names
    (``session_header``: the lower-case header name; empty: none is read)."""
    raw_id = b""
    authorization = length = raw_session = None
    trace_context: dict[str, str] = {}
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            raw_id = value
        elif name == b"authorization":
            authorization = value.decode("latin-1")
        elif name == b"content-length":
            length = value
        elif name == session_header:
            raw_session = value
        elif trace_headers and name in _TRACE_HEADERS and len(value) <= _MAX_TRACE_HEADER:
            trace_context[name.decode()] = value.decode("latin-1")
    content_length = int(length) if length is not None and length.isdigit() else None
    bad = _check_request_id(raw_id, max_id_bytes)
    request_id = raw_id.decode("ascii") if raw_id and bad is None else os.urandom(16).hex()
    session = None
    if raw_session:  # only a request naming its session pays for the rest
        session, bad_session = _session_ask(scope, raw_session, max_session_key_bytes)
        bad = bad or bad_session
    return request_id, authorization, content_length, trace_context, bad, session


def _session_ask(
    scope: Scope, raw_key: bytes, max_key_bytes: int
) -> tuple[SessionAsk | None, InvalidRequest | None]:
    """The session a request names, with the pin it asks for (``X-Session-Affinity``), or the
    400 owed for a bad key (over ``max_key_bytes``, or not printable ASCII: it is shown by
    ``/admin/explain``) or affinity."""
    if len(raw_key) > max_key_bytes or not _REQUEST_ID.fullmatch(raw_key):
        return None, InvalidRequest(
            f"the session key must be at most {max_key_bytes} printable ASCII characters "
            f"(0x21-0x7E); got {len(raw_key)} bytes"
        )
    hard = None
    for name, value in scope["headers"]:
        if name == _SESSION_AFFINITY:
            hard = _AFFINITIES.get(value.strip().lower())
            if hard is None:
                return None, InvalidRequest("X-Session-Affinity must be 'soft' or 'hard'")
    return SessionAsk(raw_key.decode("ascii"), hard), None


def _check_request_id(raw_id: bytes, max_id_bytes: int) -> InvalidRequest | None:
    """None for an absent id or one of 1..max printable ASCII bytes: it goes into both legs'
    headers (the engines echo it within an 8190-byte header limit) and every log line."""
    if not raw_id or (len(raw_id) <= max_id_bytes and _REQUEST_ID.fullmatch(raw_id)):
        return None
    return InvalidRequest(
        f"X-Request-Id must be at most {max_id_bytes} printable ASCII characters "
        f"(0x21-0x7E); got {len(raw_id)} bytes"
    )
