"""The httpx implementation of the upstream seam (on ``LeanPoolTransport``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import NoReturn

import httpx

from router.settings import UpstreamSettings
from router.upstream.base import (
    DEFAULT_HEADERS,
    NODELAY,
    answer_limit,
    answer_too_large,
    refuse_invalid_status,
    transport_error,
)
from router.upstream.lean_pool import LeanPoolTransport
from router.workers import Worker

__all__ = ["HttpxUpstream", "raise_httpx_error"]


def raise_httpx_error(exc: Exception, worker: Worker) -> NoReturn:
    """Translate a httpx failure into the router's tree."""
    raise transport_error(
        exc,
        worker,
        connect_failed=isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout),
        timed_out=isinstance(exc, httpx.TimeoutException),
    ) from exc


class _HttpxResponse:
    __slots__ = ("_limit", "_response", "_worker", "content_type", "status")

    def __init__(
        self, response: httpx.Response, worker: Worker, settings: UpstreamSettings
    ) -> None:
        self._response = response
        self._worker = worker
        self._limit = answer_limit(response.status_code, settings)
        self.status = response.status_code
        self.content_type = response.headers.get("content-type", "application/json").encode()

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise_httpx_error(exc, self._worker)

    async def read(self) -> bytes:
        response = self._response
        try:
            told = response.headers.get("content-length")
            length = int(told) if told is not None and told.isdigit() else None
            if length is not None and length <= self._limit:  # what engines send
                return await response.aread()
            return await self._read_within_limit(length)
        except httpx.HTTPError as exc:
            raise_httpx_error(exc, self._worker)
        finally:
            await response.aclose()  # closes the connection unless the body was read

    async def _read_within_limit(self, length: int | None) -> bytes:
        """A body over the limit by its Content-Length, or without one: read piece by piece,
        and given up (``read`` then closes the connection) as soon as it passes the limit."""
        if length is not None:
            raise answer_too_large(self._worker, self.status, self._limit, length)
        chunks: list[bytes] = []
        size = 0
        async for chunk in self._response.aiter_raw():
            size += len(chunk)
            if size > self._limit:
                raise answer_too_large(self._worker, self.status, self._limit, None)
            chunks.append(chunk)
        return b"".join(chunks)

    def at_eof(self) -> bool:
        return False  # httpx cannot tell before the iteration ends

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxUpstream:
    """One ``httpx.AsyncClient`` per worker with explicit timeouts and connection limits."""

    def __init__(self, worker: Worker, settings: UpstreamSettings) -> None:
        self.worker = worker
        self._settings = settings
        timeout = httpx.Timeout(
            connect=settings.connect_timeout_s,
            read=settings.read_timeout_s,
            write=settings.read_timeout_s,
            pool=settings.connect_timeout_s,
        )
        transport = LeanPoolTransport(
            max_connections=settings.max_connections,
            max_idle=settings.max_keepalive,
            keepalive_expiry=settings.keepalive_s,
            socket_options=NODELAY,
        )
        self._client = httpx.AsyncClient(
            base_url=worker.url, timeout=timeout, headers=DEFAULT_HEADERS, transport=transport
        )

    async def open(
        self, path: str, body: bytes, headers: dict[str, str], *, whole: bool = False
    ) -> _HttpxResponse:
        request = self._client.build_request("POST", path, content=body, headers=headers)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise_httpx_error(exc, self.worker)
        answer = _HttpxResponse(response, self.worker, self._settings)
        await refuse_invalid_status(self.worker, answer)
        return answer

    async def aclose(self) -> None:
        await self._client.aclose()
