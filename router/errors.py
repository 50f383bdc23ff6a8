"""The router's exception tree and the one place that renders it as OpenAI error JSON.

RouterError
├── InvalidRequest          400  the client's request is malformed
├── Unauthorized            401  no API key or an unknown one (--api-keys)
├── BodyTooLarge            413
├── MethodNotAllowed        405
├── ModelNotFound           404  no worker serves the request's model
├── NoWorkerAvailable       503  no healthy prefill or decode worker
│   └── WorkersBusy         429  every candidate is at its in-flight cap (also an Overloaded)
├── Overloaded              429  admission: the wait queue is full or the wait timed out
│   ├── RateLimited         429  a tenant's limit (requests, tokens per minute, concurrency)
│   └── Shed                503  fleet overload: shed for a more urgent request, deadline passed
└── UpstreamError           502  an engine call failed
    ├── UpstreamUnavailable 502  transport error (``connect`` tells whether it is safe to retry)
    ├── UpstreamTimeout     504
    └── UpstreamStatusError      the engine answered non-2xx (4xx passes through, 5xx -> 502)
"""

from __future__ import annotations

import math

import msgspec

__all__ = [
    "BodyTooLarge",
    "InvalidRequest",
    "MethodNotAllowed",
    "ModelNotFound",
    "NoWorkerAvailable",
    "Overloaded",
    "RateLimited",
    "RouterError",
    "Unauthorized",
    "UpstreamError",
    "UpstreamStatusError",
    "UpstreamTimeout",
    "UpstreamUnavailable",
    "WorkersBusy",
    "error_body",
    "sse_error_event",
]


class RouterError(Exception):
    status: int = 500
    error_type: str = "internal_server_error"
    code: str | None = None  # OpenAI's error code, when it names one (else the status is sent)
    # response headers the error owes (405: Allow)
    headers: tuple[tuple[bytes, bytes], ...] = ()

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(RouterError):
    status = 400
    error_type = "invalid_request_error"


class BodyTooLarge(RouterError):
    status = 413
    error_type = "invalid_request_error"


class MethodNotAllowed(RouterError):
    """A completion route called with another method than POST (RFC 9110: says which)."""

    status = 405
    error_type = "invalid_request_error"
    headers = ((b"allow", b"POST"),)


class NoWorkerAvailable(RouterError):
    status = 503
    error_type = "service_unavailable"


class ModelNotFound(RouterError):
    """The request's model is served by no worker (OpenAI's 404 ``model_not_found``)."""

    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model")


class Unauthorized(RouterError):
    """No API key, or an unknown one, while client keys are required (``--api-keys``)."""

    status = 401
    error_type = "invalid_request_error"
    headers = ((b"www-authenticate", b'Bearer realm="pd-router"'),)


