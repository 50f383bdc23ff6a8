"""A prefill rank's room bookkeeping: ``RoomLedger`` (the decode's is ``receive_ledger``).

A room is *open* from the first call for it (``KVSender.bootstrap`` or ``send``) until
it is released. Transfer info that arrives before that call is kept as *early* info for the call
to claim; unclaimed after ``bootstrap_timeout_s`` (or when its decode aborts or goes away) it is
dropped and its decode ranks are told. A released room leaves a *tombstone* (the latest 4096 are
kept) so that a late call, a late transfer info or an ``Abort`` that crossed the status is answered
with how the room ended. A room's final status goes out only when no write of the room can land
in the decode's pages any more: a write left running past its deadline (or by a cancelled call)
*drains* first, and after an engine error with entries still in flight (``CODE_UNDRAINED``) no
status goes at all (the decode fails the room at its deadline and keeps the pages out of use).

The rooms' states live in a ``state.RoomTable`` (``states``). No I/O here: every status to send
goes to the ``report`` callback of the ledger's owner.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from transfer.control import Peer
from transfer.errors import TransferError, TransferFailed
from transfer.messages import TransferInfo
from transfer.state import Clock, KVPoll, RoomTable
from transfer.stats import SenderStats

__all__ = [
    "ClosedRoom",
    "EarlyInfo",
    "OpenRoom",
    "Report",
    "RoomLedger",
    "targets",
]

logger = logging.getLogger(__name__)

_TOMBSTONES = 4096  # ended rooms remembered, to answer late calls and aborts


class OpenRoom:
    """A prefill room from its first call until release: its decode ranks' infos and progress."""

    __slots__ = ("aux_slot", "busy", "changed", "infos", "room", "sent_pages", "undrained", "write")

    def __init__(self, room: int, infos: Iterable[TransferInfo]) -> None:
        self.room = room
        self.infos = list(infos)
        self.sent_pages = 0
        self.busy = False  # a call for the room is running
        self.changed = asyncio.Event()  # an info arrived or the room failed
        self.aux_slot: int | None = None
        self.write: asyncio.Task[None] | None = None  # a write left running past its deadline
        self.undrained = False  # the engine gave up on a failed write with entries in flight

    @property
    def complete(self) -> bool:
        """Every decode rank the room expects has sent its transfer info."""
        need = max((info.required_dst_info_num for info in self.infos), default=1)
        return len({info.session_id for info in self.infos}) >= need if self.infos else False


@dataclass(slots=True)
class EarlyInfo:
    """Transfer info for a room this rank has not started yet."""

    since: float
    infos: list[TransferInfo] = field(default_factory=list)


class ClosedRoom(NamedTuple):
    """A released room, still to be reported to its decode ranks (or remembered as a tombstone)."""

    room: int
    status: KVPoll
    reason: str | None
    targets: tuple[Peer, ...]
    write: asyncio.Task[None] | None
    aux_slot: int | None
    quiet: bool = True  # False: writes may still land in the decode's pages, for good


Report = Callable[[ClosedRoom], None]  # pushes a room's status to its targets, in the background


def targets(infos: Iterable[TransferInfo]) -> tuple[Peer, ...]:
    """The decode ranks to report to, each once, in order of arrival."""
    return tuple(dict.fromkeys(Peer(info.ip, info.port) for info in infos))


def _failed(room: int, reason: str, to: tuple[Peer, ...]) -> ClosedRoom:
    return ClosedRoom(room, KVPoll.Failed, reason, to, None, None)


