"""Per-connection limits for uvicorn's httptools server: header size, header and body read
timeouts, chunked trailers, malformed requests and the connection caps (slowloris, file
descriptor exhaustion).

httptools buffers a request's headers without bound, and uvicorn waits for them, and for a
body shorter than its Content-Length, forever. ``limited_http_protocol(limits)`` returns a
``HttpToolsProtocol`` subclass, passed as ``uvicorn.Config(http=...)``, that enforces:

* **header size**: more than ``max_header_bytes`` received before the end of a request's headers
  (request line included): 431 and close; nothing beyond the limit is buffered;
* **header timeout**: a request's headers not complete ``header_timeout_s`` after its first byte
  (on a new connection: after the connection opened): 408 and close. A new connection that sent
  nothing at all in that time is closed without an answer (nobody is waiting for one);
* **body timeout**: no byte of the body for ``body_timeout_s`` (an idle time, like nginx's
  ``client_body_timeout``; a large body on a slow link is fine while it moves): 408 and close;
  the application reads ``http.disconnect``. Time the application itself leaves the body unread
  (uvicorn stops reading beyond 64 KiB, or an ``Expect: 100-continue`` not answered yet) does not
  count;
* **trailers**: the fields after a chunked body are dropped, never merged into the request's
  headers (uvicorn appends them, so a trailer ``Authorization`` would replace the real one), and
  more than ``max_header_bytes`` received in a body without a byte of body data (trailers, chunk
  framing) is 431 and close, the application reading ``http.disconnect``;
* **malformed requests** (request line, header, chunk framing): 400 ``invalid_request_error``
  and close (uvicorn answers ``text/plain``);
* **connection caps** (``router.server.connection_caps``): a connection beyond
  ``max_connections_per_source`` from one peer address, or beyond ``max_connections`` once no
  idle keep-alive connection could be closed for it, is answered 503 at once and closed.

None of the timeouts applies while a response is under way (a long stream is not a slow
request), nor to a keep-alive connection between requests (uvicorn's ``timeout_keep_alive``
closes that). Answers are the OpenAI error JSON with ``connection: close``; the connection then
half-closes and discards what still comes for a moment, so that the client reads the answer
instead of a reset. Refusals are counted and logged in one warning every 10 s at most.

Each response's head goes out with its first body bytes, and the client leaving is a future
in the scope (``lean_cycle``).

The module imports nothing from the router but ``connection_caps`` and ``lean_cycle`` (only
uvicorn and httptools), so that the standalone registry service can use it as well.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import httptools
import msgspec
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from router.server.connection_caps import ConnectionCaps
from router.server.lean_cycle import lean_cycle

__all__ = ["HttpLimits", "LimitedHttpToolsProtocol", "limited_http_protocol"]

# after an error answer: discard what the client still sends for this long, or this many bytes
_LINGER_S = 1.0
_LINGER_MAX_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one server allows each connection (see the module docstring)."""

    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 4096
    max_connections_per_source: int = 0  # 0: no per-source cap


class _Phase(enum.Enum):
    NEW = "new"  # connected, nothing received yet
    IDLE = "idle"  # between requests (or a request is being answered)
    HEADERS = "headers"  # a request's headers are arriving
    BODY = "body"  # its body (and a chunked body's trailers) are arriving
    CLOSING = "closing"  # answered with an error: discarding input until closed


_READING_HEADERS = (_Phase.NEW, _Phase.IDLE, _Phase.HEADERS)

_encoder = msgspec.json.Encoder()


