"""One keep-alive HTTP/1.1 connection to an engine and the answer it is reading: an asyncio
protocol fed straight into httptools' response parser (the parser uvicorn serves with).

No per-request object graph: a request is one pre-encoded head written with its body, and an
answer is one ``LeanAnswer`` that buffers the decoded body pieces until its reader takes them
(all that arrived at once, so SSE events that came together go on together). Every bound is
explicit: the status line and headers (and any trailers) are at most ``MAX_HEAD_BYTES``; a
whole answer read is bounded by ``answer_limit``; a stream's buffer pauses the socket past
``PAUSE_BYTES`` until the reader catches up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import cast

import httptools

from router.errors import UpstreamError
from router.upstream.base import answer_too_large, transport_error
from router.workers import Worker

__all__ = ["MAX_HEAD_BYTES", "LeanAnswer", "LeanConnection", "TransportFailure"]

MAX_HEAD_BYTES = 64 * 1024  # status line + headers (and trailers) of one answer
PAUSE_BYTES = 1 << 20  # a stream's unread bytes beyond which the socket stops being read
_CONTENT_TYPE = b"content-type"
_CONTENT_LENGTH = b"content-length"
_JSON = b"application/json"


class TransportFailure(Exception):
    """What went wrong on the socket (closed, reset, unparsable), before the router's error."""

    def __init__(self, detail: str, *, reset: bool, timed_out: bool = False) -> None:
        super().__init__(detail)
        self.reset = reset  # closed or reset: a stale pooled connection if no answer came
        self.timed_out = timed_out


