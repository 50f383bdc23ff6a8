"""uvicorn's request/response cycle, leaner on the hot path.

* Fewer writes per response: the status line and headers go out with the first body bytes.
  uvicorn writes a response's head as soon as the application sends ``http.response.start`` and
each body message as it comes: two socket writes (two system calls, each one the kernel's
loopback delivery too) for a whole answer, one more than needed. ``LeanCycle`` keeps the
  head uvicorn built (with all of uvicorn's checks) and writes it together with the next body
  message. This router sends the first body message right after the start, always (a relay
  starts its response only once the first chunk is in hand), so no head waits for anything.
* The client leaving is a future in the scope (``router.types.CLIENT_GONE``), resolved when
  uvicorn marks the cycle disconnected, so that a request needs no task of its own blocked in
  ``receive()`` to notice it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from router.types import CLIENT_GONE

__all__ = ["LeanCycle", "lean_cycle"]


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


def lean_cycle(cycle: RequestResponseCycle | None, loop: asyncio.AbstractEventLoop) -> None:
    """Make uvicorn's new cycle (None after an upgrade request) a ``LeanCycle``."""
    if cycle is not None and type(cycle) is RequestResponseCycle:
        gone = loop.create_future()
        scope: dict[str, Any] = cycle.scope  # type: ignore[assignment]
        scope[CLIENT_GONE] = gone
        if cycle.disconnected:
            gone.set_result(None)
        cycle.__class__ = LeanCycle
