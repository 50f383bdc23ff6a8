"""``LayoutChanges``: whether a namespace's rank layout changed, told by watches of the store.

A reader of the rank tables (the router's health prober) re-reads a prefill's layout only when
its namespace's rank keys changed since its last read, instead of on every probe: with a store
over the network (etcd, or ``router --workers N``'s supervisor) each read is two round trips per
prefill per probe.

* A namespace is watched from the first ``mark`` of it: one watch per key prefix that holds its
  layout (SGLang: ``layout`` and ``ranks/``; vLLM: ``epoch`` and ``workers/``), never its whole
  key space: SGLang's ``rooms/`` keys change once per request where the engines use them and
  say nothing about the layout, and a watch would be told each one.
* ``mark(namespace)`` is taken before a read and ``unchanged(namespace, mark)`` asked before the
  next one. A change during the read counts after the mark: the next read happens anyway.
* While a namespace's watches are not all running (just started, the store unavailable, between
  retries) there is no mark and nothing is unchanged: every read happens, as without this class.
  Each (re)start of a watch is a new run, which no older mark matches. The stores establish a
  watch before their next read through the same store object (``registry.backends``), so a
  read after ``mark`` sees every change the watch may have missed.
* At most ``max_namespaces`` namespaces are watched; the others are read every time.
  ``aclose`` stops every watch.
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


@dataclass(frozen=True, slots=True)
class LayoutMark:
    """Where each of a namespace's watches stood when a read began: (run, changes) each."""

    positions: tuple[tuple[int, int], ...]


class _PrefixWatch:
    """Counts the changes under one key prefix, restarting after ``retry_s`` on a failure."""

    def __init__(self, store: RegistryStore, prefix: str, retry_s: float) -> None:
        self._store = store
        self._prefix = prefix
        self._retry_s = retry_s
        self.run = 0
        self.changes = 0
        self.live = False
        self.task = asyncio.create_task(self._watch(), name=f"layout-watch {prefix}")

    async def _watch(self) -> None:
        while True:
            events = self._store.watch(self._prefix)
            self.run, self.changes, self.live = self.run + 1, 0, True
            try:
                async for _ in events:
                    self.changes += 1
                return  # the store was closed
            except RegistryUnavailable as exc:
                logger.debug("rank layout watch of %s stopped: %s", self._prefix, exc)
            finally:
                self.live = False
                close = getattr(events, "aclose", None)
                if close is not None:
                    await close()
            await asyncio.sleep(self._retry_s)


class LayoutChanges:
    """Change counts of each namespace's layout keys under ``root``; ``aclose`` when done."""

    def __init__(
        self,
        store: RegistryStore,
        root: str,
        layout_keys: tuple[str, ...],
        *,
        retry_s: float = 1.0,
        max_namespaces: int = 1024,
    ) -> None:
        self._store = store
        self._root = root
        self._layout_keys = layout_keys
        self._retry_s = retry_s
        self._max_namespaces = max_namespaces
        self._watches: dict[str, tuple[_PrefixWatch, ...]] = {}

    @classmethod
    def of_sglang(cls, store: RegistryStore, *, retry_s: float = 1.0) -> LayoutChanges:
        """Changes of the SGLang rank tables (``SglangRankTable``) in ``store``."""
        return cls(store, sglang_table.KEY_ROOT, sglang_table.LAYOUT_KEYS, retry_s=retry_s)

    @classmethod
    def of_vllm(cls, store: RegistryStore, *, retry_s: float = 1.0) -> LayoutChanges:
        """Changes of the vLLM rank tables (``VllmRankTable``) in ``store``."""
        return cls(store, vllm_table.KEY_ROOT, vllm_table.LAYOUT_KEYS, retry_s=retry_s)

    def live(self, namespace: str) -> bool:
        """Whether every watch of the namespace runs (its marks are handed out)."""
        watches = self._watches.get(namespace)
        return watches is not None and all(watch.live for watch in watches)

    def mark(self, namespace: str) -> LayoutMark | None:
        """The namespace's position now; None while its watches are not all running (the
        first mark of a namespace starts them). Needs a running event loop."""
        watches = self._watches.get(namespace)
        if watches is None:
            if len(self._watches) < self._max_namespaces:
                self._watches[namespace] = tuple(
                    _PrefixWatch(self._store, f"{self._root}{namespace}/{key}", self._retry_s)
                    for key in self._layout_keys
                )
            return None
        if not all(watch.live for watch in watches):
            return None
        return LayoutMark(tuple((watch.run, watch.changes) for watch in watches))

    def unchanged(self, namespace: str, mark: LayoutMark) -> bool:
        """Whether the namespace's watches, running since ``mark`` was taken, saw no change."""
        watches = self._watches.get(namespace)
        return (
            watches is not None
            and all(watch.live for watch in watches)
            and mark.positions == tuple((watch.run, watch.changes) for watch in watches)
        )

    async def aclose(self) -> None:
        """Stop every watch and wait until they ended."""
        tasks = [watch.task for watches in self._watches.values() for watch in watches]
        self._watches.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
