"""Outbound HTTP to one worker over a pooled httpx client; httpx errors become UpstreamError."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import NoReturn

import httpx

from router.errors import UpstreamError, UpstreamStatusError, UpstreamTimeout, UpstreamUnavailable
from router.settings import UpstreamSettings
from router.workers import Worker

__all__ = ["NODELAY", "Upstream", "is_worker_fault", "raise_upstream_error"]

NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
# The relay forwards raw bytes: ask engines not to compress them.
_DEFAULT_HEADERS = {"accept-encoding": "identity", "user-agent": "pd-router"}


def raise_upstream_error(exc: Exception, worker: Worker) -> NoReturn:
    """Translate a transport failure into the router's tree (``raise ... from exc``)."""
    role, url = worker.role.value, worker.url
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        raise UpstreamUnavailable(
            f"cannot connect ({detail})", role=role, url=url, connect=True
        ) from exc
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        raise UpstreamTimeout(f"timed out ({detail})", role=role, url=url) from exc
    raise UpstreamUnavailable(
        f"connection failed ({detail})", role=role, url=url, connect=False
    ) from exc


class Upstream:
    """The pooled client of one worker. Owns its connections; close with ``aclose``."""

    def __init__(
        self,
        worker: Worker,
        settings: UpstreamSettings,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.worker = worker
        timeout = httpx.Timeout(
            connect=settings.connect_timeout_s,
            read=settings.read_timeout_s,
            write=settings.read_timeout_s,
            pool=settings.connect_timeout_s,
        )
        limits = httpx.Limits(
            max_connections=settings.max_connections,
            max_keepalive_connections=settings.max_keepalive,
            keepalive_expiry=30.0,
        )
        self._client = httpx.AsyncClient(
            base_url=worker.url,
            timeout=timeout,
            headers=_DEFAULT_HEADERS,
            transport=transport
            or httpx.AsyncHTTPTransport(limits=limits, socket_options=NODELAY, retries=0),
        )

    async def open(self, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
        """POST and return once the status line and headers arrived; the body is unread."""
        request = self._client.build_request("POST", path, content=body, headers=headers)
        try:
            return await self._client.send(request, stream=True)
        except (httpx.HTTPError, TimeoutError) as exc:
            raise_upstream_error(exc, self.worker)

    async def read(self, response: httpx.Response) -> bytes:
        """The whole body of ``response`` (then closed)."""
        try:
            return await response.aread()
        except (httpx.HTTPError, TimeoutError) as exc:
            raise_upstream_error(exc, self.worker)
        finally:
            await response.aclose()

    async def iter_raw(self, response: httpx.Response) -> AsyncIterator[bytes]:
        """The body chunks exactly as they arrive (transfer-decoded only)."""
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except (httpx.HTTPError, TimeoutError) as exc:
            raise_upstream_error(exc, self.worker)

    async def get(self, path: str, timeout: float) -> httpx.Response:
        """A small GET (models listing); raises UpstreamError."""
        try:
            return await self._client.get(path, timeout=timeout)
        except (httpx.HTTPError, TimeoutError) as exc:
            raise_upstream_error(exc, self.worker)

    async def aclose(self) -> None:
        await self._client.aclose()


def is_worker_fault(exc: UpstreamError) -> bool:
    """Failures that count against a worker's health (transport errors, timeouts, 5xx)."""
    return not isinstance(exc, UpstreamStatusError) or exc.upstream_status >= 500
