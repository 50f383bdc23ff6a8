"""Counters of the transfer roles, read by workers and tests (monotonic, never reset)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ReceiverStats", "SenderStats"]


@dataclass(slots=True)
class SenderStats:
    registrations: int = 0
    rooms_succeeded: int = 0
    rooms_failed: int = 0
    batches: int = 0
    entries: int = 0
    bytes_written: int = 0  # KV and aux


@dataclass(slots=True)
class ReceiverStats:
    registrations_sent: int = 0
    rooms_succeeded: int = 0
    rooms_failed: int = 0
    kv_bytes: int = 0
