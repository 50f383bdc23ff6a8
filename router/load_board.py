"""The host's load board: the counts that routing and admission weigh, shared by the processes of
``router --workers N`` so that they decide as one router.

A file in the supervisor's run directory (on ``/dev/shm`` where it exists), mapped by every
process: ``SLOTS`` keys, then one block of ``SLOTS`` x ``FIELDS`` signed 64-bit counters per
process. A slot is one worker's DP rank (its key: 8 bytes of BLAKE2b of ``"id#rank"``); slot 0 is
the router's own admission (``ADMISSION``). Each process writes only its own block, so no write
needs a lock: the host's figure is the sum over the blocks, read when a decision needs it. A
process zeroes its block when it starts, so a restarted process's dead legs do not linger. Keys
are claimed under an ``flock`` of ``board.lock`` (once per worker rank and process) and never
given back: beyond ``SLOTS`` worker ranks seen since the router started, a new one is counted by
each process alone (logged once).

What the sum says is exact at the instant it is read; two processes deciding at the same
instant each see the other's decision only afterwards, so a cap (``--max-concurrent-requests``,
``--max-inflight-per-worker``, ``--max-body-memory``) can be passed by at most what N - 1
processes admit at the same instant.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
from collections.abc import Sequence

__all__ = [
    "ADMISSION",
    "DISPATCHED",
    "FIELDS",
    "LEGS",
    "SLOTS",
    "TOKENS",
    "HostLoad",
    "LoadBoard",
]

logger = logging.getLogger(__name__)

SLOTS = 8192  # worker DP ranks (and the admission row) the board can hold
FIELDS = 3  # per slot: in-flight legs (admission: units), pending tokens (admission: body
# bytes), requests dispatched (only grows; the credit since an engine's load report)
LEGS, TOKENS, DISPATCHED = 0, 1, 2  # a worker rank's fields
ADMISSION = 0  # the slot of the router's own admission
_ADMISSION_KEY = 1
_WORD = 8


def _key(worker_id: str, rank: int) -> int:
    digest = hashlib.blake2b(f"{worker_id}#{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True) or 2  # 0: free, 1: admission


class LoadBoard:
    """One process's view of the board: ``add`` to its own block, ``total`` over all blocks."""

    def __init__(self, path: str, processes: int, index: int) -> None:
        self._processes = processes
        self._index = index
        self._lock_path = path + ".lock"
        size = (SLOTS + SLOTS * FIELDS * processes) * _WORD
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), size)
        words = memoryview(self._map).cast("B").cast("q")
        self._keys = words[:SLOTS]
        self._cells = words[SLOTS:]
        block = SLOTS * FIELDS
        self._own = index * block  # this process's block in ``_cells``
        self._stride = block
        self._cells[self._own : self._own + block] = memoryview(bytes(block * _WORD)).cast("q")
        self._keys[ADMISSION] = _ADMISSION_KEY
        self._full_logged = False

    @staticmethod
    def create(path: str, processes: int) -> None:
        """The board's file, zeroed (by the supervisor, before any process starts)."""
        size = (SLOTS + SLOTS * FIELDS * processes) * _WORD
        with open(path, "wb") as file:
            file.truncate(size)
        with open(path + ".lock", "wb"):
            pass

    @staticmethod
    def clear(path: str, processes: int, index: int) -> None:
        """Zero process ``index``'s block (by the supervisor, once that process exited: the legs
        it counted died with it)."""
        LoadBoard(path, processes, index).close()

    def slot(self, worker_id: str, rank: int) -> int | None:
        """The slot of a worker's DP rank, claimed if new; None when the board is full."""
        key = _key(worker_id, rank)
        keys = self._keys
        start = key % (SLOTS - 1) + 1  # slot 0 is the admission's
        for probe in range(SLOTS - 1):
            slot = (start + probe - 1) % (SLOTS - 1) + 1
            found = keys[slot]
            if found == key:
                return slot
            if found == 0 and self._claim(slot, key):
                return slot
        if not self._full_logged:
            self._full_logged = True
            logger.warning(
                "the host load board is full (%d worker ranks): new ranks are counted per process",
                SLOTS - 1,
            )
        return None

    def _claim(self, slot: int, key: int) -> bool:
        with open(self._lock_path, "r+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if self._keys[slot] == 0:
                    self._keys[slot] = key
                return self._keys[slot] == key
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def add(self, slot: int, field: int, amount: int) -> None:
        """Add to this process's count of ``field`` at ``slot``."""
        cell = self._own + slot * FIELDS + field
        self._cells[cell] += amount

    def total(self, slot: int, field: int) -> int:
        """The host's count: every process's, summed."""
        first = slot * FIELDS + field
        return sum(self._cells[first :: self._stride])

    def close(self) -> None:
        self._keys.release()
        self._cells.release()
        self._map.close()


class HostLoad:
    """A worker's slots on the board, one per DP rank (None: counted by this process alone)."""

    __slots__ = ("_board", "_worker_id", "slots")

    def __init__(self, board: LoadBoard, worker_id: str, dp_size: int) -> None:
        self._board = board
        self._worker_id = worker_id
        self.slots: Sequence[int | None] = ()
        self.resize(dp_size)

    def resize(self, dp_size: int) -> None:
        board, worker_id = self._board, self._worker_id
        self.slots = tuple(board.slot(worker_id, rank) for rank in range(dp_size))

    def add(self, slot: int, field: int, amount: int) -> None:
        """This process's count of ``field`` (``LEGS``, ``TOKENS``) at ``slot``."""
        if amount:
            self._board.add(slot, field, amount)

    def count(self, rank: int, field: int) -> int | None:
        """The host's count of ``field`` at ``rank`` (None: the rank is not on the board)."""
        slot = self.slots[rank] if rank < len(self.slots) else None
        return None if slot is None else self._board.total(slot, field)


def board_path(run_dir: str) -> str:
    return os.path.join(run_dir, "load-board")
