"""The connection caps of one HTTP server: how many connections it holds in all and per source
(peer IP address), which of them make room for a new one at the cap, and the open file limit
the default cap comes from.

A new connection is refused (503 and close) when its source already holds
``max_connections_per_source``, so that one client (or one attacking host) cannot take every
slot. At the global cap ``max_connections`` it first makes room: a connection that was answered
an error and is only waiting out its linger time goes first, then the longest-idle keep-alive
connection (one between requests: its response sent, no byte of a next request received; or a
new one that sent nothing yet) of the source that holds the most connections, so that a flood of
connections from a few hosts loses its own before anyone else's; only when there is neither is
the new one refused. An evicted keep-alive connection is closed as uvicorn's keep-alive timeout
would close it; clients reconnect.

Bookkeeping happens when a connection opens or closes and at request boundaries (a keep-alive
connection becomes idle, or starts its next request), never per read or per chunk.

The module imports nothing from the router, so that the standalone registry service can use it.
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Sized
from typing import Protocol

__all__ = [
    "ConnectionCaps",
    "Evictable",
    "RefusalLog",
    "auto_max_connections",
    "default_per_source",
    "raise_open_file_limit",
]

logger = logging.getLogger(__name__)

_LOG_EVERY_S = 10.0  # refusals are summed up in one warning at most this often

# auto max_connections: file descriptors kept for everything else (listeners, logs, the
# registry, KV event sockets), then a third of the rest, since a client connection in flight
# holds a prefill and a decode connection as well
_RESERVED_FDS = 256
_FDS_PER_CONNECTION = 3
_AUTO_MIN, _AUTO_MAX = 64, 16384


def raise_open_file_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; return the soft limit now
    in force (unchanged where it cannot be raised)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError) as exc:
        logger.warning("could not raise the open file limit from %d to %d: %s", soft, hard, exc)
        return soft
    return hard


def auto_max_connections(fd_limit: int) -> int:
    """The default connection cap for an open file limit: headroom for the upstream sockets."""
    spare = (fd_limit - _RESERVED_FDS) // _FDS_PER_CONNECTION
    return max(_AUTO_MIN, min(_AUTO_MAX, spare))


def default_per_source(max_connections: int) -> int:
    """The default per-source cap: half the global cap, so that one source always leaves the
    other half to everyone else."""
    return max(1, max_connections // 2)


class RefusalLog:
    """Counts connections ended by a limit, by reason, and logs them in one warning per
    interval (the first at once, then at most every 10 s): a flood must not become a flood of
    log lines."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._next_log = 0.0

    def add(self, reason: str) -> None:
        self._counts[reason] = self._counts.get(reason, 0) + 1
        now = time.monotonic()
        if now >= self._next_log:
            self._next_log = now + _LOG_EVERY_S
            summary = ", ".join(f"{count} {name}" for name, count in sorted(self._counts.items()))
            self._counts.clear()
            logger.warning("HTTP connections ended by the server limits: %s", summary)


class Evictable(Protocol):
    """A connection the caps can close to make room."""

    def close_now(self) -> None:
        """Close at once and leave the server's connection count (``ConnectionCaps.forget``)."""


class ConnectionCaps:
    """One server's caps: its connections per source, and those that can make room at the
    global cap (lingering after an error answer; idle, of the heaviest source,
    oldest first)."""

    def __init__(self, max_connections: int, max_per_source: int) -> None:
        self.max_connections = max_connections
        self.max_per_source = max_per_source  # 0: no per-source cap
        self.refusals = RefusalLog()
        self._per_source: dict[str, int] = {}
        self._lingering: set[Evictable] = set()
        # idle keep-alive connections by source, each in insertion order: longest idle first
        self._idle: dict[str | None, dict[Evictable, None]] = {}

    def admit(self, source: str | None, open_connections: Sized) -> str | None:
        """Count a new connection from ``source`` (``None``: not an IP peer, no per-source cap)
        among ``open_connections`` (the server's set, which eviction shrinks); return why it is
        refused instead, or ``None`` once it is counted."""
        held = self._per_source.get(source, 0) if source is not None else 0
        if self.max_per_source and held >= self.max_per_source:
            self.refusals.add("over the per-source connection cap")
            return f"this client holds its maximum of {self.max_per_source} connections"
        while len(open_connections) >= self.max_connections and self._make_room():
            pass
        if len(open_connections) >= self.max_connections:
            self.refusals.add("over the connection cap")
            return f"the server holds its maximum of {self.max_connections} connections"
        if source is not None:
            self._per_source[source] = held + 1
        return None

    def _make_room(self) -> bool:
        """Close one lingering, else the longest-idle keep-alive connection; False if none."""
        if self._lingering:
            self._lingering.pop().close_now()
            return True
        if self._idle:
            self.refusals.add("idle keep-alive evicted at the connection cap")
            per_source = self._per_source
            heaviest = max(self._idle, key=lambda source: per_source.get(source or "", 0))
            next(iter(self._idle[heaviest])).close_now()
            return True
        return False

    def forget(self, connection: Evictable, source: str | None) -> None:
        """``connection`` (counted for ``source``) has closed or is closing: release its slot."""
        self._lingering.discard(connection)
        self.busy(connection, source)
        if source is None:
            return
        held = self._per_source.get(source, 0) - 1
        if held > 0:
            self._per_source[source] = held
        else:
            self._per_source.pop(source, None)

    def lingering(self, connection: Evictable, source: str | None) -> None:
        """``connection`` was answered an error and waits out its linger time."""
        self.busy(connection, source)
        self._lingering.add(connection)

    def idle(self, connection: Evictable, source: str | None) -> None:
        """``connection`` (from ``source``) is between requests: now its most recently idle."""
        idle = self._idle.setdefault(source, {})
        idle.pop(connection, None)
        idle[connection] = None

    def busy(self, connection: Evictable, source: str | None) -> None:
        """``connection`` started its next request (or closes)."""
        idle = self._idle.get(source)
        if idle is not None and idle.pop(connection, 0) is None and not idle:
            del self._idle[source]

    def held_by(self, source: str) -> int:
        """How many connections ``source`` holds (for tests and diagnostics)."""
        return self._per_source.get(source, 0)
