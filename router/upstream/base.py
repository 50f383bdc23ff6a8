"""The seam for outbound HTTP to one worker (its implementations and their table: the package).

Three implementations keep the same contract: ``lean`` (the default: keep-alive HTTP/1.1 on
asyncio protocols, ``lean_client``), ``aiohttp`` (~4.5x less CPU per proxied request than httpx
in ``bench/load/clients.py``) and ``httpx`` (the reference client, with a lean pool).
All raise only ``UpstreamError`` subclasses, set TCP_NODELAY and use idle (per-read) timeouts,
and read a whole answer only up to a bound (``answer_limit``: 502 beyond it, connection closed).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import Protocol

from router.errors import UpstreamError, UpstreamStatusError, UpstreamTimeout, UpstreamUnavailable
from router.settings import UpstreamSettings
from router.workers import Worker, WorkerPool

__all__ = [
    "NODELAY",
    "UpstreamClient",
    "UpstreamPool",
    "UpstreamResponse",
    "answer_limit",
    "answer_too_large",
    "invalid_status",
    "refuse_invalid_status",
    "is_worker_fault",
    "transport_error",
]

# Outbound sockets send small writes at once (the probes' and the upstream clients' option).
NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]

# The relay forwards raw bytes: ask engines not to compress them.
DEFAULT_HEADERS = {"accept-encoding": "identity", "user-agent": "pd-router"}


class UpstreamResponse(Protocol):
    """An engine's answer whose status and headers arrived; the body is still unread."""

    status: int
    content_type: bytes

    def chunks(self) -> AsyncIterator[bytes]:
        """The body bytes as they arrive (transfer-decoded only), never held back to fill a
        piece. A client may hand over all that is buffered at once (aiohttp does: SSE events
        that arrived together go to the client in one write). Raises UpstreamError."""
        ...

    async def read(self) -> bytes:
        """The whole body; releases the connection. Raises UpstreamError, also when the body
        passes ``answer_limit`` (then the connection is closed, nothing more is read)."""
        ...

    def at_eof(self) -> bool:
        """True once the body is known to be complete and every chunk was handed out (may
        stay False until ``chunks`` ends, if the client library cannot tell earlier)."""
        ...

    async def aclose(self) -> None:
        """Release the connection: back to the pool if the body was consumed, else closed
        (which the engine sees as the client going away)."""
        ...


class UpstreamClient(Protocol):
    """The pooled connections to one worker."""

    worker: Worker

    async def open(
        self, path: str, body: bytes, headers: dict[str, str], *, whole: bool = False
    ) -> UpstreamResponse:
        """POST ``body``; returns once status and headers arrived. Raises UpstreamError.
        ``whole``: the caller will read the whole answer, so the client may return only once
        all of it arrived (still bounded by ``answer_limit``)."""
        ...

    async def aclose(self) -> None: ...


UpstreamPool = WorkerPool[UpstreamClient]

ANSWER_TOO_LARGE = "answer_too_large"  # the kind of the error: no fault of the worker's health


def answer_limit(status: int, settings: UpstreamSettings) -> int:
    """The most bytes of an answer with ``status`` read whole: an error's are few."""
    return settings.max_error_answer_bytes if status >= 400 else settings.max_answer_bytes


def invalid_status(worker: Worker, status: int) -> UpstreamError | None:
    """The leg's error for a status outside HTTP's 100-599 (a broken engine or proxy), which
    the client could not be given; None for an HTTP status."""
    if 100 <= status <= 599:
        return None
    return UpstreamUnavailable(
        f"answered an invalid HTTP status {status}",
        role=worker.role.value,
        url=worker.public_url,
        connect=False,
        kind="invalid_answer",
    )


async def refuse_invalid_status(worker: Worker, answer: UpstreamResponse) -> None:
    """Close ``answer`` and raise the leg's error when its status is outside HTTP's 100-599
    (each client's ``open`` calls this on its answer)."""
    invalid = invalid_status(worker, answer.status)
    if invalid is not None:
        await answer.aclose()
        raise invalid


def answer_too_large(worker: Worker, status: int, limit: int, size: int | None) -> UpstreamError:
    """The leg's error for an answer over ``limit`` (``size``: its Content-Length, if any)."""
    what = "error answer" if status >= 400 else "answer"
    flag = "PDR_UPSTREAM__MAX_ERROR_ANSWER_BYTES" if status >= 400 else "--max-answer-bytes"
    told = f" of {size} bytes" if size is not None else ""
    return UpstreamUnavailable(
        f"its HTTP {status} {what}{told} exceeds the router's {limit}-byte limit ({flag}); "
        "the connection was closed",
        role=worker.role.value,
        url=worker.public_url,
        connect=False,
        kind=ANSWER_TOO_LARGE,
    )


def transport_error(
    exc: Exception,
    worker: Worker,
    *,
    connect_failed: bool,
    timed_out: bool,
    stale: bool = False,
) -> UpstreamError:
    """The router's error for a client library's transport failure, classified by the caller.
    ``stale``: the connection was closed or reset before any answer came, as a pooled keep-alive
    connection the engine had just closed is (retryable, not the worker's fault)."""
    role, url = worker.role.value, worker.public_url
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if connect_failed:
        return UpstreamUnavailable(f"cannot connect ({detail})", role=role, url=url, connect=True)
    if stale:
        return UpstreamUnavailable(
            f"the connection closed before any answer ({detail})",
            role=role,
            url=url,
            connect=False,
            kind="stale_connection",
        )
    if timed_out:
        return UpstreamTimeout(f"timed out ({detail})", role=role, url=url)
    return UpstreamUnavailable(f"connection failed ({detail})", role=role, url=url, connect=False)


def is_worker_fault(exc: UpstreamError) -> bool:
    """Failures that count against a worker's health (transport errors, timeouts, 5xx); an
    engine saying it is full (429, 503) is busy, not broken, and one whose answer is over the
    router's limit is too big for this router, not broken."""
    if exc.kind in ("capacity", "stale_connection", ANSWER_TOO_LARGE):
        return False
    return not isinstance(exc, UpstreamStatusError) or exc.upstream_status >= 500
