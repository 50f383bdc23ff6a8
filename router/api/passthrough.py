"""``POST /tokenize``, ``/detokenize`` and ``/v1/embeddings``: what a client expects of an engine
and that needs no PD, passed through to one worker as a raw ASGI handler.

Which worker: the least busy usable prefill (healthy, not draining, its breaker closed) of the
pool serving the body's ``model`` (``router.scheduling.model_pools``: its alias resolved, 404 for
a model no worker serves, 400 for none named while the workers serve several), else such a
decode. Every worker of a pool serves the same model and tokenizer; a prefill's work is short and
compute-bound, so a tokenization or an embedding (a forward pass with nothing to decode) there
stretches no stream's inter-token latency, as it would on a decode. The engine's answer goes back
unchanged, or its error in OpenAI's shape: a 4xx in another shape (FastAPI's ``{"detail": ...}``
for a route it does not serve: a generation model has no embeddings) with its message kept, a
5xx as a 502 (429 and 503: the engine is full, as it said).

The same bounds as the completion routes: POST only (405), the body limit and budget (413,
429), a JSON object (400), the caller's tenant limits (``--api-keys``: one request, its tokens:
the token ids to detokenize, else the body's bytes / 4, and a place in its concurrency; 429),
an admission unit while it runs (429), the worker caps (a prefill at its cap passes to a
decode below its own; 429 when every one is at its cap: these requests do not wait in the
worker queue), the answer limit (``--max-answer-bytes``), the client's Authorization and
X-Request-Id forwarded; the requests are counted in ``pdr_requests_total`` under their path;
errors are OpenAI-style JSON.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from router.api.openai import (
    CLIENT_GONE_STATUS,
    authenticate,
    client_gone,
    read_headers,
    responder_for,
    upstream_headers,
)
from router.api.request_body import BodyShare, read_body
from router.context import AppContext
from router.errors import (
    InvalidRequest,
    MethodNotAllowed,
    NoWorkerAvailable,
    Overloaded,
    RouterError,
    UpstreamStatusError,
    WorkersBusy,
)
from router.interrupt import ClientDisconnected
from router.observability.logs import REQUEST_ID
from router.observability.receipt import RoutingReceipt
from router.pipeline.responder import Responder
from router.pipeline.verdicts import error_detail
from router.tenancy.limiter import Admitted
from router.types import Receive, Scope, Send
from router.workers import Worker

__all__ = ["PASSTHROUGH_ROUTES", "handle_passthrough"]

logger = logging.getLogger(__name__)

PASSTHROUGH_ROUTES = frozenset(
    {"/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize", "/v1/embeddings"}
)


async def handle_passthrough(
    ctx: AppContext, path: str, scope: Scope, receive: Receive, send: Send
) -> None:
    """Serve one pass-through request; never raises (errors are rendered to the client)."""
    started = time.monotonic()
    settings = ctx.settings
    request_id, authorization, content_length, trace_context, bad_id, _ = read_headers(
        scope, settings.server.max_request_id_bytes, settings.features.trace_headers
    )
    token = REQUEST_ID.set(request_id)
    responder = responder_for(scope, send, request_id)
    share = BodyShare(ctx.admission.body_memory)
    status = 0
    try:
        if scope["method"] != "POST":
            raise MethodNotAllowed(f"method {scope['method']} is not allowed on {path}")
        if bad_id is not None:
            raise bad_id
        tenant, authorization = authenticate(ctx, scope, path, authorization)  # --api-keys
        limit = settings.server.max_body_bytes
        body = bytes(await read_body(receive, limit, content_length, share))
        model, body, tokens = _model_pool(ctx, path, body)
        headers = upstream_headers(request_id, authorization, trace_context)
        passage = _Passage(path, body, model, headers)
        admitted = await _tenant_admits(ctx, tenant, tokens, responder)
        try:
            await _admitted(ctx, passage, responder, client_gone(scope, receive))
        finally:
            if admitted is not None:
                await admitted.finish()
        status = responder.status or 500
    except ClientDisconnected:
        status = CLIENT_GONE_STATUS
    except RouterError as exc:
        status = exc.status
        if isinstance(exc, Overloaded):
            metrics = ctx.telemetry.metrics
            metrics.count(metrics.admission_rejected, exc.reason)
        await responder.fail(exc)
    except Exception:  # noqa: BLE001 - log it, answer 500, keep serving
        status = 500
        logger.exception("unexpected error while passing a request through")
        await responder.fail(RouterError("internal router error (logged)"))
    finally:
        share.release()
        ctx.telemetry.accounting.finish(
            path, False, status, started, responder.started_at, RoutingReceipt()
        )
        REQUEST_ID.reset(token)


async def _tenant_admits(
    ctx: AppContext, tenant: str | None, tokens: int, responder: Responder
) -> Admitted | None:
    """The request charged to its tenant's limits (``--api-keys`` with limits: one request,
    ``tokens``, a place in its concurrency; raises RateLimited), or None without limits."""
    clients = ctx.clients
    if tenant is None or clients is None or clients.limiter is None:
        return None
    admitted = await clients.limiter.admit(tenant, tokens)
    if admitted.headers:
        responder.add_headers(admitted.headers)
    return admitted


def _model_pool(ctx: AppContext, path: str, body: bytes) -> tuple[str | None, bytes, int]:
    """The pool of the model the body names (None: the whole fleet), the body for the engine
    (an alias replaced by the served name) and its tokens for the tenant's limits (token ids
    to detokenize, else the body's UTF-8 bytes / 4); 400 for a body that is not a JSON object
    or names no model while the workers serve several, 404 for a model no worker serves."""
    try:
        parsed = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the body of {path} is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequest(f"the body of {path} must be a JSON object")
    models = ctx.pipeline.models
    named = parsed.get("model")
    if named is None and models.several:
        served = ", ".join(models.served())
        raise InvalidRequest(f"{path} needs a 'model' here: this router serves {served}")
    model = models.pool_of(parsed)
    if parsed.get("model") is not named:  # an alias: the engine gets the served name
        body = msgspec.json.encode(parsed)
    ids = parsed.get("tokens")
    return model, body, len(ids) if isinstance(ids, list) else len(body) // 4


def _pick_worker(ctx: AppContext, model: str | None) -> Worker:
    """The least busy usable prefill of the model's pool whose breaker is closed and that is
    below its in-flight cap, else such a decode; WorkersBusy (429) when each role's usable
    workers are at their caps."""
    circuits, pool = ctx.pipeline.circuits, ctx.pool
    busy: WorkersBusy | None = None
    for available in (pool.available_prefill, pool.available_decode):
        try:
            candidates = available(model)
        except WorkersBusy as exc:
            busy = busy or exc
            continue
        allowed = [w for w in candidates if circuits.worker_allows(w)]
        if allowed:
            return min(allowed, key=lambda worker: worker.host_inflight())
    if busy is not None:
        raise busy
    raise NoWorkerAvailable("no healthy worker to pass the request to")


@dataclass(frozen=True, slots=True)
class _Passage:
    """One pass-through request as it goes to the engine: its path, body (an alias replaced),
    model pool (None: the whole fleet) and upstream headers."""

    path: str
    body: bytes
    model: str | None
    headers: dict[str, str]


async def _admitted(
    ctx: AppContext, passage: _Passage, responder: Responder, disconnected: asyncio.Future[Any]
) -> None:
    """``_forward`` holding an admission unit (429 when overloaded)."""
    try:
        await ctx.admission.acquire(disconnected, 1)
        try:
            await _forward(ctx, passage, responder)
        finally:
            ctx.admission.release(1)
    finally:
        disconnected.cancel()


async def _forward(ctx: AppContext, passage: _Passage, responder: Responder) -> None:
    worker = _pick_worker(ctx, passage.model)
    with worker.load():
        client = ctx.pool.client(worker)
        answer = await client.open(passage.path, passage.body, passage.headers, whole=True)
        try:
            data = await answer.read()  # bounded: --max-answer-bytes
        finally:
            await answer.aclose()
    if answer.status >= 500 or (answer.status >= 400 and not _openai_error(data)):
        # a failed engine is a 502 (429/503: full, as the engine said); a 4xx in another shape
        # (FastAPI's {"detail": ...} for a route it does not serve) in OpenAI's, its message kept
        role, url = worker.role.value, worker.public_url
        raise UpstreamStatusError(answer.status, error_detail(data), role=role, url=url)
    await responder.whole(answer.status, answer.content_type or b"application/json", data)


def _openai_error(data: bytes) -> bool:
    try:
        parsed = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return False
    return isinstance(parsed, dict) and isinstance(parsed.get("error"), dict)
