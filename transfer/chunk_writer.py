"""How a prefill chunk becomes engine writes: ``ChunkWriter``.

For every decode rank of a room (dummy ranks excepted) the chunk's pages become engine entries,
coalesced where contiguous on both sides (``page_layout.transfer_entries``), and with the last
chunk the room's aux staging slot rides in the same batch. Entries go in batches of at most 1024,
each engine write bounded by the room's deadline. A write still running at the deadline, or when
the call is cancelled, is left on the room (``OpenRoom.write``) to drain; an engine error that
says entries may still be in flight (``CODE_UNDRAINED``) marks the room ``undrained``. What a
room record then means for its status is ``transfer.room_ledger``'s business.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from transfer.endpoint import RankEndpoint
from transfer.engine.mooncake_batch import CODE_UNDRAINED
from transfer.errors import EngineError, TransferError
from transfer.messages import TransferInfo
from transfer.page_layout import Entry, aux_entries, batches, total_bytes, transfer_entries
from transfer.room_ledger import OpenRoom
from transfer.sessions import DecodeSessions
from transfer.state import Clock, RoomTable
from transfer.stats import SenderStats

__all__ = ["ChunkWriter"]


class ChunkWriter:
    """Writes rooms' pages and aux slots from ``endpoint``'s memory into registered decode ranks.

    ``states`` holds the rooms' deadlines; byte, entry and batch counts go to ``stats``. The aux
    buffer of ``endpoint`` is cut into staging slots, one per room that sends aux, held until
    ``free_aux``.
    """

    def __init__(
        self,
        endpoint: RankEndpoint,
        sessions: DecodeSessions,
        states: RoomTable,
        stats: SenderStats,
        clock: Clock,
    ) -> None:
        self._endpoint = endpoint
        self._sessions = sessions
        self._states = states
        self._stats = stats
        self._clock = clock
        self._aux_free = list(range(endpoint.aux_slots))

    async def write(
        self, rec: OpenRoom, positions: range, src: Sequence[int], aux: bytes | None
    ) -> None:
        """Write request pages ``positions`` (this rank's pages ``src``), and ``aux`` if given.

        Stops early when the room ended meanwhile (aborted, lost or timed out). Raises
        ``ValueError`` for pages or aux that do not fit and ``TransferError`` (``EngineError``
        included) for an unusable session, a failed write or one still running at the deadline.
        """
        if aux is not None:
            self._stage_aux(rec, aux)
        for info in rec.infos:
            if info.is_dummy:
                continue
            entries = self._page_entries(info, positions, src)
            if aux is not None:  # the aux slot rides in the last chunk's batch
                entries += self._aux_entries(rec, info)
            await self._write_entries(rec, info.session_id, entries)

    def free_aux(self, slot: int) -> None:
        """Give a room's aux staging slot back (no write of the room is running)."""
        self._aux_free.append(slot)

    def _page_entries(
        self, info: TransferInfo, positions: range, src: Sequence[int]
    ) -> list[Entry]:
        session = self._sessions.get(info)
        if len(info.dst_kv_indices) < positions.stop:
            raise ValueError(
                f"decode allocated {len(info.dst_kv_indices)} pages, the prompt needs "
                f"{positions.stop}"
            )
        dst = [info.dst_kv_indices[i] for i in positions]
        return transfer_entries(self._endpoint.layout, session.layout, src, dst)

    def _stage_aux(self, rec: OpenRoom, aux: bytes) -> None:
        """Copy ``aux`` into a staging slot of this rank's registered aux buffer."""
        item_len = self._endpoint.aux_item_len
        if len(aux) > item_len:
            raise ValueError(f"aux of {len(aux)} bytes, slots hold {item_len}")
        if rec.aux_slot is None:
            if not self._aux_free:
                raise TransferError(
                    f"room {rec.room}: no free aux staging slot", room=rec.room, op="aux"
                )
            rec.aux_slot = self._aux_free.pop()
        self._endpoint.aux_slot(rec.aux_slot)[:] = aux.ljust(item_len, b"\0")

    def _aux_entries(self, rec: OpenRoom, info: TransferInfo) -> list[Entry]:
        session = self._sessions.get(info)
        if session.aux_ptr is None or info.dst_aux_index is None or rec.aux_slot is None:
            raise TransferError(
                f"decode session {info.session_id} registered no aux buffer",
                room=rec.room,
                op="aux",
            )
        return aux_entries(
            [self._endpoint.aux_ptr],
            [session.aux_ptr],
            [self._endpoint.aux_item_len],
            rec.aux_slot,
            info.dst_aux_index,
        )

    async def _write_entries(
        self, rec: OpenRoom, session_id: str, entries: Sequence[Entry]
    ) -> None:
        for batch in batches(entries):
            if self._states.get(rec.room).done:
                return  # aborted, lost or timed out: stop writing into the decode's pages
            await self._write(rec, session_id, batch)
            self._stats.batches += 1
            self._stats.entries += len(batch)
            self._stats.bytes_written += total_bytes(batch)

    async def _write(self, rec: OpenRoom, session_id: str, batch: Sequence[Entry]) -> None:
        """One engine write within the room's deadline (see the module notes)."""
        room = rec.room
        task = asyncio.create_task(self._endpoint.engine.write(session_id, batch))
        remaining = max(self._states.get(room).deadline - self._clock(), 0.0)
        try:
            done, _ = await asyncio.wait({task}, timeout=remaining)
        except asyncio.CancelledError:
            rec.write = task
            raise
        if not done:
            rec.write = task
            raise TransferError(
                f"room {room}: engine write still running at the deadline", room=room, op="write"
            )
        try:
            task.result()
        except EngineError as exc:
            if exc.code == CODE_UNDRAINED:
                rec.undrained = True
            raise
