"""etcd store (``etcd://host[:port][/prefix]``) on aetcd, the asyncio etcd v3 client.

aetcd is an optional dependency, imported when a store is built: ``import registry`` works without
it, and building an ``EtcdStore`` without it raises ``ConfigurationError``.

Semantics beyond ``RegistryStore``'s contract:
* Keys live under the URL's path (default ``/pdr``): key ``k`` is etcd key ``/pdr/k``.
* Each ``put`` with a ttl grants a new lease of ``ceil(ttl)`` seconds (etcd leases are whole
  seconds, and etcd raises a ttl below its minimum, 2 s with default server timing, to that
  minimum) and revokes the key's previous lease, if any; a ``put`` without ttl revokes it too.
  ``refresh`` reads the key's lease and sends one keepalive. Expiry is etcd's job: the key of an
  expired lease is gone for every client, and watchers see its delete (etcd checks leases every
  500 ms).
* A watch replays from etcd's history, so it misses nothing between ``watch()`` and the stream's
  creation (its first ``__anext__``): it covers every change above the newest revision this store
  had seen (in any reply or event) when ``watch()`` was called. A store that had seen none yet
  starts at the first revision it sees afterwards (inclusive), or, having seen none when the
  stream is created, from then on. So list-then-watch and watch-then-list both leave no gap; the
  latter may replay changes the list already showed, in order, which ends in the same state.
* A reply whose revision is below the newest one seen means a new or restored etcd (revisions
  never go back in one cluster's history): the store logs it once and starts over from that
  revision, so watches opened from then on (or opened before and not yet started) see the new
  cluster's changes instead of waiting for its revision to pass the old one.
* Every call runs under one deadline (``timeout``, default 2 s); any aetcd or gRPC error and any
  deadline overrun becomes ``RegistryUnavailable``, as does a watch stream that breaks, including
  one on a connection that stops answering keepalive pings (after ``keepalive`` s idle, default
  10 s, plus half that). After ``close()``, open watches end and every other call raises
  ``RegistryUnavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

from registry.backends.base import WatchEvent
from registry.errors import ConfigurationError, RegistryUnavailable

__all__ = [
    "CALL_TIMEOUT_S",
    "DEFAULT_PORT",
    "DEFAULT_PREFIX",
    "KEEPALIVE_S",
    "EtcdStore",
    "channel_options",
    "load_aetcd",
    "parse_etcd_url",
]

logger = logging.getLogger(__name__)

DEFAULT_PORT = 2379
DEFAULT_PREFIX = "/pdr"
CALL_TIMEOUT_S = 2.0

KEEPALIVE_S = 10.0


def channel_options(keepalive_s: float = KEEPALIVE_S) -> dict[str, int]:
    """gRPC channel settings: reconnect fast, and notice a silently dead etcd under a watch.

    gRPC's reconnect backoff starts at 1 s and grows to 120 s; ours stays within 0.2-2 s. An idle
    watch stream sees nothing when etcd hangs or the network drops packets, so the channel pings
    after ``keepalive_s`` without traffic and drops the connection when a ping goes unanswered for
    half that (the ping timeout must be set too: gRPC's default, 60 s, overrides the keepalive
    timeout). etcd accepts pings on an open stream every 5 s or more (its
    ``--grpc-keepalive-min-time``).
    """
    keepalive_ms = round(keepalive_s * 1000)
    return {
        "grpc.initial_reconnect_backoff_ms": 200,
        "grpc.min_reconnect_backoff_ms": 200,
        "grpc.max_reconnect_backoff_ms": 2000,
        "grpc.keepalive_time_ms": keepalive_ms,
        "grpc.keepalive_timeout_ms": keepalive_ms // 2,
        "grpc.http2.ping_timeout_ms": keepalive_ms // 2,
        "grpc.http2.max_pings_without_data": 0,
    }


def load_aetcd() -> ModuleType:
    """Import aetcd, or raise ``ConfigurationError`` saying how to install it."""
    try:
        import aetcd  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ConfigurationError(
            "etcd:// registry stores need the aetcd package: pip install aetcd "
            "(scripts/setup.sh installs it)"
        ) from exc
    module: ModuleType = aetcd
    return module


def parse_etcd_url(url: str) -> tuple[str, int, str]:
    """``etcd://host[:port][/prefix]`` → (host, port, prefix); raises ``ConfigurationError``."""
    parts = urlsplit(url)
    if parts.scheme != "etcd":
        raise ConfigurationError(f"not an etcd:// URL (scheme {parts.scheme!r})")
    if "," in parts.netloc:
        raise ConfigurationError("etcd:// takes one endpoint (a member or a load balancer)")
    if "@" in parts.netloc:
        raise ConfigurationError("etcd:// URLs with credentials are not supported")
    if parts.query or parts.fragment:
        raise ConfigurationError("etcd:// URLs take no query or fragment")
    if not parts.hostname:
        raise ConfigurationError("etcd:// URL has no host: expected etcd://host[:port][/prefix]")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError as exc:
        raise ConfigurationError(f"etcd:// URL has a bad port: {exc}") from exc
    return parts.hostname, port, parts.path.rstrip("/") or DEFAULT_PREFIX


