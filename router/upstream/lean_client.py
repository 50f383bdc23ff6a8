"""The lean implementation of the upstream seam (the default): keep-alive HTTP/1.1 connections
on asyncio protocols, parsed by httptools (``lean_connection``), pooled per worker here.

Per request it costs one pre-encoded head, one write and one answer object; the pool is a LIFO
stack of idle connections (the most recently used is the least likely to have been closed by
the engine), at most ``max_connections`` open (a request waits for one beyond that) and at most
``max_keepalive`` idle, each idle one dropped after ``keepalive_s`` (below uvicorn's 5 s, so the
router closes first). The idle read timeout (``read_timeout_s``: no byte for that long while an
answer is awaited) is kept by one sweep over the busy connections, not a timer per read.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from functools import partial
from urllib.parse import urlsplit

from router.errors import UpstreamError
from router.settings import UpstreamSettings
from router.upstream.base import (
    DEFAULT_HEADERS,
    NODELAY,
    answer_limit,
    refuse_invalid_status,
    transport_error,
)
from router.upstream.lean_connection import LeanAnswer, LeanConnection, TransportFailure
from router.workers import Worker

__all__ = ["LeanUpstream"]

_SWEEP_MAX_S = 1.0  # the idle read timeout is kept to within a quarter of itself, or this


def _head_block(headers: dict[str, str]) -> bytes:
    return "".join(f"{name}: {value}\r\n" for name, value in headers.items()).encode("latin-1")


class LeanUpstream:
    """The pooled keep-alive connections to one worker."""

    def __init__(self, worker: Worker, settings: UpstreamSettings, base_url: str = "") -> None:
        """``base_url``: another server of the worker's (its bootstrap server); default its
        own URL."""
        self.worker = worker
        self._settings = settings
        url = urlsplit(base_url or worker.url)
        self._tls: ssl.SSLContext | None = (
            ssl.create_default_context() if url.scheme == "https" else None
        )
        self._host = url.hostname or "127.0.0.1"
        self._port = url.port or (443 if self._tls is not None else 80)
        self._prefix = url.path.rstrip("/").encode()
        authority = url.netloc.rsplit("@", 1)[-1]
        self._fixed = f"host: {authority}\r\n".encode() + _head_block(DEFAULT_HEADERS)
        self._limit = partial(answer_limit, settings=settings)
        self._idle: deque[LeanConnection] = deque()
        self._busy: set[LeanConnection] = set()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._opening = 0
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    # --- the seam ---------------------------------------------------------------------------

    async def open(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        *,
        whole: bool = False,
        method: bytes = b"POST",
    ) -> LeanAnswer:
        """Send on a pooled (else new) connection; the answer once its head arrived (``whole``:
        once all of it arrived, one wake-up instead of two). ``method``: ``b"GET"`` sends no
        body (the fleet's probes and load reads)."""
        head = self._head(method, path, headers, len(body))
        conn = self._idle_connection() or await self._acquire()
        answer = conn.send(head, body, self._limit, whole=whole)
        try:
            await answer.headers()
        except BaseException:
            await answer.aclose()
            raise
        await refuse_invalid_status(self.worker, answer)
        return answer

    async def aclose(self) -> None:
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in (*self._idle, *self._busy):
            conn.abort()
        self._idle.clear()
        self._busy.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
        await asyncio.sleep(0)  # the aborted transports close their sockets on the next turn

    # --- one exchange -----------------------------------------------------------------------

    def _head(self, method: bytes, path: str, headers: dict[str, str], length: int) -> bytes:
        """A request's head (a GET's without a content-length)."""
        return b"".join(
            (
                method,
                b" ",
                self._prefix,
                path.encode("latin-1"),
                b" HTTP/1.1\r\n",
                self._fixed,
                _head_block(headers),
                b"\r\n" if method == b"GET" else b"content-length: %d\r\n\r\n" % length,
            )
        )

    # --- the pool ---------------------------------------------------------------------------

    def _idle_connection(self) -> LeanConnection | None:
        """The most recently used idle connection still open and within the keep-alive."""
        idle, keep_s = self._idle, self._settings.keepalive_s
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            if time.monotonic() - conn.idle_since > keep_s:
                conn.abort()
                self._drop_stale_idle()
                return None
            self._busy_add(conn)
            return conn
        return None

    async def _acquire(self) -> LeanConnection:
        """A new connection, once there is room for one (or an idle one freed meanwhile)."""
        while len(self._busy) + self._opening >= self._settings.max_connections:
            await self._wait_for_room()
            conn = self._idle_connection()
            if conn is not None:
                return conn
        return await self._connect()

    def _drop_stale_idle(self) -> None:
        """Idle connections older than the keep-alive: the oldest are at the left."""
        idle, keep_s, now = self._idle, self._settings.keepalive_s, time.monotonic()
        while idle and (idle[0].closed or now - idle[0].idle_since > keep_s):
            idle.popleft().abort()

    async def _wait_for_room(self) -> None:
        if self._closed:
            raise self._failure(TransportFailure("the worker's client is closed", reset=False))
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            if not waiter.done():
                waiter.cancel()

    def _room(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _connect(self) -> LeanConnection:
        loop = asyncio.get_running_loop()
        self._opening += 1
        try:
            async with asyncio.timeout(self._settings.connect_timeout_s):
                transport, conn = await loop.create_connection(
                    partial(LeanConnection, self.worker, self._released, self._forget),
                    self._host,
                    self._port,
                    ssl=self._tls,
                )
        except (OSError, TimeoutError) as exc:
            self._room()
            raise transport_error(
                exc, self.worker, connect_failed=True, timed_out=isinstance(exc, TimeoutError)
            ) from exc
        finally:
            self._opening -= 1
        conn.transport = transport  # uvloop may call connection_made a turn later
        sock = transport.get_extra_info("socket")
        if sock is not None:
            for option in NODELAY:
                sock.setsockopt(*option)
        self._busy_add(conn)
        return conn

    def _busy_add(self, conn: LeanConnection) -> None:
        self._busy.add(conn)
        if self._sweep is None:
            self._schedule_sweep()

    def _released(self, conn: LeanConnection) -> None:
        """A connection's answer ended: back on the idle stack (or closed past the cap)."""
        self._busy.discard(conn)
        if self._closed or len(self._idle) >= self._settings.max_keepalive:
            conn.abort()
        else:
            self._idle.append(conn)
        self._room()

    def _forget(self, conn: LeanConnection) -> None:
        """A connection closed (either side): room for another."""
        if conn in self._busy:
            self._busy.discard(conn)
            self._room()

    # --- the idle read timeout --------------------------------------------------------------

    def _schedule_sweep(self) -> None:
        interval = min(self._settings.read_timeout_s / 4, _SWEEP_MAX_S)
        self._sweep = asyncio.get_running_loop().call_later(interval, self._sweep_busy)

    def _sweep_busy(self) -> None:
        """Fail the answers that waited ``read_timeout_s`` without a byte; sweep again while
        any connection is busy."""
        self._sweep = None
        now, limit = time.monotonic(), self._settings.read_timeout_s
        for conn in list(self._busy):
            if conn.answer is not None and now - conn.last_io > limit:
                conn.timed_out(limit)
        if self._busy and not self._closed:
            self._schedule_sweep()

    def _failure(self, failure: TransportFailure) -> UpstreamError:
        return transport_error(failure, self.worker, connect_failed=False, timed_out=False)