def _error_response(status: int, error_type: str, message: str) -> bytes:
    """A complete HTTP/1.1 response carrying the OpenAI error JSON, closing the connection."""
    body = _encoder.encode(
        {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    )
    head = b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
    return STATUS_LINE[status] + head % len(body) + body


def _source_of(transport: asyncio.BaseTransport) -> str | None:
    """The peer's IP address, ``None`` for a peer without one (a Unix socket)."""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and peer and isinstance(peer[0], str):
        return peer[0]
    return None


class _TimedFlowControl(FlowControl):
    """uvicorn's read/write flow control, noting when the application last asked for input
    (uvicorn resumes reading on every ``receive()``, after answering ``100-continue``): the
    time the application left the body unread is not the client's."""

    def __init__(self, transport: asyncio.Transport, clock: Callable[[], float]) -> None:
        super().__init__(transport)
        self._clock = clock
        self.asked_at = 0.0

    def resume_reading(self) -> None:
        self.asked_at = self._clock()
        super().resume_reading()


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with ``limits`` enforced (``limited_http_protocol``)."""

    limits: ClassVar[HttpLimits] = HttpLimits()
    caps: ClassVar[ConnectionCaps] = ConnectionCaps(HttpLimits().max_connections, 0)

    _phase = _Phase.NEW
    _counted = False  # holds a slot in ``caps`` (released once, by ``_release``)
    _source: str | None = None
    _timer: asyncio.TimerHandle | None = None
    _header_bytes = 0  # received for the current request's head so far
    _headers_done = 0  # requests whose headers completed on this connection
    _last_body_at = 0.0  # loop time of the body's last progress
    _bodiless_bytes = 0  # received in the body phase since its data last moved (trailers)
    _discarded = 0  # bytes thrown away while closing
    _timed_flow: _TimedFlowControl

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        source = _source_of(transport)
        refusal = self.caps.admit(source, self.connections)
        if refusal is not None:
            transport.write(_error_response(503, "service_unavailable", refusal))
            transport.close()
            return
        self._counted, self._source = True, source
        self.caps.idle(self, source)  # nothing received yet: as evictable as a kept-alive one
        super().connection_made(transport)
        self.flow = self._timed_flow = _TimedFlowControl(transport, self.loop.time)
        self._arm(self.limits.header_timeout_s, self._header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if self.transport is None:  # refused in connection_made: uvicorn never saw it
            return
        self._release()
        super().connection_lost(exc)

    def _release(self) -> None:
        if self._counted:
            self._counted = False
            self.caps.forget(self, self._source)

    def data_received(self, data: bytes) -> None:
        phase = self._phase
        if phase is _Phase.CLOSING:
            self._discard(len(data))
            return
        if phase in _READING_HEADERS:
            if phase is not _Phase.HEADERS:  # NEW or IDLE: a request begins
                self.caps.busy(self, self._source)
            self._phase = _Phase.HEADERS
            room = self.limits.max_header_bytes - self._header_bytes
            if len(data) > room:
                self._feed_beyond(data, room)
                return
            self._header_bytes += len(data)
        elif phase is _Phase.BODY:
            self._feed_body(data)
            return
        self._feed(data)
        self._arm_for_phase()

    def _feed(self, data: bytes) -> None:
        """uvicorn's ``data_received``, with a malformed request answered in the error JSON
        (uvicorn's is text/plain, and logs a warning per request)."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self._release()  # the websocket protocol takes the connection over
                self._cancel_timer()
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as exc:
            message = f"malformed HTTP request: {exc}"
            self._fail(400, "invalid_request_error", message, "malformed request")

    def _feed_body(self, data: bytes) -> None:
        """Feed a read of the body phase, failing once more than the header budget came
        without body data (trailers, or chunk framing alone: ``on_body`` resets the count)."""
        self._bodiless_bytes += len(data)
        self._feed(data)
        if self._phase is _Phase.BODY and self._bodiless_bytes > self.limits.max_header_bytes:
            self._fail_too_large("trailers")
            return
        self._arm_for_phase()

    def _feed_beyond(self, data: bytes, room: int) -> None:
        """Feed what fits in the header budget; past it the headers must have ended."""
        done = self._headers_done
        if room > 0:
            self._header_bytes += room
            self._feed(data[:room])
        if self._phase is _Phase.CLOSING or self.transport.is_closing():
            return
        if self._headers_done == done:
            self._fail_too_large("headers")
            return
        self.data_received(data[room:])

    # -- parser callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._phase is _Phase.IDLE:
            self._phase = _Phase.HEADERS
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._phase is _Phase.HEADERS:  # else a chunked body's trailer: dropped
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._headers_done += 1
        self._header_bytes = 0
        self._bodiless_bytes = 0
        self._cancel_timer()
        super().on_headers_complete()
        lean_cycle(self.cycle, self.loop)
        upgrading = self.parser.should_upgrade() and self._should_upgrade()
        self._phase = _Phase.IDLE if upgrading else _Phase.BODY

    def on_body(self, body: bytes) -> None:
        self._bodiless_bytes = 0
        if self._timer is not None:  # else it starts after this read (``_arm_for_phase``)
            self._last_body_at = self.loop.time()
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._phase = _Phase.IDLE
        self._cancel_timer()
        super().on_message_complete()
        if not self.pipeline:  # the body is in: read on to see the client leave (CLIENT_GONE)
            self.flow.resume_reading()
        cycle = self.cycle  # None after an upgrade request
        if cycle is not None and cycle.response_complete and not self.transport.is_closing():
            self.caps.idle(self, self._source)  # answered before its body ended: idle from now

    def on_response_complete(self) -> None:
        super().on_response_complete()
        idle = self._phase is _Phase.IDLE and self.cycle.response_complete
        if idle and not self.transport.is_closing():
            self.caps.idle(self, self._source)

    # -- deadlines ---------------------------------------------------------------------------

    def _arm_for_phase(self) -> None:
        """Start the deadline of the phase the data left us in, unless one runs already (a
        request that arrives whole in one read never starts one)."""
        if self._timer is not None or self._phase is _Phase.CLOSING:
            return
        if self._phase is _Phase.HEADERS:
            self._arm(self.limits.header_timeout_s, self._header_timeout)
        elif self._phase is _Phase.BODY:
            self._last_body_at = self.loop.time()
            self._arm(self.limits.body_timeout_s, self._body_timeout)

    def _header_timeout(self) -> None:
        self._timer = None
        if self._phase is _Phase.NEW:
            self.caps.refusals.add("idle without a request")
            self.transport.close()
        elif self._phase is _Phase.HEADERS:
            if self._answering():  # a request waiting behind a response in progress
                self._arm(self.limits.header_timeout_s, self._header_timeout)
                return
            timeout = self.limits.header_timeout_s
            message = f"request headers not received within {timeout:g} s"
            self._fail(408, "timeout", message, "headers too slow")

    def _body_timeout(self) -> None:
        self._timer = None
        if self._phase is not _Phase.BODY:
            return
        now = self.loop.time()
        if self.flow.read_paused or self.cycle.waiting_for_100_continue:
            self._last_body_at = now  # the application is not reading: not the client's fault
        idle = now - max(self._last_body_at, self._timed_flow.asked_at)
        timeout = self.limits.body_timeout_s
        if idle < timeout:
            self._arm(timeout - idle, self._body_timeout)
            return
        message = f"request body stalled: no data for {timeout:g} s"
        self._fail(408, "timeout", message, "body stalled")

    def _answering(self) -> bool:
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete

    def _arm(self, delay: float, callback: Callable[[], object]) -> None:
        self._cancel_timer()
        self._timer = self.loop.call_later(delay, callback)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- failing a connection ----------------------------------------------------------------

    def _fail(self, status: int, error_type: str, message: str, reason: str) -> None:
        """Answer ``status`` and close; where a response is already under way on this
        connection (it cannot carry a second one), just close."""
        self.caps.refusals.add(reason)
        cycle = self.cycle
        if self._phase is _Phase.BODY and not cycle.response_started:
            cycle.disconnected = True  # the application reads http.disconnect; its sends drop
            cycle.message_event.set()
        elif self._answering() or (self._phase is _Phase.BODY and cycle.response_started):
            self.transport.close()
            return
        self._unset_keepalive_if_required()
        self.transport.write(_error_response(status, error_type, message))
        self._linger()

    def _fail_too_large(self, what: str) -> None:
        limit = self.limits.max_header_bytes
        message = f"request {what} exceed {limit} bytes"
        self._fail(431, "invalid_request_error", message, f"{what} too large")

    def _linger(self) -> None:
        """Half-close and drop further input for a moment: closing with unread input would
        reset the connection, and the client could lose the answer."""
        self._phase = _Phase.CLOSING
        self._cancel_timer()
        if self.transport.is_closing():
            return
        if self.transport.can_write_eof():
            try:
                self.transport.write_eof()
            except OSError:  # the peer is already gone (ENOTCONN): nothing to linger for
                self.close_now()
                return
        self.flow.resume_reading()
        self._timer = self.loop.call_later(_LINGER_S, self.close_now)
        self.caps.lingering(self, self._source)

    def close_now(self) -> None:
        """Close, and stop counting against the connection cap at once (not only once the
        transport reports the connection lost, on a later loop iteration)."""
        self._cancel_timer()
        self._release()
        self.connections.discard(self)
        self.transport.close()

    def _discard(self, size: int) -> None:
        self._discarded += size
        if self._discarded > _LINGER_MAX_BYTES:
            self.transport.close()


def limited_http_protocol(limits: HttpLimits) -> type[LimitedHttpToolsProtocol]:
    """A protocol class enforcing ``limits``, for ``uvicorn.Config(http=...)``; each call makes
    a class of its own (one per server)."""

    class _Bound(LimitedHttpToolsProtocol):
        pass

    _Bound.limits = limits
    _Bound.caps = ConnectionCaps(limits.max_connections, limits.max_connections_per_source)
    return _Bound
