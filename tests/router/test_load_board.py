"""The host's load board (``router.load_board``): boards of different processes over one file
(here two mappings in one process: the same shared pages)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from router import load_board
from router.load_board import ADMISSION, LEGS, TOKENS, HostLoad, LoadBoard, board_path
from router.workers import EngineLoad, Role, Worker


def boards(tmp_path: Path, processes: int = 2) -> list[LoadBoard]:
    path = board_path(str(tmp_path))
    LoadBoard.create(path, processes)
    return [LoadBoard(path, processes, index) for index in range(processes)]


def test_every_process_sees_the_sum_of_every_process_counts(tmp_path: Path) -> None:
    first, second = boards(tmp_path)
    slot = first.slot("p-1", 0)
    assert slot is not None and second.slot("p-1", 0) == slot  # one slot per worker rank
    assert first.slot("p-1", 1) not in (None, slot)
    first.add(slot, 0, 3)
    second.add(slot, 0, 2)
    second.add(slot, 1, 700)
    assert first.total(slot, 0) == second.total(slot, 0) == 5
    assert first.total(slot, 1) == 700
    first.add(ADMISSION, 0, 4)
    assert second.total(ADMISSION, 0) == 4


def test_a_restarted_process_starts_from_zero_and_clear_zeroes_a_dead_one(tmp_path: Path) -> None:
    first, second = boards(tmp_path)
    slot = first.slot("d-1", 0)
    assert slot is not None
    first.add(slot, 0, 2)
    second.add(slot, 0, 5)
    LoadBoard.clear(board_path(str(tmp_path)), 2, 1)  # process 1 died
    assert first.total(slot, 0) == 2
    second.add(slot, 0, 1)
    again = LoadBoard(board_path(str(tmp_path)), 2, 0)  # process 0 restarted
    assert again.total(slot, 0) == 1 and again.slot("d-1", 0) == slot


def test_host_load_follows_a_layout_change(tmp_path: Path) -> None:
    first, second = boards(tmp_path)
    mine, theirs = HostLoad(first, "p-1", 1), HostLoad(second, "p-1", 1)
    assert mine.count(1, LEGS) is None
    mine.resize(2)
    theirs.resize(2)
    slot = mine.slots[1]
    assert slot is not None
    theirs.add(slot, LEGS, 1)
    theirs.add(slot, TOKENS, 64)
    assert mine.count(1, LEGS) == 1 and mine.count(1, TOKENS) == 64


def test_a_full_board_counts_new_ranks_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(load_board, "SLOTS", 4)  # the admission slot and three ranks
    (board,) = boards(tmp_path, processes=1)
    slots = [board.slot("p-1", rank) for rank in range(3)]
    assert None not in slots and len(set(slots)) == 3
    assert board.slot("p-2", 0) is None
    assert HostLoad(board, "p-2", 1).count(0, LEGS) is None


def test_load_scores_credit_every_process_dispatches_since_a_reading(tmp_path: Path) -> None:
    """A prefill's load between two engine reports: its report plus what the whole host sent
    since (each process reads the report at its own time)."""
    mine, theirs = boards(tmp_path)
    here, there = (Worker(Role.PREFILL, "http://127.0.0.1:9001", id="p-1") for _ in range(2))
    here.host_load, there.host_load = HostLoad(mine, "p-1", 1), HostLoad(theirs, "p-1", 1)
    here.record_engine_load(
        [EngineLoad(running=2, waiting=1)],
        at=time.monotonic(),
        stale_after=60.0,
        dispatched=here.dispatched_counts(),
    )
    for _ in range(3):  # the other process sends three requests
        with there.load(0, tokens=10):
            pass
    assert here.load_score(0) == 2 + 1 + 3
    assert here.load_score(None) == 6
