"""A lean keep-alive pool for httpx: O(1) per request instead of httpcore's O(connections).

httpcore's ``AsyncConnectionPool`` re-scans every pooled connection twice per request and probes
each idle socket with a ``select`` call (``has_expired``), plus an O(n^2) idle count. Profiled at
32 concurrent streams that scan was ~45% of the router's CPU. This transport keeps httpcore's
HTTP/1.1 connection (and so its parser) and replaces only the pool: a LIFO stack of idle
connections for one origin, a semaphore for the connection limit, and a readability probe only
for connections that sat idle for a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpcore
import httpx

__all__ = ["LeanPoolTransport"]

logger = logging.getLogger(__name__)

# Connections reused within this many seconds skip the is-the-server-gone probe: engines keep
# idle connections open for >= 5 s (uvicorn's default keep-alive).
_TRUST_IDLE_S = 1.0

_ERRORS: list[tuple[type[Exception], type[httpx.TransportError]]] = [
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ProtocolError, httpx.ProtocolError),
]


async def _close_quietly(conn: httpcore.AsyncHTTPConnection) -> None:
    """Close a connection the pool is dropping. Closing only shuts the socket (TLS: after a
    close_notify), so a failure means the peer is already gone: it is logged, not raised."""
    try:
        await conn.aclose()
    except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream):
        logger.debug("closing an upstream connection failed", exc_info=True)


@contextlib.contextmanager
def _mapped_errors() -> Iterator[None]:
    try:
        yield
    except httpcore.UnsupportedProtocol as exc:
        raise httpx.UnsupportedProtocol(str(exc)) from exc
    except Exception as exc:
        for core_type, httpx_type in _ERRORS:
            if isinstance(exc, core_type):
                raise httpx_type(str(exc)) from exc
        raise


class _PooledStream(httpx.AsyncByteStream):
    """The response body; closing it hands the connection back to the pool."""

    def __init__(
        self,
        pool: LeanPoolTransport,
        conn: httpcore.AsyncHTTPConnection,
        response: httpcore.Response,
    ) -> None:
        self._pool = pool
        self._conn = conn
        self._response = response
        self._released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _mapped_errors():
            async for chunk in self._response.aiter_stream():
                yield chunk

    async def aclose(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            with _mapped_errors():
                await self._response.aclose()
        finally:
            await self._pool.release(self._conn)


class LeanPoolTransport(httpx.AsyncBaseTransport):
    """Pool of HTTP/1.1 connections to the single origin of one worker."""

    def __init__(
        self,
        *,
        max_connections: int,
        max_idle: int,
        keepalive_expiry: float,
        socket_options: list[tuple[int, int, int]],
    ) -> None:
        self._max_connections = max_connections
        self._max_idle = max_idle
        self._keepalive_expiry = keepalive_expiry
        self._socket_options = socket_options
        self._idle: list[tuple[httpcore.AsyncHTTPConnection, float]] = []
        self._slots: asyncio.Semaphore | None = None
        self._open: set[httpcore.AsyncHTTPConnection] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await self._acquire_slot(request.extensions.get("timeout", {}).get("pool"))
        conn = self._take_idle(request)
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        try:
            with _mapped_errors():
                response = await conn.handle_async_request(core_request)
        except BaseException:
            await self.release(conn)
            raise
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_PooledStream(self, conn, response),
            extensions=response.extensions,
        )

    async def _acquire_slot(self, timeout: float | None) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max_connections)
        if not self._slots.locked():
            await self._slots.acquire()
            return
        try:
            async with asyncio.timeout(timeout):
                await self._slots.acquire()
        except TimeoutError as exc:
            raise httpx.PoolTimeout("no free connection in the pool") from exc

    def _take_idle(self, request: httpx.Request) -> httpcore.AsyncHTTPConnection:
        now = time.monotonic()
        while self._idle:
            conn, since = self._idle.pop()
            if conn.is_idle() and (now - since < _TRUST_IDLE_S or not conn.has_expired()):
                return conn
            self._discard(conn)
        conn = httpcore.AsyncHTTPConnection(
            origin=httpcore.Origin(
                request.url.raw_scheme, request.url.raw_host, request.url.port or 80
            ),
            keepalive_expiry=self._keepalive_expiry,
            socket_options=self._socket_options,
        )
        self._open.add(conn)
        return conn

    async def release(self, conn: httpcore.AsyncHTTPConnection) -> None:
        """Return ``conn`` to the idle stack if reusable, else close it; frees its slot."""
        assert self._slots is not None
        self._slots.release()
        if conn.is_idle() and len(self._idle) < self._max_idle:
            self._idle.append((conn, time.monotonic()))
            return
        if not conn.is_closed():
            await _close_quietly(conn)
        self._open.discard(conn)

    def _discard(self, conn: httpcore.AsyncHTTPConnection) -> None:
        self._open.discard(conn)
        if not conn.is_closed():
            asyncio.get_running_loop().create_task(conn.aclose())

    async def aclose(self) -> None:
        self._idle.clear()
        conns, self._open = self._open, set()
        for conn in conns:
            await _close_quietly(conn)

    def stats(self) -> dict[str, Any]:
        return {"open": len(self._open), "idle": len(self._idle)}
