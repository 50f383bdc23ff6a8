"""The per-room transfer state machine, with KVPoll's numeric values, and the table of rooms.

A *room* is one request's KV transfer, named by the ``bootstrap_room`` the router minted. Both
roles walk the same chain (the numbers are SGLang's ``KVPoll``, so statuses read the same on the
wire and in logs)::

    Bootstrapping(1) -> WaitingForInput(2) -> Transferring(3) -> Success(4)
          \\                  \\                     \\
           +------------------+---------------------+--> Failed(0)

* prefill: Bootstrapping until every expected decode session has sent its transfer info;
  WaitingForInput until the forward pass has produced KV; Transferring while chunks are written;
  Success once every destination acknowledged the last chunk and the aux slot.
* decode: Bootstrapping until the prefill rank is registered with; WaitingForInput until pages
  are allocated; Transferring once the transfer info is sent (the prefill may write into our pages
  from now on); Success or Failed from the prefill's status.

Success and Failed are final; Failed always carries a reason. Every room has a deadline on an
injectable clock, so no wait can hang: ``RoomTable.expire`` (and ``RoomTable.wait`` itself) moves
overdue rooms to Failed with ``"timed out in <state>"``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from enum import IntEnum

from transfer.errors import TransferError, TransferFailed

__all__ = ["ALLOWED_TRANSITIONS", "TERMINAL", "Clock", "KVPoll", "RoomState", "RoomTable"]

Clock = Callable[[], float]


class KVPoll(IntEnum):
    """A room's state; the values are SGLang's ``KVPoll`` (unchanged from 0.4.9 to 0.5.23)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


TERMINAL: frozenset[KVPoll] = frozenset({KVPoll.Success, KVPoll.Failed})

ALLOWED_TRANSITIONS: dict[KVPoll, frozenset[KVPoll]] = {
    KVPoll.Bootstrapping: frozenset({KVPoll.WaitingForInput, KVPoll.Failed}),
    KVPoll.WaitingForInput: frozenset({KVPoll.Transferring, KVPoll.Failed}),
    KVPoll.Transferring: frozenset({KVPoll.Success, KVPoll.Failed}),
    KVPoll.Success: frozenset(),
    KVPoll.Failed: frozenset(),
}


class RoomState:
    """One room's state, deadline (on the table's clock) and failure reason.

    ``advance`` is the only way to change the state; it raises ``TransferError`` for a transition
    not in ``ALLOWED_TRANSITIONS`` (self-transitions included), for Failed without a reason and for
    a reason on any other state.
    """

    __slots__ = ("deadline", "poll", "reason", "room")

    def __init__(self, room: int, deadline: float) -> None:
        self.room = room
        self.poll = KVPoll.Bootstrapping
        self.deadline = deadline
        self.reason: str | None = None

    def __repr__(self) -> str:
        reason = f", reason={self.reason!r}" if self.reason else ""
        return f"RoomState(room={self.room}, {self.poll.name}, deadline={self.deadline:g}{reason})"

    @property
    def done(self) -> bool:
        """True once the room is in Success or Failed."""
        return self.poll in TERMINAL

    def overdue(self, now: float) -> bool:
        """True when the room is not done and its deadline has passed."""
        return not self.done and now >= self.deadline

    def advance(self, new: KVPoll, reason: str | None = None) -> None:
        """Move to ``new``; ``reason`` is required for Failed and refused otherwise."""
        if new not in ALLOWED_TRANSITIONS[self.poll]:
            raise TransferError(
                f"room {self.room}: invalid transition {self.poll.name} -> {new.name}",
                room=self.room,
                op="transition",
            )
        if (new is KVPoll.Failed) != bool(reason):
            need = "needs a reason" if new is KVPoll.Failed else "takes no reason"
            message = f"room {self.room}: transition to {new.name} {need}"
            raise TransferError(message, room=self.room, op="transition")
        self.poll = new
        self.reason = reason

    def raise_if_failed(self) -> None:
        """Raise ``TransferFailed`` with the room's reason if it ended in Failed."""
        if self.poll is KVPoll.Failed:
            raise TransferFailed(self.room, self.reason or "unknown")


