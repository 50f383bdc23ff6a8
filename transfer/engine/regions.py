"""The registered memory regions of one engine: non-overlapping ``[ptr, ptr + length)`` ranges.

Pure bookkeeping shared by the engines: the Mooncake adapter checks write sources against it (the
TCP transport does not), the loopback engine checks sources and destinations. No I/O.
"""

from __future__ import annotations

import bisect

__all__ = ["RegionTable"]


class RegionTable:
    """Sorted, non-overlapping address ranges keyed by their start address."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._lengths: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._starts)

    def overlaps(self, ptr: int, length: int) -> bool:
        """Whether ``[ptr, ptr + length)`` shares a byte with a region already in the table."""
        i = bisect.bisect_left(self._starts, ptr + length)
        if i == 0:
            return False
        start = self._starts[i - 1]
        return start + self._lengths[start] > ptr

    def add(self, ptr: int, length: int) -> None:
        """Record a region; ``ValueError`` if it is empty or overlaps one already recorded."""
        if length < 1:
            raise ValueError(f"region at {ptr:#x} has length {length}")
        if self.overlaps(ptr, length):
            raise ValueError(f"region [{ptr:#x}, +{length}) overlaps a registered region")
        bisect.insort(self._starts, ptr)
        self._lengths[ptr] = length

    def remove(self, ptr: int) -> bool:
        """Forget the region starting at ``ptr``; ``False`` if there is none."""
        if self._lengths.pop(ptr, None) is None:
            return False
        self._starts.remove(ptr)
        return True

    def contains(self, ptr: int, length: int) -> bool:
        """Whether ``[ptr, ptr + length)`` lies inside a single registered region."""
        i = bisect.bisect_right(self._starts, ptr)
        if i == 0:
            return False
        start = self._starts[i - 1]
        return ptr + length <= start + self._lengths[start]
