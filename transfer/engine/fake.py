"""``TransferEngine`` in process: ``LoopbackEngine`` copies bytes with ``ctypes.memmove``.

For tests and CPU-only runs. The "network" is an explicit ``LoopbackNetwork`` object that the
engines of one test share (no module state): ``network.engine()`` makes an engine and gives it a
session id ``"loopback:N"``; a write looks its peer up there, so an unknown or closed session fails
like a dead peer.

Same contract and error vocabulary as ``MooncakeEngine``: ``EngineError`` ops ``register``,
``unregister`` and ``write``; register overlap ``-7``, zero length ``-1``, unknown unregister
``-3``; ``write`` failures ``-1``. Every source range must lie inside one of this engine's
registered regions and every destination range inside one of the peer's, checked before a batch
copies anything (Mooncake checks destinations on the peer, per entry). Entries go in batches of
at most ``MAX_ENTRIES_PER_BATCH``, with a yield to the event loop between batches.

Knobs: ``fail_writes(count, code=..., after_entries=...)`` makes the next ``count`` writes raise
(optionally after copying their first entries, like a transfer that broke half way), ``delay_s``
sleeps before each batch. ``stats`` counts what moved.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from transfer.closing import AsyncClosing
from transfer.engine.regions import RegionTable
from transfer.errors import EngineError
from transfer.page_layout import MAX_ENTRIES_PER_BATCH, Entry, batches

__all__ = ["LoopbackEngine", "LoopbackNetwork", "LoopbackStats"]

logger = logging.getLogger(__name__)

_FAILED = -1
_OVERLAP = -7
_UNKNOWN_REGION = -3


def _fail(op: str, code: int, detail: str) -> EngineError:
    error = EngineError(op, code, detail=detail)
    logger.warning("%s", error)
    return error


class LoopbackNetwork:
    """The engines one test connects, by session id."""

    def __init__(self, host: str = "loopback") -> None:
        self._host = host
        self._ports = itertools.count(1)
        self._engines: dict[str, LoopbackEngine] = {}

    def engine(self) -> LoopbackEngine:
        """A new engine attached to this network under a fresh session id."""
        engine = LoopbackEngine(self, f"{self._host}:{next(self._ports)}")
        self._engines[engine.session_id] = engine
        return engine

    def lookup(self, session: str) -> LoopbackEngine | None:
        return self._engines.get(session)

    def detach(self, session: str) -> None:
        self._engines.pop(session, None)


@dataclass
class LoopbackStats:
    """What an engine wrote: calls, entries, bytes and the size of every batch."""

    writes: int = 0
    entries: int = 0
    bytes: int = 0
    batch_sizes: list[int] = field(default_factory=list)


@dataclass
class _Failures:
    count: int = 0
    code: int = _FAILED
    after_entries: int = 0


class LoopbackEngine(AsyncClosing):
    """An in-process engine on a ``LoopbackNetwork``; make it with ``network.engine()``."""

    def __init__(self, network: LoopbackNetwork, session_id: str) -> None:
        self._network = network
        self._session_id = session_id
        self._regions = RegionTable()
        self._closed = False
        self._failures = _Failures()
        self.delay_s = 0.0
        self.stats = LoopbackStats()

    @property
    def session_id(self) -> str:
        return self._session_id

    def fail_writes(self, count: int = 1, *, code: int = _FAILED, after_entries: int = 0) -> None:
        """Make the next ``count`` writes raise ``EngineError(write, code)``.

        Each copies its first ``after_entries`` entries before failing.
        """
        self._failures = _Failures(count, code, after_entries)

    def register(self, ptr: int, length: int) -> None:
        self._check_open("register")
        if length < 1:
            raise _fail("register", _FAILED, f"region at {ptr:#x} has length {length}")
        if self._regions.overlaps(ptr, length):
            raise _fail("register", _OVERLAP, f"region [{ptr:#x}, +{length}) overlaps")
        self._regions.add(ptr, length)

    def unregister(self, ptr: int) -> None:
        self._check_open("unregister")
        if not self._regions.remove(ptr):
            raise _fail("unregister", _UNKNOWN_REGION, f"no region at {ptr:#x}")

    async def write(self, session: str, entries: Sequence[Entry]) -> None:
        """Copy ``entries`` into ``session``'s registered memory; ``EngineError`` on any misfit."""
        self._check_open("write")
        if any(entry.length < 1 for entry in entries):
            raise ValueError("every entry needs a length >= 1")
        self.stats.writes += 1
        failing = self._failures.count > 0
        if failing:
            self._failures.count -= 1
        copy_left = self._failures.after_entries if failing else len(entries)
        for batch in batches(entries, MAX_ENTRIES_PER_BATCH) if entries else ():
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            copy_left -= self._copy(session, batch, limit=copy_left)
            await asyncio.sleep(0)
            if failing and copy_left <= 0:
                break
        if failing:
            raise _fail("write", self._failures.code, f"session {session}: injected failure")

    async def aclose(self) -> None:
        await self.close()

    async def close(self) -> None:
        """Leave the network; later calls raise ``EngineError``. Idempotent."""
        self._closed = True
        self._network.detach(self._session_id)

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise _fail(op, _FAILED, f"engine {self._session_id} is closed")

    def _copy(self, session: str, batch: Sequence[Entry], *, limit: int) -> int:
        """Validate all of ``batch``, then copy its first ``limit`` entries; return how many."""
        self._check_open("write")
        peer = self._network.lookup(session)
        if peer is None:
            raise _fail("write", _FAILED, f"no engine at session {session}")
        for entry in batch:
            if not self._regions.contains(entry.src, entry.length):
                raise _fail(
                    "write",
                    _FAILED,
                    f"source [{entry.src:#x}, +{entry.length}) is not inside a registered region",
                )
            if not peer._regions.contains(entry.dst, entry.length):
                raise _fail(
                    "write",
                    _FAILED,
                    f"destination [{entry.dst:#x}, +{entry.length}) is "
                    f"not inside a region registered at {session}",
                )
        copy = batch[: max(limit, 0)]
        for entry in copy:
            ctypes.memmove(entry.dst, entry.src, entry.length)
        self.stats.batch_sizes.append(len(batch))
        self.stats.entries += len(copy)
        self.stats.bytes += sum(entry.length for entry in copy)
        return len(copy)
