"""``LastGoodStore``: a rank table's store reads, answered from the last good data in an outage.

An etcd outage is no evidence against the engines registered in it: decodes keep looking up
prefill ranks (vLLM ``GET /query``, SGLang ``GET /route``) and the router keeps reading layouts.
So each rank table reads through a ``LastGoodStore``, one per namespace and protocol:

* every successful ``get``/``list`` refreshes a snapshot of what it answered, and this process's
  own successful ``put``/``delete`` update it (so it never lags behind our own writes);
* while the store is unavailable (``RegistryUnavailable``) a read answers from the snapshot: a
  ``get`` from the key's last answer or, for a key never read on its own, from a listed prefix
  that covers it; a read the snapshot cannot answer still raises;
* after a failure the store is asked again at most once per ``retry_s`` by reads the snapshot can
  answer (a hung etcd costs its call timeout once a second, not on every lookup); reads it cannot
  answer always try the store;
* one warning when an outage starts, one line when the store answers again;
* writes still raise (callers answer 503 and engines retry), except what a caller explicitly
  ``accept_locally``: kept in this process for ``keep_s`` and answered by ``get`` meanwhile, also
  when the store is back and has no such key (never written back: for short-lived entries).

Entries read with ``keep_s`` (short-lived keys, e.g. SGLang rooms) leave the snapshot after it;
the rest stays as long as the table (bounded by the namespace's ranks). Very old data is served
for as long as the outage lasts: engines that restart register again once the store is back.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from registry.backends.base import RegistryStore
from registry.errors import RegistryUnavailable

__all__ = ["RETRY_S", "LastGoodStore"]

logger = logging.getLogger(__name__)

RETRY_S = 1.0  # while the store is down, reads the snapshot can answer ask it this often


class _Expiring:
    """Keys with a deadline, oldest first: ``expired()`` pops those past it."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._until: OrderedDict[str, float] = OrderedDict()

    def set(self, key: str, keep_s: float) -> None:
        self._until[key] = self._clock() + keep_s
        self._until.move_to_end(key)

    def discard(self, key: str) -> None:
        self._until.pop(key, None)

    def alive(self, key: str) -> bool:
        until = self._until.get(key)
        return until is None or until > self._clock()

    def expired(self) -> list[str]:
        now, gone = self._clock(), []
        while self._until:
            key, until = next(iter(self._until.items()))
            if until > now:
                break
            self._until.popitem(last=False)
            gone.append(key)
        return gone


class LastGoodStore:
    """The reads and writes a rank table makes, over ``store``, with a last-good snapshot.

    ``name`` names the table in log lines (``"vllm namespace 'p1'"``).
    """

    def __init__(
        self,
        store: RegistryStore,
        name: str,
        *,
        retry_s: float = RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._name = name
        self._retry_s = retry_s
        self._clock = clock
        self._gets: dict[str, bytes | None] = {}
        self._lists: dict[str, dict[str, bytes]] = {}
        self._expiring = _Expiring(clock)
        self._local: dict[str, bytes] = {}
        self._local_expiring = _Expiring(clock)
        self._down_since: float | None = None
        self._retry_at = 0.0

    @property
    def stale(self) -> bool:
        """Whether the store failed last time it was asked (reads answer from the snapshot)."""
        return self._down_since is not None

    async def get(self, key: str, *, keep_s: float | None = None) -> bytes | None:
        """The key's value (None: missing); from the snapshot while the store is unavailable."""
        has, known = self._known_value(key)
        if has and self._resting():
            return known
        try:
            value = await self._store.get(key)
        except RegistryUnavailable as exc:
            self._failed(exc)
            if not has:
                raise
            return known
        self._answered()
        self._remember_get(key, value, keep_s)
        return self._local_value(key) if value is None else value

    async def list(self, prefix: str) -> dict[str, bytes]:
        """The live keys under ``prefix``; from the snapshot while the store is unavailable."""
        known = self._lists.get(prefix)
        if known is not None and self._resting():
            return dict(known)
        try:
            listed = await self._store.list(prefix)
        except RegistryUnavailable as exc:
            self._failed(exc)
            if known is None:
                raise
            return dict(known)
        self._answered()
        self._lists[prefix] = dict(listed)
        return listed

    async def put(self, key: str, value: bytes, *, ttl: float | None = None) -> None:
        """Write through (raises ``RegistryUnavailable`` in an outage); the snapshot follows."""
        try:
            await self._store.put(key, value, ttl=ttl)
        except RegistryUnavailable as exc:
            self._failed(exc)
            raise
        self._answered()
        self._remember_get(key, value, ttl)
        for prefix, listed in self._lists.items():
            if key.startswith(prefix):
                listed[key] = value

    async def delete(self, key: str) -> bool:
        """Delete through (raises ``RegistryUnavailable`` in an outage); the snapshot follows."""
        try:
            removed = await self._store.delete(key)
        except RegistryUnavailable as exc:
            self._failed(exc)
            raise
        self._answered()
        self._forget(key)
        return removed

    def accept_locally(self, key: str, value: bytes, keep_s: float) -> None:
        """Keep a write the store refused in this process for ``keep_s``: ``get`` answers it."""
        self._prune()
        self._local[key] = value
        self._local_expiring.set(key, keep_s)
        self._remember_get(key, value, keep_s)

    # --- the snapshot ----------------------------------------------------------------------------

    def _known_value(self, key: str) -> tuple[bool, bytes | None]:
        """(whether the snapshot knows ``key``, its value): the key's last read, else a listed
        prefix covering it, else a write accepted locally."""
        local = self._local_value(key)
        if key in self._gets and self._expiring.alive(key):
            value = self._gets[key]
            return True, local if value is None else value
        for prefix, listed in self._lists.items():
            if key.startswith(prefix):
                return True, listed.get(key, local)
        return local is not None, local

    def _local_value(self, key: str) -> bytes | None:
        if key in self._local and self._local_expiring.alive(key):
            return self._local[key]
        return None

    def _remember_get(self, key: str, value: bytes | None, keep_s: float | None) -> None:
        self._prune()
        self._gets[key] = value
        if keep_s is None:
            self._expiring.discard(key)
        else:
            self._expiring.set(key, keep_s)

    def _forget(self, key: str) -> None:
        if key in self._gets:
            self._gets[key] = None
        for listed in self._lists.values():
            listed.pop(key, None)

    def _prune(self) -> None:
        for key in self._expiring.expired():
            self._gets.pop(key, None)
        for key in self._local_expiring.expired():
            self._local.pop(key, None)

    # --- outage bookkeeping ----------------------------------------------------------------------

    def _resting(self) -> bool:
        """True while the store is down and not due for another try (this read skips it)."""
        if self._down_since is None:
            return False
        now = self._clock()
        if now < self._retry_at:
            return True
        self._retry_at = now + self._retry_s  # this read tries; concurrent ones keep resting
        return False

    def _failed(self, exc: RegistryUnavailable) -> None:
        now = self._clock()
        self._retry_at = now + self._retry_s
        if self._down_since is None:
            self._down_since = now
            logger.warning(
                "bootstrap %s: store unavailable, answering lookups from the last known ranks "
                "until it is back: %s",
                self._name,
                exc,
            )

    def _answered(self) -> None:
        if self._down_since is not None:
            logger.info(
                "bootstrap %s: store reachable again after %.1f s",
                self._name,
                self._clock() - self._down_since,
            )
            self._down_since = None
