"""The aiohttp implementation of the upstream seam (the default: least CPU per request)."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import AsyncIterator
from typing import NoReturn

import aiohttp

from router.settings import UpstreamSettings
from router.upstream.base import (
    DEFAULT_HEADERS,
    answer_limit,
    answer_too_large,
    refuse_invalid_status,
    transport_error,
)
from router.workers import Worker

__all__ = ["AiohttpUpstream", "raise_aiohttp_error"]

_RESET_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE})


def raise_aiohttp_error(exc: Exception, worker: Worker, *, before_answer: bool = False) -> NoReturn:
    """Translate an aiohttp failure into the router's tree (``before_answer``: no response
    header had come yet)."""
    raise transport_error(
        exc,
        worker,
        connect_failed=isinstance(
            exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError
        ),
        timed_out=isinstance(exc, asyncio.TimeoutError),
        stale=before_answer and _reset(exc),
    ) from exc


def _reset(exc: Exception) -> bool:
    """The engine closed or reset the connection (a pooled one it had closed when idle)."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and exc.errno in _RESET_ERRNOS


class _AiohttpResponse:
    __slots__ = ("_limit", "_response", "_worker", "content_type", "status")

    def __init__(
        self, response: aiohttp.ClientResponse, worker: Worker, settings: UpstreamSettings
    ) -> None:
        self._response = response
        self._worker = worker
        self._limit = answer_limit(response.status, settings)
        self.status = response.status
        self.content_type = response.headers.get("content-type", "application/json").encode()

    async def chunks(self) -> AsyncIterator[bytes]:
        content = self._response.content
        try:
            while True:
                data = await content.readany()
                if not data:
                    break
                yield data
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise_aiohttp_error(exc, self._worker)

    async def read(self) -> bytes:
        response = self._response
        try:
            length = response.content_length
            if length is not None and length <= self._limit:  # what engines send
                return await response.read()
            return await self._read_within_limit(length)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise_aiohttp_error(exc, self._worker)
        finally:
            response.release()

    async def _read_within_limit(self, length: int | None) -> bytes:
        """A body over the limit by its Content-Length, or without one: read piece by piece,
        and the connection closed as soon as it passes the limit."""
        if length is not None:
            self._response.close()
            raise answer_too_large(self._worker, self.status, self._limit, length)
        content = self._response.content
        chunks: list[bytes] = []
        size = 0
        while data := await content.readany():
            size += len(data)
            if size > self._limit:
                self._response.close()
                raise answer_too_large(self._worker, self.status, self._limit, None)
            chunks.append(data)
        return b"".join(chunks)

    def at_eof(self) -> bool:
        return self._response.content.at_eof()

    async def aclose(self) -> None:
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class AiohttpUpstream:
    """One ``aiohttp.ClientSession`` per worker with explicit timeouts and connection limits."""

    def __init__(self, worker: Worker, settings: UpstreamSettings) -> None:
        self.worker = worker
        self._url = worker.url
        self._settings = settings
        self._session: aiohttp.ClientSession | None = None

    def _open_session(self) -> aiohttp.ClientSession:
        s = self._settings
        connector = aiohttp.TCPConnector(
            limit=s.max_connections,
            limit_per_host=0,
            keepalive_timeout=s.keepalive_s,
            ttl_dns_cache=60,
        )
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=s.connect_timeout_s,
            sock_connect=s.connect_timeout_s,
            sock_read=s.read_timeout_s,
        )
        return aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            headers=DEFAULT_HEADERS,
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
        )

    @property
    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # created lazily: a session must be made inside the loop
            self._session = self._open_session()
        return self._session

    async def open(
        self, path: str, body: bytes, headers: dict[str, str], *, whole: bool = False
    ) -> _AiohttpResponse:
        try:
            response = await self._client.post(self._url + path, data=body, headers=headers)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise_aiohttp_error(exc, self.worker, before_answer=True)
        answer = _AiohttpResponse(response, self.worker, self._settings)
        await refuse_invalid_status(self.worker, answer)
        return answer

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
