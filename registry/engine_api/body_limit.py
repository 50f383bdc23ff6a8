"""``BodyLimit``: a bootstrap request body is read only up to ``limit`` bytes (413 beyond).

A declared ``Content-Length`` over the limit is refused before any byte is read; a body sent
without one (chunked) is counted as it arrives and refused once it passes the limit: whoever
reads it (FastAPI's body parsing, a route's ``request.body()``) gets ``HTTPException(413)``,
which the hosting app renders (``http_errors.on_http_error``). Should nothing render it (the
exception leaves the app before a response started), the middleware answers the 413 itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.exceptions import HTTPException

from registry.engine_api.http_errors import error_json

__all__ = ["BodyLimit", "BodyTooLarge"]

ASGIApp = Callable[..., Any]


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int, declared: int | None = None) -> None:
        size = "request body" if declared is None else f"request body of {declared} bytes"
        super().__init__(413, f"{size} exceeds the {limit}-byte limit (--max-body-bytes)")


def _declared_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit():
            return int(value)
    return None


class BodyLimit:
    """ASGI middleware bounding request bodies of the paths ``applies_to`` accepts."""

    def __init__(
        self, app: ASGIApp, limit: int, applies_to: Callable[[str], bool] = lambda path: True
    ) -> None:
        if limit < 1:
            raise ValueError(f"body limit must be >= 1 byte, got {limit}")
        self._app = app
        self._limit = limit
        self._applies_to = applies_to

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self._applies_to(scope["path"]):
            await self._app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self._limit:
            too_large = BodyTooLarge(self._limit, declared)
            await error_json(413, str(too_large.detail))(scope, receive, send)
            return
        received = 0
        started = False

        async def bounded_receive() -> dict[str, Any]:
            nonlocal received
            message: dict[str, Any] = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self._limit:
                    raise BodyTooLarge(self._limit)
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._app(scope, bounded_receive, tracking_send)
        except BodyTooLarge as exc:
            if started:
                raise
            await error_json(413, str(exc.detail))(scope, receive, send)
