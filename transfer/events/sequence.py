"""Where a subscriber stands in one publisher's seq stream: ``SeqTracker`` and the counters.

``KVEventSubscriber`` reads batches in seq order; this is its bookkeeping, without sockets: the
seq the live stream should deliver next, the live copies of batches that replay already yielded
(dropped on arrival), a publisher restart (its seq went backwards), and the seqs given up on,
logged, counted and, in strict mode, kept as the ``EventGapError`` to raise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .errors import EventGapError

__all__ = ["SeqTracker", "SubscriberStats"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SubscriberStats:
    """Counters since the subscriber opened."""

    received: int = 0  # batches yielded from the live stream
    replayed: int = 0  # batches yielded from replay replies
    duplicates: int = 0  # live messages dropped because replay already yielded them
    lost: int = 0  # seqs neither received nor replayed
    malformed: int = 0  # messages or payloads skipped because they did not decode
    restarts: int = 0  # times the publisher's seq went backwards (it restarted)


class SeqTracker:
    """The seq bookkeeping of one subscriber to the publisher at ``endpoint`` (named in logs).

    ``expected`` is the next seq due (``start_seq``, or None until the first live message);
    losses and restarts are counted in ``stats``. With ``strict``, ``gap`` holds the error for
    the seqs lost since the last ``gap = None``.
    """

    def __init__(
        self, endpoint: str, stats: SubscriberStats, *, start_seq: int | None, strict: bool
    ) -> None:
        self._endpoint = endpoint
        self._stats = stats
        self._strict = strict
        self.expected = start_seq
        self.gap: EventGapError | None = None  # raised after the current message, if strict
        self._dup_window: tuple[int, int] | None = None  # (after, up to and including)

    def drop_copies(self, after: int, upto: int) -> None:
        """Live copies of seqs ``after+1..upto`` are duplicates (replay yielded them)."""
        self._dup_window = (after, upto)

    def is_duplicate(self, seq: int) -> bool:
        """Whether live ``seq`` is a copy of a replayed batch; the first that is not ends that."""
        window = self._dup_window
        if window is not None and window[0] < seq <= window[1]:
            return True
        self._dup_window = None
        return False

    def place(self, seq: int) -> int:
        """Take live ``seq`` in: it starts the stream if none is due, and one below the seq due
        means the publisher restarted (its new stream is due from 0). Returns the seq due."""
        expected = self.expected
        if expected is not None and seq < expected:
            self._stats.restarts += 1
            logger.warning(
                "KV event seq went back from %d to %d at %s: publisher restarted",
                expected - 1,
                seq,
                self._endpoint,
            )
            expected = 0
        self.expected = seq if expected is None else expected
        return self.expected

    def lose(self, first: int, last: int, reason: str) -> None:
        """Give up on ``first..last``: log it, count it, and note it for strict mode."""
        self.expected = last + 1
        self._stats.lost += last - first + 1
        logger.warning(
            "lost KV event batches %d..%d from %s: %s", first, last, self._endpoint, reason
        )
        if not self._strict:
            return
        if self.gap is not None:
            first, reason = self.gap.first, f"{self.gap.reason}; {reason}"
        self.gap = EventGapError(first, last, reason)
