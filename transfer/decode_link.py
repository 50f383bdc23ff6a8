"""A prefill rank's traffic with its decode ranks: ``DecodeLink``.

What decode ranks send a prefill rank arrives on its control socket (docs/concepts/protocols.md
6.3-6.7):
``RegisterKVArgs`` opens a decode session (``transfer.sessions``) and connects back to the decode,
so that a connection that drops is noticed; ``TransferInfo`` and ``Abort`` go to the room ledger.
A decode whose connection dropped takes its sessions with it, and the ledger fails their rooms.
What goes back is a room's final status, pushed to the room's decode ranks once the ledger says no
write of the room is running (the room's aux staging slot is freed then). Every status goes out
from a task of this link's own, so that cancelling the call that awaits it (a prefill request
whose client left) does not cut it short: the decode would otherwise never hear, and would
withhold the room's pages until its drain timeout. Closing gives those sends, and writes still
draining, one send timeout to finish.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable
from typing import Any

from transfer.chunk_writer import ChunkWriter
from transfer.closing import cancel_and_wait
from transfer.control import Peer
from transfer.endpoint import RankEndpoint
from transfer.errors import ProtocolMismatch, TransferError
from transfer.messages import Abort, RegisterKVArgs, TransferInfo, TransferStatus
from transfer.room_ledger import ClosedRoom, RoomLedger
from transfer.sessions import DecodeSessions
from transfer.stats import SenderStats

__all__ = ["DecodeLink"]

logger = logging.getLogger(__name__)


class DecodeLink:
    """Serves ``endpoint``'s control socket for a prefill rank and reports its closed rooms.

    Decode sessions go to ``sessions`` (registrations counted in ``stats``), rooms' transfer
    info and aborts to ``ledger``; statuses are sent as prefill rank ``prefill_rank``, and a
    reported room's aux slot goes back to ``writer``.
    """

    def __init__(
        self,
        endpoint: RankEndpoint,
        sessions: DecodeSessions,
        ledger: RoomLedger,
        writer: ChunkWriter,
        stats: SenderStats,
        prefill_rank: int,
    ) -> None:
        self._endpoint = endpoint
        self._sessions = sessions
        self._ledger = ledger
        self._writer = writer
        self._stats = stats
        self._prefill_rank = prefill_rank
        self._tasks: set[asyncio.Task[None]] = set()  # reports sent in the background

    # --- control messages ----------------------------------------------------------------------

    async def serve(self) -> None:
        """Handle the decode ranks' messages until cancelled."""
        while True:
            try:
                msg = await self._endpoint.control.recv()
            except ProtocolMismatch as exc:
                logger.warning("prefill control: dropped a message: %s", exc)
                continue
            match msg:
                case RegisterKVArgs():
                    self._on_register(msg)
                case TransferInfo():
                    known = msg.session_id in self._sessions
                    refusal = None if known else self._sessions.unregistered(msg)
                    self._ledger.add_info(msg, refusal)
                case Abort():
                    self._ledger.decode_aborted(msg.room)
                case _:
                    logger.warning("prefill control: unexpected %s ignored", type(msg).__name__)

    def _on_register(self, args: RegisterKVArgs) -> None:
        session = self._sessions.register(args)
        if session is None:
            return
        self._endpoint.control.connect(session.peer)  # watched: a decode that goes away fails
        self._stats.registrations += 1
        logger.info("decode session %s registered from %s", args.session_id, session.peer)

    def peer_lost(self, peer: Peer) -> None:
        """The control connection to ``peer`` dropped: its sessions, and their rooms, fail."""
        lost = self._sessions.drop_peer(peer)
        if lost:
            self._ledger.sessions_lost(lost, peer)

    # --- reports -------------------------------------------------------------------------------

    def report_later(self, closed: ClosedRoom) -> None:
        """``_report`` in the background (the ledger's report callback)."""
        self._spawn(self._report(closed))

    async def report_awaited(self, closed: ClosedRoom) -> None:
        """``_report`` for a caller that waits for it: cancelling the caller does not stop the
        report, which goes on in the background (``aclose`` waits for it, bounded)."""
        await asyncio.shield(self._spawn(self._report(closed)))

    async def _report(self, closed: ClosedRoom) -> None:
        """Push the room's status (no write of the room is running); free its aux slot."""
        if closed.aux_slot is not None:
            self._writer.free_aux(closed.aux_slot)
        status = TransferStatus(
            room=closed.room,
            status=closed.status,
            prefill_rank=self._prefill_rank,
            reason=closed.reason,
        )
        await self._push(closed.targets, status)

    async def _push(self, targets: Iterable[Peer], status: TransferStatus) -> None:
        async def one(peer: Peer) -> None:
            try:
                await self._endpoint.control.send(peer, status)
            except TransferError as exc:
                logger.warning(
                    "room %d: status not delivered to %s: %s", status.room, peer, exc.message
                )

        await asyncio.gather(*(one(peer) for peer in targets))

    async def aclose(self) -> None:
        """Let the reports still due go out, then stop reporting (the rooms are closed already).

        Background reports, and writes still draining (which report when they end), get one
        send timeout, plus slack; writes still running then are logged and never reported, and
        reports still running are cancelled.
        """
        waits = set(self._tasks) | set(self._ledger.draining.values())
        if waits:  # reports (and writes still draining) get one send timeout, plus slack
            await asyncio.wait(waits, timeout=self._endpoint.control.send_timeout_s + 0.5)
        self._ledger.stop_reporting()
        if self._ledger.draining:
            logger.error("%d engine write(s) still running at close", len(self._ledger.draining))
        await cancel_and_wait(list(self._tasks))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
