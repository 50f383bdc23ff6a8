"""``LayoutChanges``: which namespaces' rank layouts changed, told by one watch of the store.

A reader of the rank tables (the router's health prober) re-reads a prefill's layout only when
its namespace's rank keys changed since its last read, instead of on every probe: with a store
over the network (etcd, or ``router --workers N``'s supervisor) each read is two round trips per
prefill per probe.

* One watch of a protocol's key root (``bootstrap/sglang/`` or ``bootstrap/vllm/``) counts the
  changes per namespace. SGLang's ``rooms/`` keys (one per request where the engines use them)
  say nothing about the layout and are not counted.
* ``mark(namespace)`` is taken before a read and ``unchanged(namespace, mark)`` asked before the
  next one. A change during the read counts after the mark: the next read happens anyway.
* While the watch is not running (not started, the store unavailable, between retries) there is
  no mark and nothing is unchanged: every read happens, as without this class. Each (re)start
  of the watch is a new run, which no older mark matches. The stores establish a watch before
  their next read through the same store object (``registry.backends``), so a read after
  ``mark`` sees every change the watch may have missed.
* At most ``max_namespaces`` counters: beyond that the counters start over as a new run.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from registry.backends.base import RegistryStore
from registry.engine_api import sglang_table, vllm_table
from registry.errors import RegistryUnavailable

__all__ = ["LayoutChanges", "LayoutMark"]

logger = logging.getLogger(__name__)

_NOT_LAYOUT = "rooms/"  # SGLang's per-request DP rank notes under a namespace


@dataclass(frozen=True, slots=True)
class LayoutMark:
    """Where a namespace's change count stood when a read began."""

    run: int
    count: int


class LayoutChanges:
    """Change counts per namespace under ``root``; run ``run()`` as a task."""

    def __init__(
        self,
        store: RegistryStore,
        root: str,
        *,
        retry_s: float = 1.0,
        max_namespaces: int = 4096,
    ) -> None:
        self._store = store
        self._root = root
        self._retry_s = retry_s
        self._max_namespaces = max_namespaces
        self._run = 0
        self._live = False
        self._counts: dict[str, int] = {}

    @classmethod
    def of_sglang(cls, store: RegistryStore, *, retry_s: float = 1.0) -> LayoutChanges:
        """Changes of the SGLang rank tables (``SglangRankTable``) in ``store``."""
        return cls(store, sglang_table.KEY_ROOT, retry_s=retry_s)

    @classmethod
    def of_vllm(cls, store: RegistryStore, *, retry_s: float = 1.0) -> LayoutChanges:
        """Changes of the vLLM rank tables (``VllmRankTable``) in ``store``."""
        return cls(store, vllm_table.KEY_ROOT, retry_s=retry_s)

    @property
    def live(self) -> bool:
        """Whether the watch runs (marks are handed out)."""
        return self._live

    def mark(self, namespace: str) -> LayoutMark | None:
        """The namespace's count now; None while the watch is not running."""
        if not self._live:
            return None
        return LayoutMark(self._run, self._counts.get(namespace, 0))

    def unchanged(self, namespace: str, mark: LayoutMark) -> bool:
        """Whether the watch, running since ``mark`` was taken, saw no change of the namespace."""
        return self._live and mark.run == self._run and self._counts.get(namespace, 0) == mark.count

    async def run(self) -> None:
        """Watch until cancelled or the store is closed; retry every ``retry_s`` after a
        failure."""
        while True:
            events = self._store.watch(self._root)
            self._start_run()
            try:
                async for event in events:
                    self._count(event.key)
                return  # the store was closed
            except RegistryUnavailable as exc:
                logger.debug("rank layout watch of %s stopped: %s", self._root, exc)
            finally:
                self._live = False
                close = getattr(events, "aclose", None)
                if close is not None:
                    await close()
            await asyncio.sleep(self._retry_s)

    def _start_run(self) -> None:
        self._run += 1
        self._counts.clear()
        self._live = True

    def _count(self, key: str) -> None:
        namespace, _, rest = key.removeprefix(self._root).partition("/")
        if rest.startswith(_NOT_LAYOUT):
            return
        if namespace not in self._counts and len(self._counts) >= self._max_namespaces:
            self._start_run()  # every mark is stale: reads happen until marked again
        self._counts[namespace] = self._counts.get(namespace, 0) + 1
