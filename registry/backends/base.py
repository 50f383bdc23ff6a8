"""The store seam: a narrow async key-value interface with leases and prefix watches.

Three implementations honour this contract (``tests/registry/test_store_contract.py`` runs the
same suite against each): ``memory://`` (in-process), ``etcd://host:port[/prefix]`` (aetcd), and
``http://host:port`` (a ``registry serve`` process; when its watch is established differs, see
``registry/backends/http.py``).

Contract:
* Keys are ``str`` (``/``-separated paths), values are ``bytes``. Every key the store hands out is
  relative to the store's own prefix (an etcd URL's path), so callers never see that prefix.
* ``put(key, value, ttl=None)``: create or replace. With ``ttl`` (seconds), the key is attached to a
  lease and disappears ``ttl`` seconds after the last ``put``/``refresh`` of it, unless refreshed.
  Without ``ttl`` the key is permanent (a later ``put`` without ttl detaches any old lease).
* ``refresh(key)``: extend the key's lease by its ttl; returns False when the key is gone (expired
  or deleted) or has no lease.
* ``get`` returns ``None`` for a missing key; ``list(prefix)`` returns ``{key: value}`` of the
  live keys under ``prefix``; ``delete`` returns whether a key was removed.
* ``watch(prefix)``: an async iterator of ``WatchEvent`` for changes under ``prefix`` made after
  the watch started (puts, deletes, and expiries, which arrive as deletes), in store order. It ends
  only when the consumer stops iterating or the store is closed. If the backend loses its
  connection it raises ``RegistryUnavailable`` from the iterator; the consumer re-lists and
  re-watches (``revision`` lets it skip stale events).
* Every backend failure surfaces as ``RegistryUnavailable``; no backend exception type leaks out.
* ``close()`` releases connections, stops keepalive tasks, and ends open watches.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = ["RegistryStore", "WatchEvent"]


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: str
    value: bytes | None  # None for deletes
    revision: int  # monotonically increasing per store


class RegistryStore(Protocol):
    async def put(self, key: str, value: bytes, *, ttl: float | None = None) -> None: ...

    async def refresh(self, key: str) -> bool: ...

    async def get(self, key: str) -> bytes | None: ...

    async def list(self, prefix: str) -> dict[str, bytes]: ...

    async def delete(self, key: str) -> bool: ...

    def watch(self, prefix: str) -> AsyncIterator[WatchEvent]: ...

    async def close(self) -> None: ...
