"""uvicorn's request/response cycle, leaner on the hot path.

* Fewer writes per response: the status line and headers go out with the first body bytes.
  uvicorn writes a response's head as soon as the application sends ``http.response.start`` and
each body message as it comes: two socket writes (two system calls, each one the kernel's
loopback delivery too) for a whole answer, one more than needed. ``LeanCycle`` keeps the
  head uvicorn built (with all of uvicorn's checks) and writes it together with the next body
  message. This router sends the first body message right after the start, always (a relay
  starts its response only once the first chunk is in hand), so no head waits for anything.
* Fewer steps per response: a whole answer can come as one message of the ``WHOLE_RESPONSE``
  extension (advertised in ``scope["extensions"]``), written at once with its content-length,
  without uvicorn's general send path (its bookkeeping for any application's headers; each
  name and value is still checked as uvicorn checks it, ``_header_lines``); a stream's head (no
  length: chunked) is built the same way, and its body chunks, once the head is out, are framed
  and written here. Anything else (a HEAD request, a header uvicorn reads, the access log, a
  client not reading: uvicorn's write flow control waits for it) takes uvicorn's path.
* The client leaving is a future in the scope (``router.types.CLIENT_GONE``), resolved when
  uvicorn marks the cycle disconnected, so that a request needs no task of its own blocked in
  ``receive()`` to notice it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable
from types import MappingProxyType
from typing import Any

from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    RequestResponseCycle,
)

from router.types import CLIENT_GONE, WHOLE_RESPONSE

__all__ = ["LeanCycle", "lean_cycle"]

_EXTENSIONS: MappingProxyType[str, object] = MappingProxyType(
    {WHOLE_RESPONSE: MappingProxyType({})}
)


class _Capture:
    """Stands in for the transport while uvicorn writes a head: keeps the bytes."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


class _Prefixed:
    """Stands in for the transport while uvicorn writes the first body bytes: the held head
    goes first, in the same write."""

    __slots__ = ("_head", "_transport")

    def __init__(self, transport: Any, head: bytes) -> None:
        self._transport = transport
        self._head = head

    def write(self, data: bytes) -> None:
        head, self._head = self._head, b""
        self._transport.write(head + data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def flush(self) -> None:
        if self._head:
            self._transport.write(self._head)
            self._head = b""

    @property
    def head(self) -> bytes:
        """The head, if no body bytes were written to carry it."""
        return self._head


class LeanCycle(RequestResponseCycle):
    """uvicorn's request/response cycle, its response head written with the first body, the
    client leaving a future in its scope."""

    _held: bytes = b""

    @property
    def disconnected(self) -> bool:
        return bool(self.__dict__.get("disconnected", False))

    @disconnected.setter
    def disconnected(self, value: bool) -> None:
        self.__dict__["disconnected"] = value
        scope: dict[str, Any] = self.scope  # type: ignore[assignment]
        gone: asyncio.Future[None] | None = scope.get(CLIENT_GONE)
        if value and gone is not None and not gone.done():
            gone.set_result(None)

    async def send(self, message: Any) -> None:
        kind = message["type"]
        if kind == WHOLE_RESPONSE:
            if not self._respond_whole(message):
                await self._whole_as_asgi(message)
            return
        if kind == "http.response.body" and self._write_chunk(message):
            return
        if self.response_started or kind != "http.response.start":
            held = self._held
            if not held:
                await super().send(message)
                return
            transport = self.transport
            prefixed = _Prefixed(transport, held)
            self.transport = prefixed  # type: ignore[assignment]
            try:
                await super().send(message)
            finally:
                self.transport = transport
                # no body bytes yet (an empty chunk): still held; none to come (HEAD): sent now
                if self.response_complete:
                    prefixed.flush()
                self._held = prefixed.head
            return
        head = self._stream_head(message)
        if head is not None:
            self._held = head
            return
        transport, capture = self.transport, _Capture()
        self.transport = capture  # type: ignore[assignment]
        try:
            await super().send(message)
        finally:
            self.transport = transport
        self._held = capture.data

    def _stream_head(self, message: Any) -> bytes | None:
        """A stream's head (``http.response.start`` with no length: chunked), built as uvicorn
        builds it (``_header_lines``), without its general path; None: uvicorn's path must take
        it (a HEAD request, a status without a body, the access log, a header it reads)."""
        status = message["status"]
        status_line = STATUS_LINE.get(status)
        if (
            status_line is None
            or status in (204, 304)
            or self.access_log
            or self.scope["method"] == "HEAD"
            or self.flow.write_paused
            or self.disconnected
        ):
            return None
        parts = self._head(status_line, message.get("headers", ()))
        if parts is None:
            return None
        self.response_started = True
        self.waiting_for_100_continue = False
        self.chunked_encoding = True
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"transfer-encoding: chunked\r\n\r\n")
        return b"".join(parts)

    def _head(
        self, status_line: bytes, headers: Iterable[tuple[bytes, bytes]]
    ) -> list[bytes] | None:
        """A head's parts: the status line, uvicorn's own headers, then ``headers``
        (``_header_lines``); None: uvicorn's path must take them."""
        parts = [status_line]
        for name, value in self.default_headers:  # uvicorn's own: checked by uvicorn
            parts += (name, b": ", value, b"\r\n")
        return parts if _header_lines(parts, headers) else None

    def _write_chunk(self, message: Any) -> bool:
        """A stream's body chunk after its head went out, framed and written here; False:
        uvicorn's path must take it (the head still held, the end of the body, the client
        not reading or gone)."""
        if (
            self._held
            or not self.chunked_encoding  # (None before the head, False with a length or HEAD)
            or self.response_complete
            or self.flow.write_paused
            or self.disconnected
            or not message.get("more_body", False)
        ):
            return False
        body = message.get("body", b"")
        if body:
            self.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True

    def _respond_whole(self, message: Any) -> bool:
        """``WHOLE_RESPONSE``: the head and the body in one write, the response then complete as
        uvicorn completes one; False: uvicorn's path must take it."""
        if self.response_started or self.flow.write_paused or self.scope["method"] == "HEAD":
            return False
        if self.disconnected:
            return True  # (as uvicorn's send: nobody to answer)
        status, body = message["status"], message["body"]
        status_line = STATUS_LINE.get(status)
        if status_line is None:
            return False
        parts = self._head(status_line, message["headers"])
        if parts is None:
            return False  # uvicorn's path: its handling of such headers, its error
        parts.append(b"content-length: %d\r\n" % len(body))
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts += (b"\r\n", body)
        self.response_started = True
        self.waiting_for_100_continue = False
        self.transport.write(b"".join(parts))
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        self.on_response()
        return True

    async def _whole_as_asgi(self, message: Any) -> None:
        body = message["body"]
        headers = [*message["headers"], (b"content-length", b"%d" % len(body))]
        start = {"type": "http.response.start", "status": message["status"], "headers": headers}
        await self.send(start)
        await self.send({"type": "http.response.body", "body": body, "more_body": False})


