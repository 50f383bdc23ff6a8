"""The store of a standalone registry process (``http(s)://host:port[/path]``), over ``/store``.

``registry serve --store URL`` serves its store at ``/store`` (``registry/store_api.py``); a router
started with ``--registry http://host:port`` keeps its workers there instead of in etcd. The URL's
path, if any, is where the registry is mounted (behind a reverse proxy, say).

Auth: the ``/store`` API sits behind the registry's admin auth. ``HttpStore(url, token=...)``
sends a bearer token (``open_store(url, token=...)``, the router's ``--registry-token``);
``from_url`` sends none, since a token in the URL was rejected for etcd. Without a token the
registry only answers loopback clients.

Semantics beyond ``RegistryStore``'s contract:
* Every call runs under one deadline (``timeout``, default 2 s). Any transport error, deadline
  overrun, unexpected status (401/403 included), or malformed reply becomes
  ``RegistryUnavailable``, as does a 404 from a server without the ``/store`` routes.
* ``watch()`` must be called with an event loop running. It starts connecting at once (a task of
  this store), and the registry reports the watch established on a ``ready`` line; what it covers
  from then on is the registry's own store's promise (``memory://``: every later change). Unlike
  the in-process stores, the watch is not established when ``watch()`` returns. Instead, this
  store's next call of any other kind waits (up to ``timeout``) until every watch opened before it
  is established or has failed, so changes made through this store after ``watch()`` are never
  missed, and watch-then-list leaves no gap. A change made by another client between ``watch()``
  and that point may be missed.
* A watch that cannot be established within ``timeout``, or whose stream breaks, ends, or stays
  silent for ``idle_timeout`` (default 15 s, three of the registry's 5 s keepalives), raises
  ``RegistryUnavailable`` from the iterator. Each watch holds one HTTP connection; ``aclose()`` of
  the iterator, or dropping it unstarted, closes that connection.
* After ``close()``, open watches end, new watches end at once, and every other call raises
  ``RegistryUnavailable``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast
from urllib.parse import quote, urlsplit

import httpx

from registry.backends.base import WatchEvent
from registry.errors import ConfigurationError, RegistryUnavailable

__all__ = ["CALL_TIMEOUT_S", "IDLE_TIMEOUT_S", "HttpStore", "parse_http_url"]

CALL_TIMEOUT_S = 2.0
IDLE_TIMEOUT_S = 15.0  # three of registry.store_api.KEEPALIVE_S
_MISSING_HEADER = "x-store-missing"  # registry.store_api.MISSING_HEADER

_Item = WatchEvent | RegistryUnavailable | None  # None: the watch ends without an error
_MALFORMED = (ValueError, TypeError, KeyError, AttributeError, binascii.Error)
T = TypeVar("T")


def parse_http_url(url: str) -> str:
    """``http(s)://host[:port][/path]`` → the base URL (no trailing ``/``); raises
    ``ConfigurationError``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ConfigurationError(f"not an http(s):// URL (scheme {parts.scheme!r})")
    if "@" in parts.netloc:
        raise ConfigurationError(f"{parts.scheme}:// store URLs with credentials are not supported")
    if parts.query or parts.fragment:
        raise ConfigurationError(f"{parts.scheme}:// store URLs take no query or fragment")
    if not parts.hostname:
        raise ConfigurationError(f"{parts.scheme}:// store URL has no host")
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError as exc:
        raise ConfigurationError(f"{parts.scheme}:// store URL has a bad port: {exc}") from exc
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def _key_path(key: str) -> str:
    """``key`` as a URL path; ``.`` and ``..`` segments escaped so nothing normalises them away."""
    segments = (
        quote(s, safe="") if s not in (".", "..") else s.replace(".", "%2E") for s in key.split("/")
    )
    return "/".join(segments)


def _event(message: dict[str, Any]) -> WatchEvent:
    kind, value = message["kind"], message["value"]
    if kind not in ("put", "delete") or not isinstance(message["key"], str):
        raise ValueError(f"not a watch event: {message!r}")
    raw = None if value is None else base64.b64decode(value, validate=True)
    return WatchEvent(kind, message["key"], raw, int(message["revision"]))


