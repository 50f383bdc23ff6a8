"""transfer/state.py: KVPoll values, every transition, fake-clock deadlines, wait and release."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from transfer.errors import TransferError, TransferFailed
from transfer.state import TERMINAL, KVPoll, RoomState, RoomTable

B, W, T, S, F = (
    KVPoll.Bootstrapping,
    KVPoll.WaitingForInput,
    KVPoll.Transferring,
    KVPoll.Success,
    KVPoll.Failed,
)

# Written out by hand (not read from ALLOWED_TRANSITIONS) so the test checks the table.
ALLOWED = {(B, W), (W, T), (T, S), (B, F), (W, F), (T, F)}

# The shortest path from Bootstrapping to each state.
PATHS = {B: [], W: [W], T: [W, T], S: [W, T, S], F: [F]}


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def reason_for(state: KVPoll) -> str | None:
    return "boom" if state is F else None


def room_in(state: KVPoll) -> RoomState:
    room = RoomState(1, deadline=10.0)
    for step in PATHS[state]:
        room.advance(step, reason_for(step))
    return room


def test_kvpoll_values_are_sglangs() -> None:
    assert {p.name: p.value for p in KVPoll} == {
        "Failed": 0,
        "Bootstrapping": 1,
        "WaitingForInput": 2,
        "Transferring": 3,
        "Success": 4,
    }
    assert {S, F} == TERMINAL


@pytest.mark.parametrize(
    ("old", "new"), list(itertools.product(KVPoll, KVPoll)), ids=lambda p: p.name
)
def test_transitions(old: KVPoll, new: KVPoll) -> None:
    room = room_in(old)
    if (old, new) in ALLOWED:
        room.advance(new, reason_for(new))
        assert room.poll is new
        assert room.reason == reason_for(new)
        assert room.done == (new in TERMINAL)
    else:
        with pytest.raises(TransferError, match=f"invalid transition {old.name} -> {new.name}"):
            room.advance(new, reason_for(new))
        assert room.poll is old


def test_new_room_is_bootstrapping() -> None:
    room = RoomState(7, deadline=3.0)
    assert (room.poll, room.reason, room.done) == (B, None, False)
    assert "Bootstrapping" in repr(room)


def test_failed_needs_a_reason_and_others_refuse_one() -> None:
    room = RoomState(1, deadline=0)
    with pytest.raises(TransferError, match="to Failed needs a reason") as info:
        room.advance(F)
    assert info.value.room == 1 and info.value.op == "transition"
    with pytest.raises(TransferError, match="to WaitingForInput takes no reason"):
        room.advance(W, "why")
    assert room.poll is B


def test_raise_if_failed() -> None:
    room_in(S).raise_if_failed()
    with pytest.raises(TransferFailed, match="room 1: transfer failed: boom") as info:
        room_in(F).raise_if_failed()
    assert info.value.room == 1 and info.value.reason == "boom"


# --- the table --------------------------------------------------------------------------------


def test_create_get_advance_release() -> None:
    table = RoomTable(FakeClock(100.0))
    state = table.create(5, deadline_s=2.0)
    assert state.deadline == 102.0 and 5 in table and len(table) == 1
    assert table.get(5) is state
    table.advance(5, W)
    assert table.get(5).poll is W
    assert table.release(5) is state
    assert len(table) == 0 and 5 not in table
    assert state.poll is F and state.reason == "released in WaitingForInput"
    assert table.release(5) is None  # idempotent


def test_release_keeps_a_final_state() -> None:
    table = RoomTable(FakeClock())
    table.create(1, 1.0)
    for step in (W, T, S):
        table.advance(1, step)
    state = table.release(1)
    assert state is not None and (state.poll, state.reason) == (S, None)
    assert len(table) == 0


def test_duplicate_and_unknown_rooms() -> None:
    table = RoomTable(FakeClock())
    table.create(1, 1.0)
    with pytest.raises(TransferError, match="room 1 already exists"):
        table.create(1, 1.0)
    for call in (lambda: table.get(2), lambda: table.advance(2, W), lambda: table.fail(2, "x")):
        with pytest.raises(TransferError, match="unknown room 2"):
            call()


def test_advance_can_set_a_new_deadline() -> None:
    clock = FakeClock(0.0)
    table = RoomTable(clock)
    table.create(1, deadline_s=5.0)
    clock.now = 4.0
    table.advance(1, W, deadline_s=30.0)
    assert table.get(1).deadline == 34.0
    clock.now = 10.0
    assert table.expire() == []


def test_fail_is_idempotent() -> None:
    table = RoomTable(FakeClock())
    table.create(1, 1.0)
    assert table.fail(1, "peer died")
    assert not table.fail(1, "peer died again")
    assert table.get(1).reason == "peer died"


def test_expire_with_a_fake_clock() -> None:
    clock = FakeClock(0.0)
    table = RoomTable(clock)
    table.create(1, 1.0)  # stays Bootstrapping
    table.create(2, 1.0)
    table.advance(2, W)
    table.advance(2, T)
    table.create(3, 1.0)
    for step in (W, T, S):
        table.advance(3, step)  # final: never expires
    table.create(4, 5.0)  # not yet due
    clock.now = 0.5
    assert table.expire() == []
    clock.now = 1.0  # the deadline itself counts as overdue
    assert sorted(table.expire()) == [1, 2]
    assert table.get(1).reason == "timed out in Bootstrapping"
    assert table.get(2).reason == "timed out in Transferring"
    assert table.get(3).poll is S
    assert table.get(4).poll is B
    assert table.expire(now=5.0) == [4]
    assert table.get(4).reason == "timed out in Bootstrapping"
    assert table.expire(now=100.0) == []


def test_next_deadline() -> None:
    table = RoomTable(FakeClock(0.0))
    assert table.next_deadline() is None
    table.create(1, 3.0)
    table.create(2, 1.0)
    assert table.next_deadline() == 1.0
    table.fail(2, "x")
    assert table.next_deadline() == 3.0


# --- waiting ----------------------------------------------------------------------------------


async def test_wait_resolves_on_success() -> None:
    table = RoomTable()
    table.create(1, 10.0)

    async def drive() -> None:
        for step in (W, T, S):
            await asyncio.sleep(0)
            table.advance(1, step)

    waiter = asyncio.create_task(table.wait(1))
    await drive()
    state = await asyncio.wait_for(waiter, 1.0)
    assert state.poll is S
    state.raise_if_failed()


async def test_wait_returns_at_once_when_final() -> None:
    table = RoomTable()
    table.create(1, 10.0)
    table.fail(1, "engine write failed")
    state = await asyncio.wait_for(table.wait(1), 1.0)
    assert (state.poll, state.reason) == (F, "engine write failed")


async def test_wait_resolves_when_expire_fails_the_room() -> None:
    clock = FakeClock(0.0)
    table = RoomTable(clock)
    table.create(1, 1.0)
    waiter = asyncio.create_task(table.wait(1))
    await asyncio.sleep(0)
    assert not waiter.done()
    clock.now = 2.0
    assert table.expire() == [1]
    state = await asyncio.wait_for(waiter, 1.0)
    assert state.reason == "timed out in Bootstrapping"


async def test_wait_enforces_the_deadline_itself() -> None:
    table = RoomTable()  # the real monotonic clock
    table.create(1, 0.05)
    table.advance(1, W)
    state = await asyncio.wait_for(table.wait(1), 2.0)
    assert (state.poll, state.reason) == (F, "timed out in WaitingForInput")


async def test_wait_on_an_overdue_room_fails_it() -> None:
    clock = FakeClock(0.0)
    table = RoomTable(clock)
    table.create(1, 1.0)
    clock.now = 5.0
    state = await asyncio.wait_for(table.wait(1), 1.0)
    assert state.reason == "timed out in Bootstrapping"


async def test_release_wakes_waiters() -> None:
    table = RoomTable()
    table.create(1, 10.0)
    table.advance(1, W)
    waiters = [asyncio.create_task(table.wait(1)) for _ in range(3)]
    await asyncio.sleep(0)
    table.release(1)
    states = await asyncio.wait_for(asyncio.gather(*waiters), 1.0)
    assert {(s.poll, s.reason) for s in states} == {(F, "released in WaitingForInput")}


async def test_wait_on_unknown_room() -> None:
    with pytest.raises(TransferError, match="unknown room 9"):
        await RoomTable().wait(9)


async def test_no_rooms_leak() -> None:
    clock = FakeClock(0.0)
    table = RoomTable(clock)
    for room in range(200):
        table.create(room, 1.0)
        table.advance(room, W)
        if room % 3 == 0:
            table.advance(room, T)
            table.advance(room, S)
        elif room % 3 == 1:
            table.fail(room, "peer died")
        if room % 3 != 2:  # the rest are released while still waiting for input
            assert (await table.wait(room)).done
        assert table.release(room) is not None
    assert len(table) == 0
    assert table.next_deadline() is None
