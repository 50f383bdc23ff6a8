"""Per-connection limits for uvicorn's httptools server: header size, header and body read
timeouts, and a connection cap (slowloris, file descriptor exhaustion).

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
* **connection cap**: a connection beyond ``max_connections`` open on this server is answered
  503 at once and closed, so slow clients cannot take every file descriptor.

None of them applies while a response is under way (a long stream is not a slow request), nor to
a keep-alive connection between requests (uvicorn's ``timeout_keep_alive`` closes that). Answers
are the OpenAI error JSON with ``connection: close``; the connection then half-closes and
discards what still comes for a moment, so that the client reads the answer instead of a reset.

The module imports nothing from the router (only uvicorn and httptools), so that the standalone
registry service can use it as well.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import msgspec
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

__all__ = [
    "HttpLimits",
    "LimitedHttpToolsProtocol",
    "auto_max_connections",
    "limited_http_protocol",
    "raise_open_file_limit",
]

logger = logging.getLogger(__name__)

# after an error answer: discard what the client still sends for this long, or this many bytes
_LINGER_S = 1.0
_LINGER_MAX_BYTES = 256 * 1024
_LOG_EVERY_S = 10.0  # refusals are summed up in one warning at most this often

# auto max_connections: file descriptors kept for everything else (listeners, logs, the
# registry, KV event sockets), then a third of the rest, since a client connection in flight
# holds a prefill and a decode connection as well
_RESERVED_FDS = 256
_FDS_PER_CONNECTION = 3
_AUTO_MIN, _AUTO_MAX = 64, 16384


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one server allows each connection (see the module docstring)."""

    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 4096


def raise_open_file_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; return the soft limit now
    in force (unchanged where it cannot be raised)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError) as exc:
        logger.warning("could not raise the open file limit from %d to %d: %s", soft, hard, exc)
        return soft
    return hard


def auto_max_connections(fd_limit: int) -> int:
    """The default connection cap for an open file limit: headroom for the upstream sockets."""
    spare = (fd_limit - _RESERVED_FDS) // _FDS_PER_CONNECTION
    return max(_AUTO_MIN, min(_AUTO_MAX, spare))


class _Phase(enum.Enum):
    NEW = "new"  # connected, nothing received yet
    IDLE = "idle"  # between requests (or a request is being answered)
    HEADERS = "headers"  # a request's headers are arriving
    BODY = "body"  # its body is arriving
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


class _RefusalLog:
    """Counts connections ended by a limit, by reason, and logs them in one warning per
    interval (the first at once, then at most every 10 s): a flood must not become a flood of
    log lines."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._next_log = 0.0

    def add(self, reason: str) -> None:
        self._counts[reason] = self._counts.get(reason, 0) + 1
        now = time.monotonic()
        if now >= self._next_log:
            self._next_log = now + _LOG_EVERY_S
            summary = ", ".join(f"{count} {name}" for name, count in sorted(self._counts.items()))
            self._counts.clear()
            logger.warning("HTTP connections ended by the server limits: %s", summary)


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
    """uvicorn's httptools protocol with ``limits`` enforced; bind them with
    ``limited_http_protocol``."""

    limits: ClassVar[HttpLimits] = HttpLimits()
    refusals: ClassVar[_RefusalLog] = _RefusalLog()
    # this server's connections answered with an error, waiting out their linger time: the
    # first to make room for a new connection at the cap
    lingering: ClassVar[set[LimitedHttpToolsProtocol]] = set()

    _phase = _Phase.NEW
    _refused = False
    _timer: asyncio.TimerHandle | None = None
    _header_bytes = 0  # received for the current request's head so far
    _headers_done = 0  # requests whose headers completed on this connection
    _last_body_at = 0.0  # loop time of the body's last progress
    _discarded = 0  # bytes thrown away while closing
    _timed_flow: _TimedFlowControl

    # -- connection --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections and self.lingering:
            self.lingering.pop().close_now()
        if len(self.connections) >= self.limits.max_connections:
            self._refused = True
            self.refusals.add("over the connection cap")
            message = f"the server holds its maximum of {self.limits.max_connections} connections"
            transport.write(_error_response(503, "service_unavailable", message))
            transport.close()
            return
        super().connection_made(transport)
        self.flow = self._timed_flow = _TimedFlowControl(transport, self.loop.time)
        self._arm(self.limits.header_timeout_s, self._header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.lingering.discard(self)
        if not self._refused:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._phase is _Phase.CLOSING:
            self._discard(len(data))
            return
        if self._phase in _READING_HEADERS:
            self._phase = _Phase.HEADERS
            room = self.limits.max_header_bytes - self._header_bytes
            if len(data) > room:
                self._feed_beyond(data, room)
                return
            self._header_bytes += len(data)
        super().data_received(data)
        self._arm_for_phase()

    def _feed_beyond(self, data: bytes, room: int) -> None:
        """Feed what fits in the header budget; past it the headers must have ended."""
        done = self._headers_done
        if room > 0:
            self._header_bytes += room
            super().data_received(data[:room])
        if self._phase is _Phase.CLOSING or self.transport.is_closing():
            return
        if self._headers_done == done:
            limit = self.limits.max_header_bytes
            message = f"request headers exceed {limit} bytes"
            self._fail(431, "invalid_request_error", message, "headers too large")
            return
        self.data_received(data[room:])

    # -- parser callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._phase is _Phase.IDLE:
            self._phase = _Phase.HEADERS
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._headers_done += 1
        self._header_bytes = 0
        self._cancel_timer()
        super().on_headers_complete()
        upgrading = self.parser.should_upgrade() and self._should_upgrade()
        self._phase = _Phase.IDLE if upgrading else _Phase.BODY

    def on_body(self, body: bytes) -> None:
        if self._timer is not None:  # else it starts after this read (``_arm_for_phase``)
            self._last_body_at = self.loop.time()
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._phase = _Phase.IDLE
        self._cancel_timer()
        super().on_message_complete()

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
            self.refusals.add("idle without a request")
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
        self.refusals.add(reason)
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
        self.lingering.add(self)

    def close_now(self) -> None:
        """Close, and stop counting against the connection cap at once (not only once the
        transport reports the connection lost, on a later loop iteration)."""
        self._cancel_timer()
        self.lingering.discard(self)
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
    _Bound.refusals = _RefusalLog()
    _Bound.lingering = set()
    return _Bound