class RoomTable:
    """The live rooms of one sender or receiver, with a completion event per room.

    Not thread-safe: use it from one event loop. ``release`` every room you ``create`` (a
    ``finally`` is the place); ``len(table)`` counts the rooms still held, for leak checks.
    """

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._rooms: dict[int, RoomState] = {}
        self._events: dict[int, asyncio.Event] = {}

    def __len__(self) -> int:
        return len(self._rooms)

    def __contains__(self, room: object) -> bool:
        return room in self._rooms

    def create(self, room: int, deadline_s: float) -> RoomState:
        """Add ``room`` in Bootstrapping, due ``deadline_s`` seconds from now.

        Raises ``TransferError`` if the room already exists (rooms are unique per request).
        """
        if room in self._rooms:
            raise TransferError(f"room {room} already exists", room=room, op="create")
        state = RoomState(room, self._clock() + deadline_s)
        self._rooms[room] = state
        self._events[room] = asyncio.Event()
        return state

    def get(self, room: int) -> RoomState:
        """The room's state; ``TransferError`` if it is unknown (never created or released)."""
        try:
            return self._rooms[room]
        except KeyError:
            raise TransferError(f"unknown room {room}", room=room, op="lookup") from None

    def advance(
        self,
        room: int,
        state: KVPoll,
        reason: str | None = None,
        *,
        deadline_s: float | None = None,
    ) -> RoomState:
        """Move ``room`` to ``state`` (see ``RoomState.advance``) and wake its waiters if final.

        ``deadline_s``, when given, sets a new deadline counted from now for the next stage.
        """
        entry = self.get(room)
        entry.advance(state, reason)
        if deadline_s is not None:
            entry.deadline = self._clock() + deadline_s
        if entry.done:
            self._events[room].set()
        return entry

    def fail(self, room: int, reason: str) -> bool:
        """Fail ``room`` unless it is already final; returns whether it changed.

        The idempotent form of ``advance(room, Failed, reason)`` for error paths that may race
        with a success or another failure (a dead peer reported twice).
        """
        entry = self.get(room)
        if entry.done:
            return False
        self.advance(room, KVPoll.Failed, reason)
        return True

    def expire(self, now: float | None = None) -> list[int]:
        """Fail every overdue room with ``"timed out in <state>"``; returns the rooms it failed."""
        now = self._clock() if now is None else now
        overdue = [room for room, entry in self._rooms.items() if entry.overdue(now)]
        for room in overdue:
            self.fail(room, f"timed out in {self._rooms[room].poll.name}")
        return overdue

    def next_deadline(self) -> float | None:
        """The earliest deadline among rooms not yet final (for a reaper to sleep until)."""
        return min((e.deadline for e in self._rooms.values() if not e.done), default=None)

    async def wait(self, room: int) -> RoomState:
        """Wait until ``room`` is Success or Failed and return its state.

        Never outlives the room's deadline: when it passes (on the table's clock) the room is
        failed as timed out. Releasing the room wakes the waiter too. Raises ``TransferError`` for
        an unknown room; a Failed room is returned, not raised (see ``raise_if_failed``).
        """
        entry = self.get(room)
        event = self._events[room]
        while not entry.done:
            remaining = entry.deadline - self._clock()
            if remaining <= 0:
                self.fail(room, f"timed out in {entry.poll.name}")
                break
            try:
                async with asyncio.timeout(remaining):
                    await event.wait()
            except TimeoutError:
                continue  # re-check: the deadline may have moved, or the clock may be fake
        return entry

    def release(self, room: int) -> RoomState | None:
        """Forget ``room``; idempotent. A room not yet final is failed first, waking its waiters."""
        entry = self._rooms.get(room)
        if entry is None:
            return None
        self.fail(room, f"released in {entry.poll.name}")
        del self._rooms[room]
        del self._events[room]
        return entry