class RoomLedger:
    """A prefill rank's rooms: open ones, early transfer info, tombstones, draining writes.

    ``report`` is called with every status to push that no caller awaits (a room failed while
    idle, a drained write, a refused or dropped transfer info); a closed room carries the aux
    staging slot to free, if any. Room counts go to ``stats``. Use from one event loop.
    """

    def __init__(
        self,
        clock: Clock,
        unique_rank: int,
        report: Report,
        stats: SenderStats,
        *,
        bootstrap_timeout_s: float,
        transfer_timeout_s: float,
    ) -> None:
        self._clock = clock
        self._rank = unique_rank
        self._report = report
        self._stats = stats
        self._bootstrap_timeout = bootstrap_timeout_s
        self._transfer_timeout = transfer_timeout_s
        self.states = RoomTable(clock)
        self._open: dict[int, OpenRoom] = {}
        self._early: dict[int, EarlyInfo] = {}
        self._tombs: OrderedDict[int, ClosedRoom] = OrderedDict()
        self.draining: dict[int, asyncio.Task[None]] = {}  # room -> write left running
        self._reporting = True

    def __len__(self) -> int:
        """Rooms open (started and not yet released)."""
        return len(self.states)

    @property
    def unclaimed(self) -> int:
        """Rooms whose transfer info arrived before this rank started them."""
        return len(self._early)

    def open(self, room: int, timeout_s: float | None) -> OpenRoom:
        """The open room, or a new one due in ``timeout_s`` (default: the bootstrap timeout).

        A new room claims its early transfer info. Raises ``TransferFailed`` for a room that
        ended in Failed and ``TransferError`` for one that succeeded (its tombstone is kept).
        """
        rec = self._open.get(room)
        if rec is not None:
            return rec
        tomb = self._tombs.get(room)
        if tomb is not None:
            if tomb.status is KVPoll.Failed:
                raise TransferFailed(room, tomb.reason or "failed")
            raise TransferError(f"room {room} already finished", room=room, op="send")
        self.states.create(room, self._bootstrap_timeout if timeout_s is None else timeout_s)
        early = self._early.pop(room, None)
        rec = self._open[room] = OpenRoom(room, early.infos if early else ())
        self._check_infos(rec)
        return rec

    def add_info(self, info: TransferInfo, refusal: str | None) -> None:
        """Add a decode rank's transfer info to its room (open, or early when not yet started).

        With ``refusal`` (its session is not usable) an open room fails with it; otherwise the
        decode is told the refusal at once. Info for a room that already ended is refused too;
        a second info from the same session is ignored.
        """
        room = info.room
        rec = self._open.get(room)
        infos = rec.infos if rec is not None else self._early.get(room, EarlyInfo(0)).infos
        if any(known.session_id == info.session_id for known in infos):
            logger.warning(
                "room %d: duplicate transfer info from %s ignored", room, info.session_id
            )
            return
        if rec is not None:
            rec.infos.append(info)
            if refusal is None:
                self._check_infos(rec)
            else:
                self.fail(room, refusal)
            return
        tomb = self._tombs.get(room)
        if refusal is None and tomb is not None:
            refusal = f"room {room} already ended ({tomb.status.name}) on this prefill rank"
        if refusal is not None:
            self._report(_failed(room, refusal, targets([info])))
            return
        self._early.setdefault(room, EarlyInfo(self._clock())).infos.append(info)

    def _check_infos(self, rec: OpenRoom) -> None:
        """Bootstrapping -> WaitingForInput once every expected decode rank sent its info."""
        if rec.complete and self.states.get(rec.room).poll is KVPoll.Bootstrapping:
            self.states.advance(rec.room, KVPoll.WaitingForInput, deadline_s=self._transfer_timeout)
            rec.changed.set()

    # --- ending rooms --------------------------------------------------------------------------

    def fail(self, room: int, reason: str) -> bool:
        """Fail an open room; an idle one is released and reported now, a busy one by its call."""
        if not self.states.fail(room, reason):
            return False
        rec = self._open[room]
        rec.changed.set()
        if not rec.busy:
            self.finish_later(room)
        return True

    def abort(self, room: int, reason: str) -> bool:
        """Fail an open room or drop its early info; returns whether there was either."""
        if room in self._open:
            return self.fail(room, reason)
        if room in self._early:
            self.drop_early(room, reason)
            return True
        return False

    def decode_aborted(self, room: int) -> None:
        """The decode gave up on ``room``; a room already over (and quiet) is reported again,
        since the status may have crossed the ``Abort``."""
        if room in self._open:
            self.fail(room, "aborted by the decode")
        elif room in self._early:
            self.drop_early(room, "aborted by the decode")
        elif room in self._tombs and room not in self.draining and self._tombs[room].quiet:
            self._report(self._tombs[room])

    def sessions_lost(self, lost: set[str], peer: Peer) -> None:
        """Fail the rooms, and drop the early info, of decode sessions whose connection dropped."""
        reason = f"lost connection to decode {peer}"
        for room, rec in list(self._open.items()):
            if any(info.session_id in lost for info in rec.infos):
                self.fail(room, reason)
        for room, early in list(self._early.items()):
            if any(info.session_id in lost for info in early.infos):
                self.drop_early(room, reason, lost=peer)

    def finish(self, room: int) -> ClosedRoom | None:
        """Release ``room``; its record when the status may go now, None while a write drains.

        A write left running past its deadline (or by a cancelled call) may still land in the
        decode's pages: the status, and the aux staging slot, wait for it to end.
        """
        closed = self._close(room)
        if not closed.quiet:
            # no status at all: the decode fails the room at its deadline and, unanswered,
            # keeps the pages out of use (the aux staging slot stays out of use here too)
            logger.error("room %d: engine writes may still be in flight; status withheld", room)
            return None
        if closed.write is None:
            return closed
        self.draining[room] = closed.write
        closed.write.add_done_callback(lambda _: self._drained(closed))
        return None

    def finish_later(self, room: int) -> None:
        """``finish`` and hand the record (if the status may go now) to ``report``."""
        closed = self.finish(room)
        if closed is not None:
            self._report(closed)

    def _close(self, room: int) -> ClosedRoom:
        """Release ``room`` (it must be final or is failed) and remember how it ended."""
        rec = self._open.pop(room)
        state = self.states.release(room)
        assert state is not None
        write = rec.write if rec.write is not None and not rec.write.done() else None
        closed = ClosedRoom(
            room,
            state.poll,
            state.reason,
            targets(rec.infos),
            write,
            rec.aux_slot,
            quiet=not rec.undrained,
        )
        self._remember(closed)
        if state.poll is KVPoll.Success:
            self._stats.rooms_succeeded += 1
        else:
            self._stats.rooms_failed += 1
            logger.warning("room %d failed: %s", room, state.reason)
        return closed

    def _drained(self, closed: ClosedRoom) -> None:
        self.draining.pop(closed.room, None)
        logger.info(
            "room %d: late engine write ended; reporting %s", closed.room, closed.status.name
        )
        if self._reporting:
            self._report(closed)

    def drop_early(self, room: int, reason: str, *, lost: Peer | None = None) -> None:
        """Drop transfer info no call claimed, telling its decode ranks (but ``lost``); a later
        call for the room fails at once."""
        early = self._early.pop(room)
        self._remember(_failed(room, reason, ()))
        to = tuple(peer for peer in targets(early.infos) if peer != lost)
        if to:
            self._report(_failed(room, reason, to))

    def _remember(self, closed: ClosedRoom) -> None:
        # a tombstone holds no write and no aux slot: reporting it again frees nothing
        self._tombs[closed.room] = closed._replace(write=None, aux_slot=None)
        self._tombs.move_to_end(closed.room)
        while len(self._tombs) > _TOMBSTONES:
            self._tombs.popitem(last=False)

    # --- deadlines and shutdown ----------------------------------------------------------------

    def expire(self, now: float) -> None:
        """Fail rooms past their deadline and drop transfer info no request claimed in time."""
        for room in self.states.expire(now):
            rec = self._open[room]
            rec.changed.set()
            if not rec.busy:
                self.finish_later(room)
        for room, early in list(self._early.items()):
            if now - early.since >= self._bootstrap_timeout:
                self.drop_early(
                    room,
                    f"prefill rank {self._rank} got no request for room {room} within "
                    f"{self._bootstrap_timeout:g} s",
                )

    def fail_all(self, reason: str) -> None:
        """Fail every open room and drop every early info (the rank is shutting down)."""
        for room in list(self._open):
            self.fail(room, reason)
        for room in list(self._early):
            self.drop_early(room, reason)

    def stop_reporting(self) -> None:
        """From now on writes that drain are not reported (the owner can no longer send)."""
        self._reporting = False
