"""The transfer-engine seam: move bytes from local registered memory into a peer's memory.

Implementations: ``mooncake.MooncakeEngine`` (the Mooncake TransferEngine, P2PHANDSHAKE, tcp here
and rdma on real clusters) and ``fake.LoopbackEngine`` (in-process byte copies for tests).

Contract:
* ``session_id`` ("host:rpc_port") is what a peer targets in ``write``.
* ``register(ptr, length)`` must be called for every local and remote buffer before transfers;
  ``unregister`` releases it.
* ``write(session, entries)`` writes each ``page_layout.Entry`` (local src, remote dst, nbytes) into
  the peer's registered memory and returns when all entries completed; it raises ``EngineError``
  (never returns an error code) and never blocks the event loop: the native calls run in a
  worker thread or are submitted and polled. At most ``MAX_ENTRIES_PER_BATCH`` entries are in
  flight per peer.
* ``close()`` releases the engine; further calls raise ``EngineError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from transfer.page_layout import MAX_ENTRIES_PER_BATCH, Entry

__all__ = ["MAX_ENTRIES_PER_BATCH", "Entry", "TransferEngine"]


class TransferEngine(Protocol):
    @property
    def session_id(self) -> str: ...

    def register(self, ptr: int, length: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...

    async def write(self, session: str, entries: Sequence[Entry]) -> None: ...

    async def close(self) -> None: ...
