"""A request's place in the admission queue: its priority, deadline, tenant and weight.

The priority (an integer, lower is more urgent, as vLLM's) is the body's ``priority`` (vLLM's
field, which the engines get as is), else the ``X-Priority`` header, else the tenant's
``priority`` in the keys file, else ``--default-priority``; never more urgent than the tenant's
``min_priority`` (``router.api.tenant_admission`` caps the body's field alike).
``X-Deadline-Ms`` is how long the request may wait in the queue (at most ``--queue-timeout``). A
tenant's ``weight`` is its share of a saturated fleet. All of it is worked out only for a
request that must wait (and, with ``--forward-priority`` on vLLM engines, for every request: its
priority goes into the body), so a request admitted at once pays nothing for it; a malformed
header is a 400 when it is read.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from router.context import AppContext
from router.errors import InvalidRequest
from router.pipeline.admission_queue import ANONYMOUS, Urgency
from router.schemas import ParsedRequest
from router.settings.discovery import EngineProtocol

__all__ = ["admit_request", "request_urgency"]

_MAX_DIGITS = 19  # an int64, as vLLM's field
_VLLM = frozenset({EngineProtocol.VLLM_MOONCAKE, EngineProtocol.VLLM_NIXL})

Headers = Iterable[tuple[bytes, bytes]]


async def admit_request(
    ctx: AppContext,
    request: ParsedRequest,
    tenant: str | None,
    headers: Headers,
    disconnected: Any,
) -> None:
    """Take the request's admission units: at once when they are free and nobody waits, else
    in the queue at its urgency. With ``--forward-priority`` and vLLM engines, a priority that
    did not come from the body is added to it (a zero one is vLLM's default: left out). The
    caller has tried the fast path (``AdmissionGate.try_acquire``), with no await since,
    unless ``--forward-priority`` is on (then it is tried here, after the body has its
    priority)."""
    urgency = None
    settings = ctx.settings
    gate = ctx.admission
    sequences = request.sample_count
    if settings.admission.forward_priority:
        if settings.engine in _VLLM:
            urgency = request_urgency(ctx, request, tenant, headers)
            if urgency.priority and "priority" not in request.body:
                request.body["priority"] = urgency.priority
        if gate.try_acquire(sequences):
            return
    if urgency is None:
        urgency = request_urgency(ctx, request, tenant, headers)
    await gate.enqueue(disconnected, sequences, urgency)


def request_urgency(
    ctx: AppContext, request: ParsedRequest, tenant: str | None, headers: Headers
) -> Urgency:
    """The request's urgency; raises InvalidRequest for a malformed priority or deadline."""
    admission = ctx.settings.admission
    spec = None
    if tenant is not None and ctx.clients is not None:
        spec = ctx.clients.keys.table.specs.get(tenant)
    raw_priority = raw_deadline = None
    priority_name = admission.priority_header.encode()
    deadline_name = admission.deadline_header.encode()
    for name, value in headers:
        if name == priority_name:
            raw_priority = value
        elif name == deadline_name:
            raw_deadline = value
    priority = request.body.get("priority")
    if not isinstance(priority, int) or isinstance(priority, bool):
        if raw_priority is not None:
            priority = _integer(raw_priority, admission.priority_header, signed=True)
        elif spec is not None and spec.priority is not None:
            priority = spec.priority
        else:
            priority = admission.default_priority
    if spec is not None and spec.min_priority is not None:
        priority = max(priority, spec.min_priority)  # asked for more than the tenant may
    deadline_s = None
    if raw_deadline is not None:
        deadline_s = _integer(raw_deadline, admission.deadline_header, signed=False) / 1000
    weight = spec.weight if spec is not None else 1.0
    return Urgency(priority, deadline_s, ANONYMOUS if tenant is None else tenant, weight)


def _integer(raw: bytes, header: str, *, signed: bool) -> int:
    text = raw.strip()
    digits = text[1:] if signed and text[:1] in (b"-", b"+") else text
    if not digits.isdigit() or len(digits) > _MAX_DIGITS:
        kind = "an integer" if signed else "a whole number of milliseconds"
        raise InvalidRequest(f"the {header} header must be {kind} of at most 19 digits")
    return int(text)