class Overloaded(RouterError):
    """The router sheds load (admission control): 429 with ``Retry-After`` (whole seconds).
    ``reason`` (``queue_full``, ``queue_timeout``, ``worker_cap``) labels
    ``pdr_admission_rejected_total``."""

    status = 429
    error_type = "rate_limit_exceeded"

    def __init__(self, message: str, *, reason: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.headers = ((b"retry-after", str(retry_after_s).encode()),)


class Shed(Overloaded):
    """Fleet overload rather than the caller's own limits (as llm-d answers): 503 with
    ``Retry-After``; ``reason`` ``shed`` (a more urgent request took its place in the full
    queue) or ``deadline`` (its ``X-Deadline-Ms`` passed while it waited)."""

    status = 503
    error_type = "service_unavailable"


class WorkersBusy(Overloaded, NoWorkerAvailable):
    """Every healthy candidate of a role is at its in-flight cap (``--max-inflight-per-*``)."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message, reason="worker_cap", retry_after_s=retry_after_s)


class RateLimited(Overloaded):
    """A tenant is over one of its limits (``router.tenancy``): 429, the envelope's ``type``
    the limit as OpenAI names it (``requests`` or ``tokens``; its ``code`` stays the status, as
    the error schema says, where OpenAI's is ``rate_limit_exceeded``), with ``retry-after``
    (whole seconds, rounded up), ``retry-after-ms`` (what the openai client reads first) and the
    ``x-ratelimit-*`` headers of the limits it knows. ``reason`` (``tenant_requests``,
    ``tenant_tokens``, ``tenant_concurrency``) labels ``pdr_admission_rejected_total``."""

    def __init__(
        self,
        message: str,
        *,
        limit_type: str,
        reason: str,
        retry_after_s: float,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        super().__init__(message, reason=reason, retry_after_s=max(1, math.ceil(retry_after_s)))
        self.error_type = limit_type
        self.retry_after_s = retry_after_s
        retry_ms = str(max(1, math.ceil(retry_after_s * 1000))).encode()
        self.headers = (*self.headers, (b"retry-after-ms", retry_ms), *headers)


class ShuttingDown(RouterError):
    """The router is shutting down and the grace period for requests in flight is over."""

    status = 503
    error_type = "service_unavailable"


class UpstreamError(RouterError):
    """A leg failed. ``kind`` names how, for metrics (``pdr_upstream_errors_total``)."""

    status = 502
    error_type = "upstream_error"

    def __init__(self, message: str, *, role: str, url: str, kind: str = "error") -> None:
        super().__init__(f"{role} worker {url}: {message}")
        self.role = role
        self.url = url
        self.kind = kind


class UpstreamUnavailable(UpstreamError):
    """No answer: ``connect`` (nothing was sent; retryable), else the connection broke or the
    answer was unusable (``kind``: broken, kv_lost, invalid_answer)."""

    def __init__(
        self, message: str, *, role: str, url: str, connect: bool, kind: str | None = None
    ) -> None:
        super().__init__(
            message, role=role, url=url, kind=kind or ("connect" if connect else "broken")
        )
        self.connect = connect


class UpstreamTimeout(UpstreamError):
    """A deadline passed (``kind``: timeout, or kv_timeout for a KV that never arrived)."""

    status = 504
    error_type = "timeout"

    def __init__(self, message: str, *, role: str, url: str, kind: str = "timeout") -> None:
        super().__init__(message, role=role, url=url, kind=kind)


# what engines answer when they are full (SGLang's KV pool, vLLM's queue): not a fault
CAPACITY_STATUSES = frozenset({429, 503})
# what the client gets with a full engine's 429/503 (the router avoids that worker ~1 s)
CAPACITY_RETRY_AFTER = ((b"retry-after", b"1"),)


class UpstreamStatusError(UpstreamError):
    """An error answer; ``kind`` capacity for 429/503 (the engine is full, try another)."""

    def __init__(self, upstream_status: int, detail: str, *, role: str, url: str) -> None:
        if upstream_status in CAPACITY_STATUSES:
            kind = "capacity"
        else:
            kind = "http_4xx" if upstream_status < 500 else "http_5xx"
        super().__init__(
            f"answered HTTP {upstream_status}: {detail}", role=role, url=url, kind=kind
        )
        self.upstream_status = upstream_status
        if upstream_status in CAPACITY_STATUSES:  # the client may retry later, as with us
            self.status = upstream_status
            self.error_type = "service_unavailable"
            self.headers = CAPACITY_RETRY_AFTER
        elif 400 <= upstream_status < 500:
            self.status = upstream_status
            self.error_type = "invalid_request_error"


_encoder = msgspec.json.Encoder()


def error_body(exc: RouterError, *, anthropic: bool = False) -> bytes:
    """The OpenAI error envelope for ``exc`` as JSON bytes; ``anthropic``: Anthropic's around the
    same fields (``{"type": "error", "error": {...}}``, as vLLM's ``/v1/messages`` answers its
    errors; Anthropic's clients read ``error.type`` and ``error.message``)."""
    fields = {
        "message": exc.message,
        "type": exc.error_type,
        "param": exc.param,
        "code": exc.status if exc.code is None else exc.code,
    }
    return _encoder.encode({"type": "error", "error": fields} if anthropic else {"error": fields})


def sse_error_event(exc: RouterError, *, anthropic: bool = False) -> bytes:
    """The same envelope as a final SSE ``data:`` event, for failures after streaming began;
    ``anthropic``: an ``event: error`` (what Anthropic's clients raise on; they skip events
    without a name)."""
    if anthropic:
        return b"event: error\ndata: " + error_body(exc, anthropic=True) + b"\n\n"
    return b"data: " + error_body(exc) + b"\n\n"
