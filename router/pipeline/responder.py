"""The client side of a response: start it, move bytes through unchanged, end it, or fail it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from router.errors import RouterError, error_body, sse_error_event
from router.types import WHOLE_RESPONSE, Send
from router.upstream.base import UpstreamResponse

__all__ = ["Responder"]

_JSON = b"application/json"
_SSE_BOUNDARY = b"\n\n"
_USAGE = b'"usage"'


class Responder:
    """Wraps ASGI ``send`` for one request and knows how far the response got.

    ``started``: the status line went out, so errors can only be reported in-band.
    ``complete``: the last body message went out. ``status``: the status sent (0: none yet);
    ``started_at``: ``time.monotonic()`` when it was sent. ``receipt_headers`` go out with it.
    ``whole_message``: the server takes a whole response as one ``WHOLE_RESPONSE`` message.
    ``anthropic``: errors in Anthropic's envelope (``/v1/messages``).
    """

    __slots__ = (
        "_at_boundary",
        "_extra_headers",
        "_send",
        "_whole_message",
        "anthropic",
        "complete",
        "receipt_headers",
        "sse",
        "started",
        "started_at",
        "status",
    )

    def __init__(
        self,
        send: Send,
        extra_headers: list[tuple[bytes, bytes]],
        *,
        whole_message: bool = False,
        anthropic: bool = False,
    ) -> None:
        self._send = send
        self._whole_message = whole_message
        self._extra_headers = extra_headers
        self.receipt_headers: list[tuple[bytes, bytes]] = []
        self.started = False
        self.complete = False
        self.sse = False
        self.status = 0
        self.started_at = 0.0
        self._at_boundary = True
        self.anthropic = anthropic

    def add_headers(self, headers: tuple[tuple[bytes, bytes], ...]) -> None:
        """More headers for the response, whatever its status (a tenant's ``x-ratelimit-*``)."""
        self._extra_headers = [*self._extra_headers, *headers]

    def _started(self, status: int) -> None:
        self.started = True
        self.status = status
        self.started_at = time.monotonic()

    async def start(self, status: int, content_type: bytes, *, sse: bool) -> None:
        self._started(status)
        self.sse = sse
        headers = [(b"content-type", content_type), *self._extra_headers, *self.receipt_headers]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def chunk(self, data: bytes) -> None:
        """Forward one upstream chunk as is."""
        self._at_boundary = data.endswith(_SSE_BOUNDARY)
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def relay(
        self, response: UpstreamResponse, chunks: AsyncIterator[bytes], chunk: bytes
    ) -> bytes:
        """Start an SSE response as ``response`` did and move its body through as it comes:
        ``chunk`` (read from ``chunks`` already), then the rest of ``chunks``. Returns the last
        chunk that mentions ``usage`` and the final one (where the usage is, when the client
        asked for it)."""
        await self.start(response.status, response.content_type, sse=True)
        usage = b""
        while chunk:
            if response.at_eof():  # the last chunk: send it with the end of the body
                break
            await self.chunk(chunk)
            if _USAGE in chunk:
                usage = chunk
            chunk = await anext(chunks, b"")
        await self.finish(chunk)
        return usage + chunk

    async def finish(self, data: bytes = b"") -> None:
        self.complete = True
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def whole(self, status: int, content_type: bytes, body: bytes) -> None:
        """A complete buffered response with its length."""
        self._started(status)
        self.complete = True
        if self._whole_message:
            headers = [(b"content-type", content_type), *self._extra_headers, *self.receipt_headers]
            message = {"type": WHOLE_RESPONSE, "status": status, "headers": headers, "body": body}
            await self._send(message)
            return
        headers = [
            (b"content-type", content_type),
            (b"content-length", str(len(body)).encode()),
            *self._extra_headers,
            *self.receipt_headers,
        ]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def fail(self, exc: RouterError) -> None:
        """Report ``exc``: an error JSON before the response started, a final SSE event after."""
        if self.complete:
            return
        if not self.started:
            if exc.headers:
                self.receipt_headers = [*self.receipt_headers, *exc.headers]
            await self.whole(exc.status, _JSON, error_body(exc, anthropic=self.anthropic))
            return
        if self.sse:
            prefix = b"" if self._at_boundary else _SSE_BOUNDARY
            await self.finish(prefix + sse_error_event(exc, anthropic=self.anthropic))
            return
        await self.finish()
