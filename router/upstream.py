"""The seam for outbound HTTP to one worker, and the table of its implementations.

Two implementations keep the same contract: ``aiohttp`` (default: ~4.5x less CPU per proxied
request than httpx in ``bench/clients.py``) and ``httpx`` (the reference client, with a lean pool).
Both raise only ``UpstreamError`` subclasses, set TCP_NODELAY and use idle (per-read) timeouts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from router.errors import UpstreamError, UpstreamStatusError
from router.settings import UpstreamSettings
from router.workers import Worker

__all__ = ["UpstreamClient", "UpstreamResponse", "build_upstream", "is_worker_fault"]

# The relay forwards raw bytes: ask engines not to compress them.
DEFAULT_HEADERS = {"accept-encoding": "identity", "user-agent": "pd-router"}


class UpstreamResponse(Protocol):
    """An engine's answer whose status and headers arrived; the body is still unread."""

    status: int
    content_type: bytes

    def chunks(self) -> AsyncIterator[bytes]:
        """The body pieces as they arrive (transfer-decoded only); raises UpstreamError."""
        ...

    async def read(self) -> bytes:
        """The whole body; releases the connection. Raises UpstreamError."""
        ...

    async def aclose(self) -> None:
        """Release the connection: back to the pool if the body was consumed, else closed
        (which the engine sees as the client going away)."""
        ...


class UpstreamClient(Protocol):
    """The pooled connections to one worker."""

    worker: Worker

    async def open(self, path: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        """POST ``body``; returns once status and headers arrived. Raises UpstreamError."""
        ...

    async def get(self, path: str, timeout: float) -> tuple[int, bytes]:
        """A small GET (model listing). Raises UpstreamError."""
        ...

    async def aclose(self) -> None: ...


def build_upstream(worker: Worker, settings: UpstreamSettings) -> UpstreamClient:
    """The configured implementation for ``worker``."""
    if settings.client == "httpx":
        from router.upstream_httpx import HttpxUpstream

        return HttpxUpstream(worker, settings)
    from router.upstream_aiohttp import AiohttpUpstream

    return AiohttpUpstream(worker, settings)


def is_worker_fault(exc: UpstreamError) -> bool:
    """Failures that count against a worker's health (transport errors, timeouts, 5xx)."""
    return not isinstance(exc, UpstreamStatusError) or exc.upstream_status >= 500
