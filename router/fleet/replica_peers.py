"""Where a router replica's peers come from (``router.fleet.replica_sync`` follows them): the
static ``--replica-peer`` list, the addresses ``--replica-peers-dns`` resolves to (a Kubernetes
headless Service), and the replicas registered in the router's shared registry
(``--replica-peers-registry``: etcd or a ``registry serve``).

In the registry each replica keeps one key, ``replicas/<id>``, holding its ``--replica-listen``
address under a lease (``registry.ttl_s``), refreshed every third of it; a replica that stops
deletes its key, one that dies loses it when the lease runs out. Each source is looked at again
every ``dns_interval_s``; a source that fails (a name that does not resolve, the registry
unreachable) keeps the peers it last found and says why in the log once per failure streak.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable

from registry.backends import RegistryStore
from registry.errors import RegistryError
from router.settings.replicas import ReplicaSettings, split_address
from router.workers import format_host

__all__ = ["REPLICAS_PREFIX", "ReplicaPeers"]

logger = logging.getLogger(__name__)

REPLICAS_PREFIX = "replicas/"
_DELETE_TIMEOUT_S = 2.0


class ReplicaPeers:
    """Finds the peers and hands every change to ``follow`` (``ReplicaSync.set_peers``)."""

    def __init__(
        self,
        settings: ReplicaSettings,
        follow: Callable[[Iterable[str]], None],
        store: RegistryStore | None = None,
        ttl_s: float = 10.0,
        *,
        register: bool = True,
    ) -> None:
        self._settings = settings
        # whether this process keeps the replica's key (router --workers N: process 0 alone)
        self._register = register
        self._follow = follow
        self._store = store
        self._ttl_s = ttl_s
        self._found: dict[str, set[str]] = {}  # source -> the addresses it found last
        self._failing: dict[str, bool] = {}

    async def run(self) -> None:
        """Look at every source until cancelled (the registry key deleted on the way out)."""
        loops = []
        interval = self._settings.dns_interval_s
        if self._settings.peers_dns is not None:
            loops.append(self._every_interval("dns", self._resolve, interval))
        if self._settings.peers_registry and self._store is not None:
            lease = min(interval, self._ttl_s / 3)  # (the key is kept alive in the same step)
            loops.append(self._every_interval("registry", self._registered, lease))
        try:
            await asyncio.gather(*loops)
        finally:
            if self._settings.peers_registry and self._store is not None and self._register:
                await self._unregister(self._store)

    async def _every_interval(
        self, source: str, find: Callable[[], Awaitable[set[str]]], interval_s: float
    ) -> None:
        while True:
            try:
                found = await find()
            except (OSError, RegistryError, ValueError) as exc:
                if not self._failing.get(source):
                    logger.warning("replica peers: the %s source failed: %s", source, exc)
                self._failing[source] = True
            else:
                self._failing[source] = False
                self._take(source, found)
            await asyncio.sleep(interval_s)

    def _take(self, source: str, found: set[str]) -> None:
        if self._found.get(source) == found:
            return
        self._found[source] = found
        self._follow({*self._settings.peers, *(a for f in self._found.values() for a in f)})

    async def _resolve(self) -> set[str]:
        """The addresses ``--replica-peers-dns`` resolves to."""
        assert self._settings.peers_dns is not None
        host, port = split_address(self._settings.peers_dns)
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return {f"{format_host(str(info[4][0]))}:{port}" for info in infos}

    async def _registered(self) -> set[str]:
        """This replica's key kept alive (by the process that registers); every replica's
        address registered."""
        store, settings = self._store, self._settings
        assert store is not None and settings.listen is not None
        key = REPLICAS_PREFIX + settings.id
        if self._register and not await store.refresh(key):
            value = json.dumps({"address": settings.listen}).encode()
            await store.put(key, value, ttl=self._ttl_s)
        found = set()
        for name, value in (await store.list(REPLICAS_PREFIX)).items():
            try:
                address = json.loads(value)["address"]
                split_address(address)
            except (ValueError, KeyError, TypeError):
                logger.warning("replica peers: %s in the registry is not an address", name)
                continue
            found.add(address)
        return found

    async def _unregister(self, store: RegistryStore) -> None:
        with contextlib.suppress(RegistryError, OSError, TimeoutError):
            async with asyncio.timeout(_DELETE_TIMEOUT_S):
                await store.delete(REPLICAS_PREFIX + self._settings.id)