@dataclass(eq=False, slots=True)
class _Feed:
    """One watch: a task reads the stream into ``queue``; ``ready`` resolves once it is
    established or has failed."""

    ready: asyncio.Future[None]
    queue: asyncio.Queue[_Item] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None

    def settle(self) -> None:
        if not self.ready.done():
            self.ready.set_result(None)


class HttpStore:
    """A ``RegistryStore`` in a registry process; every instance has its own connection pool."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = CALL_TIMEOUT_S,
        idle_timeout: float = IDLE_TIMEOUT_S,
    ) -> None:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        self._client = httpx.AsyncClient(
            base_url=base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=8),
        )
        self._base_url = base_url
        self._timeout = timeout
        self._stream_timeout = httpx.Timeout(timeout, read=idle_timeout)
        self._idle_timeout = idle_timeout
        self._feeds: set[_Feed] = set()
        self._registering: set[asyncio.Future[None]] = set()
        self._closed = False

    @classmethod
    def from_url(cls, url: str) -> HttpStore:
        return cls(parse_http_url(url))

    async def put(self, key: str, value: bytes, *, ttl: float | None = None) -> None:
        if ttl is not None and ttl <= 0:
            raise ValueError(f"ttl must be positive, got {ttl!r}")
        params = {} if ttl is None else {"ttl": repr(float(ttl))}
        path = f"/store/keys/{_key_path(key)}"
        await self._call("put", "PUT", path, (204,), content=value, params=params)

    async def refresh(self, key: str) -> bool:
        reply = await self._call("refresh", "POST", f"/store/refresh/{_key_path(key)}")
        return self._decode("refresh", lambda: bool(reply.json()["alive"]))

    async def get(self, key: str) -> bytes | None:
        reply = await self._call("get", "GET", f"/store/keys/{_key_path(key)}", (200, 404))
        if reply.status_code == 200:
            return reply.content
        if reply.headers.get(_MISSING_HEADER) == "1":
            return None
        raise RegistryUnavailable(f"registry get: {self._base_url} has no /store API (HTTP 404)")

    async def list(self, prefix: str) -> dict[str, bytes]:
        reply = await self._call("list", "GET", "/store/list", params={"prefix": prefix})

        def decode() -> dict[str, bytes]:
            values: dict[str, str] = reply.json()
            return {k: base64.b64decode(v, validate=True) for k, v in values.items()}

        return self._decode("list", decode)

    async def delete(self, key: str) -> bool:
        reply = await self._call("delete", "DELETE", f"/store/keys/{_key_path(key)}")
        return self._decode("delete", lambda: bool(reply.json()["deleted"]))

    def watch(self, prefix: str) -> AsyncGenerator[WatchEvent, None]:
        """Changes under ``prefix``; connects at once (see the module doc)."""
        feed = _Feed(asyncio.get_running_loop().create_future())
        if self._closed:
            feed.settle()
            feed.queue.put_nowait(None)
            return self._iterate(feed)
        feed.task = asyncio.create_task(self._pump(prefix, feed), name="http-store-watch")
        self._feeds.add(feed)
        feed.task.add_done_callback(lambda _: self._feeds.discard(feed))
        self._registering.add(feed.ready)
        feed.ready.add_done_callback(self._registering.discard)
        events = self._iterate(feed)
        # An iterator closed or dropped before its first step never runs its finally block.
        finalizer = weakref.finalize(events, feed.task.cancel)
        finalizer.atexit = False
        return events

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = [feed.task for feed in self._feeds if feed.task is not None]
        for feed in list(self._feeds):
            feed.queue.put_nowait(None)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        try:
            async with asyncio.timeout(self._timeout):
                await self._client.aclose()
        except (TimeoutError, httpx.HTTPError) as exc:
            raise RegistryUnavailable(f"registry store close failed: {exc!r}") from exc

    async def _call(
        self,
        op: str,
        method: str,
        path: str,
        ok: tuple[int, ...] = (200,),
        **kwargs: Any,
    ) -> httpx.Response:
        """One request under one deadline; every failure becomes ``RegistryUnavailable``."""
        if self._closed:
            raise RegistryUnavailable("http store is closed")
        await self._settle()
        try:
            async with asyncio.timeout(self._timeout):
                reply = await self._client.request(method, path, **kwargs)
        except TimeoutError as exc:
            raise RegistryUnavailable(f"registry {op}: no reply within {self._timeout}s") from exc
        except httpx.HTTPError as exc:
            raise RegistryUnavailable(f"registry {op} failed: {exc!r}") from exc
        if reply.status_code not in ok:
            raise RegistryUnavailable(
                f"registry {op}: HTTP {reply.status_code} from {self._base_url}: {reply.text[:200]}"
            )
        return reply

    async def _settle(self) -> None:
        """Wait until every watch opened so far is established or has failed."""
        if self._registering:
            await asyncio.wait(list(self._registering), timeout=self._timeout)

    def _decode(self, op: str, decode: Callable[[], T]) -> T:
        try:
            return decode()
        except _MALFORMED as exc:
            raise RegistryUnavailable(f"registry {op}: malformed reply: {exc!r}") from exc

    async def _iterate(self, feed: _Feed) -> AsyncGenerator[WatchEvent, None]:
        try:
            while (item := await feed.queue.get()) is not None:
                if isinstance(item, RegistryUnavailable):
                    if self._closed:
                        return
                    raise item
                yield item
        finally:
            if feed.task is not None:
                feed.task.cancel()  # no await: the task closes its stream on its own

    async def _pump(self, prefix: str, feed: _Feed) -> None:
        """Read the watch stream into the feed; every failure ends it as ``RegistryUnavailable``."""
        try:
            await self._stream(prefix, feed)
        except RegistryUnavailable as exc:
            feed.queue.put_nowait(exc)
        except TimeoutError:
            feed.queue.put_nowait(
                RegistryUnavailable(f"registry watch: not established within {self._timeout}s")
            )
        except httpx.ReadTimeout:
            feed.queue.put_nowait(
                RegistryUnavailable(f"registry watch: no data for {self._idle_timeout}s")
            )
        except httpx.HTTPError as exc:
            feed.queue.put_nowait(RegistryUnavailable(f"registry watch broke: {exc!r}"))
        except _MALFORMED as exc:
            feed.queue.put_nowait(RegistryUnavailable(f"registry watch: malformed line: {exc!r}"))
        finally:
            feed.settle()

    async def _stream(self, prefix: str, feed: _Feed) -> None:
        request = self._client.build_request(
            "GET", "/store/watch", params={"prefix": prefix}, timeout=self._stream_timeout
        )
        async with asyncio.timeout(self._timeout) as deadline:
            reply = await self._client.send(request, stream=True)
            lines = cast("AsyncGenerator[str, None]", reply.aiter_lines())
            try:
                await self._expect_ready(reply, lines)
                feed.settle()
                deadline.reschedule(None)
                async for line in lines:
                    self._take(line, feed)
            finally:
                await lines.aclose()
                await reply.aclose()
        raise RegistryUnavailable("registry watch stream ended")

    async def _expect_ready(self, reply: httpx.Response, lines: AsyncIterator[str]) -> None:
        if reply.status_code != 200:
            await reply.aread()
            raise RegistryUnavailable(
                f"registry watch: HTTP {reply.status_code} from {self._base_url}: "
                f"{reply.text[:200]}"
            )
        line = await anext(lines, None)
        if line is None:
            raise RegistryUnavailable("registry watch stream ended before it was established")
        if json.loads(line).get("kind") != "ready":
            raise ValueError(f"expected a ready line first, got {line[:200]!r}")

    def _take(self, line: str, feed: _Feed) -> None:
        if not line:
            return
        message = json.loads(line)
        kind = message.get("kind")
        if kind in ("put", "delete"):
            feed.queue.put_nowait(_event(message))
        elif kind == "error":
            raise RegistryUnavailable(f"registry watch: {message.get('message')}")
        # "keepalive" (and kinds from newer registries) only reset the idle timeout
