"""A decode rank's room bookkeeping: ``ReceiveLedger`` (the prefill's is ``room_ledger``).

A room is pending while its ``KVReceiver.request`` runs; the ledger keeps the room's state (in a
``state.RoomTable``, ``states``) and what is known of its prefill rank: which one, whether the
transfer info left, whether the prefill reported the room's end or is gone (then its writes are
over, and the request's pages are safe). No I/O here.
"""

from __future__ import annotations

import asyncio
import logging

from transfer.control import Peer
from transfer.messages import TransferStatus
from transfer.state import Clock, KVPoll, RoomTable

__all__ = ["PendingRoom", "ReceiveLedger"]

logger = logging.getLogger(__name__)


class PendingRoom:
    """What a decode rank knows about one room's prefill while the request runs."""

    __slots__ = ("base_url", "info_sent", "lost", "peer", "settled", "status")

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.peer: Peer | None = None
        self.info_sent = False
        self.lost = False
        self.status: TransferStatus | None = None
        self.settled = asyncio.Event()  # the prefill reported the room's end, or is gone


class ReceiveLedger:
    """A decode rank's rooms in progress. ``release`` every room you ``open`` (in a ``finally``)."""

    def __init__(self, clock: Clock) -> None:
        self.states = RoomTable(clock)
        self._pending: dict[int, PendingRoom] = {}

    def __len__(self) -> int:
        """Rooms in progress (0 when idle)."""
        return len(self.states)

    def open(self, room: int, timeout_s: float, base_url: str) -> PendingRoom:
        """Start ``room``, due in ``timeout_s``; ``TransferError`` if it is already running."""
        self.states.create(room, timeout_s)
        pending = self._pending[room] = PendingRoom(base_url)
        return pending

    def release(self, room: int) -> None:
        """Forget ``room`` (a room not yet final is failed first, waking its waiter)."""
        del self._pending[room]
        self.states.release(room)

    def cancel(self, room: int, reason: str) -> bool:
        """Fail a running room; returns whether it was running and not yet final."""
        if room not in self._pending:
            return False
        return self.states.fail(room, reason)

    def fail_all(self, reason: str) -> None:
        """Fail every room in progress (the rank is shutting down)."""
        for room in list(self._pending):
            self.states.fail(room, reason)

    def settle(self, status: TransferStatus) -> Peer | None:
        """Apply the prefill's final status to its room (other statuses are ignored).

        Returns the prefill rank when it reported Failed (it may have lost our registration).
        """
        pending = self._pending.get(status.room)
        if pending is None:
            logger.debug("status %s for room %d that is not waiting", status.status, status.room)
            return None
        if status.status not in (KVPoll.Success, KVPoll.Failed):
            return None
        pending.status = status
        pending.settled.set()
        state = self.states.get(status.room)
        if status.status is KVPoll.Success and state.poll is KVPoll.Transferring:
            self.states.advance(status.room, KVPoll.Success)
            return None
        if status.status is not KVPoll.Failed:
            return None
        reason = status.reason or "no reason given"
        self.states.fail(status.room, f"prefill rank {status.prefill_rank}: {reason}")
        return pending.peer

    def peer_lost(self, peer: Peer) -> None:
        """Fail the rooms served by ``peer``: its process, and its writes, are gone."""
        for room, pending in self._pending.items():
            if pending.peer == peer:
                pending.lost = True
                pending.settled.set()
                self.states.fail(room, f"lost connection to prefill rank {peer}")
