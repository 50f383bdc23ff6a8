"""Exceptions raised by the KV event feed.

KVEventError              a TransferError (``transfer.errors``), so one tree covers the package
 ├── KVEventDecodeError   a payload or frame set that is not a valid event batch
 ├── ReplayTimeout        the replay endpoint did not finish answering in time
 └── EventGapError        batches were lost and could not be replayed (strict subscribers only)
"""

from __future__ import annotations

from ..errors import TransferError

__all__ = ["EventGapError", "KVEventDecodeError", "KVEventError", "ReplayTimeout"]


class KVEventError(TransferError):
    """Base of every error the KV event feed raises."""


class KVEventDecodeError(KVEventError):
    """A payload or frame set does not match any known event encoding or framing."""


class ReplayTimeout(KVEventError):
    """No end marker came from ``endpoint`` within ``timeout`` s of asking from seq ``start``."""

    def __init__(self, endpoint: str, start: int, timeout: float) -> None:
        super().__init__(f"replay from seq {start} at {endpoint} did not finish in {timeout}s")
        self.endpoint = endpoint
        self.start = start
        self.timeout = timeout


class EventGapError(KVEventError):
    """Batches ``first..last`` (inclusive) were missed live and could not be replayed."""

    def __init__(self, first: int, last: int, reason: str) -> None:
        super().__init__(f"lost KV event batches {first}..{last}: {reason}")
        self.first = first
        self.last = last
        self.reason = reason
