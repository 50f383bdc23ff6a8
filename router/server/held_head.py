"""Fewer writes per response: the status line and headers go out with the first body bytes.

uvicorn writes a response's head as soon as the application sends ``http.response.start`` and
each body message as it comes: two socket writes (two system calls, each one the kernel's
loopback delivery too) for a whole answer, one more than needed. ``HeldHeadCycle`` keeps the
head uvicorn built (with all of uvicorn's checks) and writes it together with the next body
message. This router sends the first body message right after the start, always (a relay
starts its response only once the first chunk is in hand), so no head waits for anything.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

__all__ = ["HeldHeadCycle", "hold_head"]


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
        if self._head:
            self._transport.write(self._head)
            self._head = b""
        self._transport.close()


class HeldHeadCycle(RequestResponseCycle):
    """uvicorn's request/response cycle, its response head written with the first body."""

    _held: bytes = b""

    async def send(self, message: Any) -> None:
        if self.response_started or message["type"] != "http.response.start":
            held = self._held
            if not held:
                await super().send(message)
                return
            self._held = b""
            transport = self.transport
            self.transport = _Prefixed(transport, held)  # type: ignore[assignment]
            try:
                await super().send(message)
            finally:
                self.transport = transport
            return
        transport, capture = self.transport, _Capture()
        self.transport = capture  # type: ignore[assignment]
        try:
            await super().send(message)
        finally:
            self.transport = transport
        self._held = capture.data


def hold_head(cycle: RequestResponseCycle | None) -> None:
    """Make uvicorn's new cycle (None after an upgrade request) hold its response's head."""
    if cycle is not None and type(cycle) is RequestResponseCycle:
        cycle.__class__ = HeldHeadCycle
