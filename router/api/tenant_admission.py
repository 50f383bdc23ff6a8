"""A tenant's limits on the request path (``--api-keys`` with limits in the keys file).

Admission charges the request to its tenant (``router.tenancy.limiter``): one request, and its
estimated tokens: the prompt's (UTF-8 bytes / 4 of what routing matches on: the completions
prompt, each chat message, a Responses or Messages conversation) plus the output it may ask
for (``max_tokens``, ``max_completion_tokens`` or ``max_output_tokens``; else
``--tenant-default-max-tokens``) times its sequences. When the answer ends, the charge is
corrected by the usage the decode reported (a whole answer's ``usage``; a stream's usage event,
when the client asked for one: else the estimate stands). Over a limit: 429 with
``Retry-After`` and the ``x-ratelimit-*`` headers; within, the answer carries them too.
A tenant's ``min_priority`` caps the body's ``priority`` here, before anything reads it.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

from router.context import AppContext
from router.observability.receipt import RoutingReceipt
from router.pipeline.responder import Responder
from router.scheduling.features import estimate_tokens, request_text
from router.schemas import ParsedRequest
from router.tenancy.limiter import Admitted, TenantLimiter

__all__ = ["admit_tenant", "cap_priority", "estimated_tokens"]

_OUTPUT_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def admit_tenant(
    ctx: AppContext,
    tenant: str,
    request: ParsedRequest,
    responder: Responder,
    receipt: RoutingReceipt,
) -> Admitted | Coroutine[Any, Any, Admitted] | None:
    """The tenant's admission (raises RateLimited), or None without limits to apply; its
    headers go out with the answer and the answer's usage is read for it. Made at once where
    the limits count in this process's memory (no coroutine on the request path); with a
    shared storage, a coroutine to await for it."""
    limits = _limits(ctx, tenant, request)
    if limits is None:
        return None
    limiter, estimate = limits
    if limiter.windows.local:
        return _wanted(limiter.admit_local(tenant, estimate), responder, receipt)
    return _admit_shared(limiter, tenant, estimate, responder, receipt)


async def _admit_shared(
    limiter: TenantLimiter,
    tenant: str,
    estimate: int,
    responder: Responder,
    receipt: RoutingReceipt,
) -> Admitted:
    return _wanted(await limiter.admit(tenant, estimate), responder, receipt)


def _limits(
    ctx: AppContext, tenant: str, request: ParsedRequest
) -> tuple[TenantLimiter, int] | None:
    """The limiter to admit ``tenant``'s request with and the tokens it is estimated to use
    (None: no limits), once the body's priority is capped at the tenant's ``min_priority``."""
    clients = ctx.clients
    if clients is None:
        return None
    spec = clients.keys.table.specs.get(tenant)
    if spec is not None and spec.min_priority is not None:
        cap_priority(request, spec.min_priority)
    if clients.limiter is None:
        return None
    return clients.limiter, estimated_tokens(request, clients.default_max_tokens)


def _wanted(admitted: Admitted, responder: Responder, receipt: RoutingReceipt) -> Admitted:
    """``admitted``'s headers go out with the answer, whose usage is read for it."""
    if admitted.headers:
        responder.add_headers(admitted.headers)
    receipt.wants_usage = True
    return admitted


def cap_priority(request: ParsedRequest, min_priority: int) -> None:
    """A body ``priority`` more urgent than the tenant's ``min_priority`` is raised to it: the
    engines that schedule by it (vLLM ``--scheduling-policy priority``) see the capped one."""
    priority = request.body.get("priority")
    if isinstance(priority, int) and not isinstance(priority, bool) and priority < min_priority:
        request.body["priority"] = min_priority


def estimated_tokens(request: ParsedRequest, default_max_tokens: int) -> int:
    """Prompt plus output tokens the request may use, before any of it is known."""
    body = request.body
    output = default_max_tokens
    for field in _OUTPUT_FIELDS:
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            output = value
            break
    return estimate_tokens(request_text(request) or "") + max(output, 0) * request.sample_count
