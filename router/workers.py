"""Workers as the router sees them: address, layout, health and in-flight load."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum

import httpx

__all__ = ["Role", "Worker", "WorkerPool", "format_host"]

_ids = itertools.count(1)


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


def format_host(host: str) -> str:
    """A host as it goes into ``host:port`` strings: IPv6 literals in brackets."""
    return f"[{host}]" if ":" in host else host


@dataclass(eq=False, slots=True)
class Worker:
    """One engine instance. Mutable state is owned by the router's event loop (no locks)."""

    role: Role
    url: str
    bootstrap_port: int | None = None
    id: str = field(default_factory=lambda: f"w{next(_ids)}")
    healthy: bool = False
    consecutive_failures: int = 0
    inflight: int = 0
    dp_size: int = 1
    engine_ids: tuple[str, ...] = ()  # vLLM Mooncake: engine id per DP rank, from /query
    rank_inflight: list[int] = field(default_factory=lambda: [0])
    host: str = ""

    def __post_init__(self) -> None:
        self.host = format_host(httpx.URL(self.url).host)

    @property
    def bootstrap_addr(self) -> str:
        """``http://host:port`` of the prefill's bootstrap server."""
        return f"http://{self.host}:{self.bootstrap_port}"

    def set_layout(self, dp_size: int, engine_ids: tuple[str, ...] = ()) -> None:
        """Record the prefill's DP layout (from its bootstrap server)."""
        self.engine_ids = engine_ids
        if dp_size != self.dp_size:
            self.dp_size = dp_size
            self.rank_inflight = [0] * dp_size

    @contextmanager
    def load(self, rank: int = 0) -> Iterator[None]:
        """Count one in-flight request (and DP rank) for as long as the block runs."""
        self.inflight += 1
        ranks = self.rank_inflight
        rank_ok = rank < len(ranks)
        if rank_ok:
            ranks[rank] += 1
        try:
            yield
        finally:
            self.inflight -= 1
            if rank_ok:
                ranks[rank] -= 1

    def record_success(self) -> None:
        self.consecutive_failures = 0

    def record_failure(self, threshold: int) -> None:
        """A request failed at the transport or with 5xx; enough in a row mark it unhealthy."""
        self.consecutive_failures += 1
        if self.consecutive_failures >= threshold:
            self.healthy = False


class WorkerPool:
    """The set of prefill and decode workers the router may route to."""

    def __init__(self, prefill: list[Worker], decode: list[Worker], *, needs_engine_ids: bool):
        self.prefill = prefill
        self.decode = decode
        self._needs_engine_ids = needs_engine_ids

    def all(self) -> list[Worker]:
        return [*self.prefill, *self.decode]

    def available_prefill(self) -> list[Worker]:
        if self._needs_engine_ids:
            return [w for w in self.prefill if w.healthy and w.engine_ids]
        return [w for w in self.prefill if w.healthy]

    def available_decode(self) -> list[Worker]:
        return [w for w in self.decode if w.healthy]

    def ready(self) -> bool:
        return bool(self.available_prefill()) and bool(self.available_decode())
