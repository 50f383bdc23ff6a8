"""A rank's memory as the engine sees it: the KV pool and the aux buffer, registered while open."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Sequence

from transfer.engine.base import TransferEngine
from transfer.errors import TransferError
from transfer.page_layout import KVPageLayout

__all__ = ["RegisteredBuffers", "memory_ranges"]


def memory_ranges(ptrs: Sequence[int], length: int) -> list[tuple[int, int]]:
    """``(ptr, length)`` buffers merged where they touch (entries may span region boundaries)."""
    ranges: list[tuple[int, int]] = []
    for ptr in sorted(ptrs):
        if ranges and ranges[-1][0] + ranges[-1][1] == ptr:
            ranges[-1] = (ranges[-1][0], ranges[-1][1] + length)
        else:
            ranges.append((ptr, length))
    return ranges


class RegisteredBuffers:
    """Registers the KV pool's regions and the aux buffer on ``open``; ``close`` undoes it."""

    def __init__(self, engine: TransferEngine, layout: KVPageLayout, aux: bytearray | None) -> None:
        self._engine = engine
        self._layout = layout
        self._aux = aux
        self._aux_pin: ctypes.Array[ctypes.c_char] | None = None
        self._registered: list[int] = []
        self.aux_ptr = 0  # the aux buffer's address (0 without one)

    def open(self) -> None:
        """Register everything; raises EngineError (what was registered stays until close)."""
        ranges = memory_ranges(self._layout.base_ptrs, self._layout.region_bytes)
        if self._aux:
            # the ctypes view pins the bytearray (it cannot be resized) and gives its address
            self._aux_pin = (ctypes.c_char * len(self._aux)).from_buffer(self._aux)
            self.aux_ptr = ctypes.addressof(self._aux_pin)
            ranges.append((self.aux_ptr, len(self._aux)))
        for ptr, length in ranges:
            self._engine.register(ptr, length)
            self._registered.append(ptr)

    def close(self) -> None:
        for ptr in self._registered:
            with contextlib.suppress(TransferError):
                self._engine.unregister(ptr)
        self._registered.clear()