class LeanAnswer:
    """An engine's answer on a ``LeanConnection``: its status and content type once the head
    arrived, then its body as it comes (the ``UpstreamResponse`` contract)."""

    __slots__ = (
        "_conn",
        "_error",
        "_length",
        "_limit",
        "_pieces",
        "_size",
        "_streaming",
        "_waiter",
        "_whole_cap",
        "complete",
        "content_type",
        "status",
    )

    def __init__(self, conn: LeanConnection, limit: Callable[[int], int], *, whole: bool) -> None:
        self._conn: LeanConnection | None = conn
        self._limit = limit
        # read whole: the reader wakes only once the answer ended, so the connection bounds it
        # (``limit`` of its status, known with the head); -1: not whole
        self._whole_cap = 0 if whole else -1
        self._pieces: list[bytes] = []
        self._size = 0
        self._length: int | None = None
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._streaming = False
        self.complete = False
        self.status = 0
        self.content_type = _JSON

    # --- what the connection tells ----------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def headed(self, status: int, content_type: bytes, length: int | None) -> None:
        self.status, self.content_type, self._length = status, content_type, length
        if self._whole_cap < 0:
            self._wake()
            return
        cap = self._whole_cap = self._limit(status)
        if length is not None and length > cap:
            self._refuse(cap, length)

    def body(self, data: bytes) -> None:
        self._pieces.append(data)
        self._size += len(data)
        cap = self._whole_cap
        if cap >= 0:
            if self._size > cap:
                self._refuse(cap, None)
            return
        if self._streaming and self._size > PAUSE_BYTES and self._conn is not None:
            self._conn.pause()
        self._wake()

    def _refuse(self, cap: int, length: int | None) -> None:
        """A whole answer over its bound: failed now, its connection closed, nothing more read."""
        conn = self._conn
        if conn is not None and self._error is None:
            self._error = answer_too_large(conn.worker, self.status, cap, length)
            self._conn = None
            self._pieces.clear()
            conn.abort()
            self._wake()

    def ended(self) -> None:
        self.complete = True
        self._conn = None  # back in the pool: closing this answer must not touch it
        self._wake()

    def failed(self, error: UpstreamError) -> None:
        if not self.complete and self._error is None:
            self._error = error
            self._conn = None
        self._wake()

    # --- what the reader does ---------------------------------------------------------------

    def _next(self) -> asyncio.Future[None]:
        """A future resolved when the connection tells something new (awaited by the reader,
        who then calls ``_check``); raises the answer's failure."""
        if self._error is not None:
            raise self._error
        conn = self._conn
        assert conn is not None  # else complete or failed
        conn.last_io = time.monotonic()
        waiter = self._waiter = conn.loop.create_future()
        return waiter

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    async def headers(self) -> None:
        """Until the status and headers arrived (read whole: until the answer ended)."""
        if self._whole_cap >= 0:
            while not self.complete:
                await self._next()
                self._check()
            return
        while self.status == 0:
            await self._next()
            self._check()

    def _take(self) -> bytes:
        pieces = self._pieces
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self._size = 0
        conn = self._conn
        if conn is not None:
            conn.reader_took()
        return data

    async def chunks(self) -> AsyncIterator[bytes]:
        self._streaming = True
        while True:
            if self._pieces:
                yield self._take()
            elif self.complete:
                return
            else:
                await self._next()
                self._check()

    def at_eof(self) -> bool:
        return self.complete and not self._pieces

    async def read(self) -> bytes:
        try:
            limit = self._limit(self.status)
            if self._length is not None and self._length > limit:
                raise self._too_large(limit, self._length)
            while not self.complete:
                if self._size > limit:
                    raise self._too_large(limit, None)
                await self._next()
                self._check()
            if self._size > limit:
                raise self._too_large(limit, None)
            return self._take()
        finally:
            self._drop()

    def _too_large(self, limit: int, length: int | None) -> UpstreamError:
        conn = self._conn
        assert conn is not None  # not complete
        return answer_too_large(conn.worker, self.status, limit, length)

    def _drop(self) -> None:
        """An answer not read to its end closes its connection (the engine sees the client
        going away); a complete one's connection is back in the pool already."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()

    async def aclose(self) -> None:
        self._drop()


class LeanConnection(asyncio.Protocol):
    """A TCP connection to one worker: one request at a time, kept alive between them."""

    __slots__ = (
        "_head_bytes",
        "_headers_done",
        "_length",
        "_on_closed",
        "_on_idle",
        "_parser",
        "_type",
        "answer",
        "closed",
        "idle_since",
        "last_io",
        "loop",
        "transport",
        "worker",
    )

    def __init__(
        self,
        worker: Worker,
        on_idle: Callable[[LeanConnection], None],
        on_closed: Callable[[LeanConnection], None],
    ) -> None:
        self.worker = worker
        self.loop = asyncio.get_running_loop()
        self._on_idle = on_idle
        self._on_closed = on_closed
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.answer: LeanAnswer | None = None
        self.closed = False
        self.idle_since = self.last_io = time.monotonic()
        self._head_bytes = 0
        self._headers_done = False
        self._type = _JSON
        self._length: int | None = None

    # --- asyncio protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # the pool sets it too: uvloop may call this a turn after the connection is handed over
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.last_io = time.monotonic()
        if not self._headers_done:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(TransportFailure(f"unparsable answer ({exc})", reset=False))
            return
        if self._head_bytes > MAX_HEAD_BYTES:
            detail = f"its answer's head passed {MAX_HEAD_BYTES} bytes"
            self._fail(TransportFailure(detail, reset=False))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.answer is not None:
            reset = exc is None or isinstance(exc, ConnectionResetError | BrokenPipeError)
            detail = "the engine closed the connection" if exc is None else repr(exc)
            self._fail(TransportFailure(detail, reset=reset))
        self._on_closed(self)

    # --- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.answer is None:  # bytes nobody asked for: not a connection to keep
            self.abort()
        self._headers_done = False
        self._type, self._length = _JSON, None

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._headers_done:
            self._head_bytes += len(name) + len(value)  # a trailer: counted, dropped
            return
        name = name.lower()
        if name == _CONTENT_TYPE:
            self._type = value
        elif name == _CONTENT_LENGTH and value.isdigit():
            self._length = int(value)

    def on_headers_complete(self) -> None:
        self._headers_done = True
        self._head_bytes = 0  # from here on only trailers count
        answer = self.answer
        if answer is not None:
            answer.headed(self._parser.get_status_code(), self._type, self._length)

    def on_body(self, body: bytes) -> None:
        answer = self.answer
        if answer is not None:
            answer.body(body)

    def on_message_complete(self) -> None:
        answer, self.answer = self.answer, None
        self._head_bytes = 0
        if answer is None:
            return
        answer.ended()
        if self._parser.should_keep_alive() and not self.closed:
            transport = self.transport
            if transport is not None and transport.is_reading() is False:
                transport.resume_reading()
            self.idle_since = time.monotonic()
            self._on_idle(self)
        else:
            self.abort()

    # --- the client's side ------------------------------------------------------------------

    def send(
        self, head: bytes, body: bytes, limit: Callable[[int], int], *, whole: bool
    ) -> LeanAnswer:
        """Write one request; its answer (status and headers still to come)."""
        answer = self.answer = LeanAnswer(self, limit, whole=whole)
        self.last_io = time.monotonic()
        transport = self.transport
        assert transport is not None
        if body:
            transport.writelines((head, body))
        else:
            transport.write(head)
        return answer

    def reader_took(self) -> None:
        """The reader emptied the answer's buffer: read the socket again if it was paused."""
        self.last_io = time.monotonic()
        transport = self.transport
        if transport is not None and not transport.is_reading() and not self.closed:
            transport.resume_reading()

    def pause(self) -> None:
        """The reader is behind: stop reading the socket until it took the buffer."""
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def timed_out(self, idle_s: float) -> None:
        detail = f"no byte from the engine for {idle_s:g}s"
        self._fail(TransportFailure(detail, reset=False, timed_out=True))

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, failure: TransportFailure) -> None:
        answer, self.answer = self.answer, None
        self.abort()
        if answer is not None:
            headed = answer.status != 0
            error = transport_error(
                failure,
                self.worker,
                connect_failed=False,
                timed_out=failure.timed_out,
                stale=failure.reset and not headed,
            )
            answer.failed(error)