_READ_BY_UVICORN = frozenset({b"content-length", b"transfer-encoding", b"connection"})
_NAMES_KEPT = 256  # header names whose check is remembered (a router answers with a dozen)


@functools.lru_cache(maxsize=_NAMES_KEPT)
def _name_passes(name: bytes) -> bool:
    """Whether a header ``name`` may go out here: not one uvicorn reads (``_READ_BY_UVICORN``)
    and nothing ``HEADER_RE`` finds in it. Remembered: a response's names are the same few on
    every request."""
    return name not in _READ_BY_UVICORN and not HEADER_RE.search(name)


def _header_lines(parts: list[bytes], headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Add ``headers`` to a head's ``parts`` (``name``, ``: ``, ``value``, CRLF each), each
    checked as uvicorn checks it (``HEADER_RE`` on the name, ``HEADER_VALUE_RE`` on the
    value); False, ``parts`` then unusable, when one fails or is one uvicorn reads
    (``_READ_BY_UVICORN``): its path must take them, with its handling and its errors. Names
    go out as given (uvicorn lower-cases them; the router's are lower case). A name's check is
    remembered (``_name_passes``), and letters-and-digits values (ids, counts: nothing
    ``HEADER_VALUE_RE`` finds) pass without the expression (0.37 against ~0.1 µs a header)."""
    for name, value in headers:
        if not _name_passes(name) or (not value.isalnum() and HEADER_VALUE_RE.search(value)):
            return False
        parts += (name, b": ", value, b"\r\n")
    return True


def lean_cycle(cycle: RequestResponseCycle | None, loop: asyncio.AbstractEventLoop) -> None:
    """Make uvicorn's new cycle (None after an upgrade request) a ``LeanCycle``."""
    if cycle is not None and type(cycle) is RequestResponseCycle:
        gone = loop.create_future()
        scope: dict[str, Any] = cycle.scope  # type: ignore[assignment]
        scope[CLIENT_GONE] = gone
        extensions = scope.get("extensions")
        scope["extensions"] = {**extensions, **_EXTENSIONS} if extensions else _EXTENSIONS
        if cycle.disconnected:
            gone.set_result(None)
        cycle.__class__ = LeanCycle