def _grpc_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # aetcd builds the target as f"{host}:{port}"


class EtcdStore:
    """A ``RegistryStore`` on one etcd endpoint; every instance has its own connection."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        *,
        prefix: str = DEFAULT_PREFIX,
        timeout: float = CALL_TIMEOUT_S,
        keepalive: float = KEEPALIVE_S,
    ) -> None:
        self._aetcd = load_aetcd()
        self._base = prefix.rstrip("/") + "/"
        self._timeout = timeout
        self._client: Any = self._aetcd.Client(
            host=_grpc_host(host), port=port, timeout=timeout, options=channel_options(keepalive)
        )
        self._errors: tuple[type[BaseException], ...] = (
            self._aetcd.ClientError,
            self._aetcd.rpc.RpcError,
            self._aetcd.rpc.BaseError,
        )
        self._errors_or_timeout = (TimeoutError, *self._errors)
        self._revision = 0  # the newest revision seen in any reply or event
        self._first_revision = 0  # the first one seen
        self._history = 0  # bumped when the revision went back: a new or restored etcd
        self._history_start = 0  # the revision that showed the current history
        self._closed = False

    @classmethod
    def from_url(cls, url: str) -> EtcdStore:
        host, port, prefix = parse_etcd_url(url)
        return cls(host, port, prefix=prefix)

    async def put(self, key: str, value: bytes, *, ttl: float | None = None) -> None:
        if ttl is not None and ttl <= 0:
            raise ValueError(f"ttl must be positive, got {ttl!r}")
        async with self._guard("put"):
            lease_id = 0 if ttl is None else await self._grant(ttl)
            reply = await self._client.put(self._full(key), value, lease=lease_id, prev_kv=True)
            self._observe_reply(reply.header.revision)
            old_lease = int(reply.prev_kv.lease) if reply.prev_kv is not None else 0
            if old_lease and old_lease != lease_id:
                await self._revoke(old_lease)

    async def refresh(self, key: str) -> bool:
        async with self._guard("refresh"):
            kv = await self._get_kv(self._full(key))
            if kv is None or not kv.lease:
                return False
            reply = await self._client.refresh_lease(kv.lease)
            return reply is not None and int(reply.TTL) > 0

    async def get(self, key: str) -> bytes | None:
        async with self._guard("get"):
            kv = await self._get_kv(self._full(key))
        return None if kv is None else bytes(kv.value)

    async def list(self, prefix: str) -> dict[str, bytes]:
        async with self._guard("list"):
            reply = await self._client.get_prefix(self._full(prefix))
        self._observe_reply(reply.header.revision)
        return {self._relative(kv.key): bytes(kv.value) for kv in reply}

    async def delete(self, key: str) -> bool:
        full = self._full(key)
        async with self._guard("delete"):
            reply = await self._client.delete_range(full, full + b"\0")
        self._observe_reply(reply.header.revision)
        return int(reply.deleted) > 0

    def watch(self, prefix: str) -> AsyncGenerator[WatchEvent, None]:
        """Changes under ``prefix`` from the newest revision seen so far on (see the module doc)."""
        return self._watch(self._full(prefix), self._revision, self._history)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            async with asyncio.timeout(self._timeout):
                await self._client.close()
        except self._errors_or_timeout as exc:
            raise RegistryUnavailable(f"etcd close failed: {exc}") from exc

    async def _watch(
        self, full_prefix: bytes, seen: int, history: int
    ) -> AsyncGenerator[WatchEvent, None]:
        if history != self._history:  # a new etcd since watch(): its revisions start over
            seen = self._history_start
        handle = await self._open_watch(full_prefix, seen)
        if handle is None:
            return
        try:
            async for raw in handle:
                yield self._event(raw)
        except self._errors as exc:
            if not self._closed:
                raise RegistryUnavailable(f"etcd watch broke: {exc}") from exc
        finally:
            await self._cancel_watch(handle)
        if not self._closed:
            raise RegistryUnavailable("etcd watch stream ended")

    async def _open_watch(self, full_prefix: bytes, seen: int) -> Any:
        """aetcd's watch handle, or None when the store is (being) closed."""
        start = seen + 1 if seen else (self._first_revision or None)
        try:
            async with self._guard("watch"):
                return await self._client.watch_prefix(full_prefix, start_revision=start)
        except RegistryUnavailable:
            if self._closed:
                return None
            raise

    async def _cancel_watch(self, handle: Any) -> None:
        """Best effort: a broken stream has no server-side watch left to cancel."""
        if self._closed:
            return  # closing the client ended every watch
        try:
            async with asyncio.timeout(self._timeout):
                await handle.cancel()
        except self._errors_or_timeout as exc:
            logger.debug("etcd: cancelling a watch failed: %r", exc)

    @contextlib.asynccontextmanager
    async def _guard(self, op: str) -> AsyncIterator[None]:
        """One deadline for the whole operation; backend errors become RegistryUnavailable."""
        if self._closed:
            raise RegistryUnavailable("etcd store is closed")
        try:
            async with asyncio.timeout(self._timeout):
                yield
        except TimeoutError as exc:
            raise RegistryUnavailable(f"etcd {op}: no reply within {self._timeout}s") from exc
        except self._errors as exc:
            raise RegistryUnavailable(f"etcd {op} failed: {exc}") from exc

    async def _grant(self, ttl: float) -> int:
        lease = await self._client.lease(max(1, math.ceil(ttl)))
        return int(lease.id)

    async def _revoke(self, lease_id: int) -> None:
        """Revoke a lease the key no longer uses; one that already expired is fine."""
        try:
            await self._client.revoke_lease(lease_id)
        except self._aetcd.ClientError as exc:
            cause = exc.__cause__
            rpc = self._aetcd.rpc
            gone = isinstance(cause, rpc.AioRpcError) and cause.code() == rpc.StatusCode.NOT_FOUND
            if not gone:
                raise

    async def _get_kv(self, full: bytes) -> Any:
        # get_range, unlike get, returns the reply header (and its revision) for a missing key too.
        reply = await self._client.get_range(full, full + b"\0")
        self._observe_reply(reply.header.revision)
        return reply[0] if reply.count else None

    def _event(self, raw: Any) -> WatchEvent:
        revision = int(raw.kv.mod_revision)
        self._observe(revision)
        key = self._relative(raw.kv.key)
        if raw.kind == self._aetcd.EventKind.PUT:
            return WatchEvent("put", key, bytes(raw.kv.value), revision)
        return WatchEvent("delete", key, None, revision)

    def _observe(self, revision: int) -> None:
        self._revision = max(self._revision, int(revision))
        self._first_revision = self._first_revision or self._revision

    def _observe_reply(self, revision: int) -> None:
        """A reply header's revision is the cluster's current one: lower means a new etcd."""
        revision = int(revision)
        if revision < self._revision:
            logger.warning(
                "etcd revision went back from %d to %d: a new or restored cluster; following "
                "its history from there",
                self._revision,
                revision,
            )
            self._revision, self._history = revision, self._history + 1
            self._history_start = revision
        self._observe(revision)

    def _full(self, key: str) -> bytes:
        return (self._base + key).encode()

    def _relative(self, full: bytes) -> str:
        return full.decode()[len(self._base) :]
