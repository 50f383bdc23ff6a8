"""A controllable clock for the in-memory windows, and a real Redis for the shared ones."""

from __future__ import annotations

from collections.abc import Iterator

import limits.aio.storage.memory
import pytest

import router.tenancy.limiter
import router.tenancy.windows
from testkit.redis_server import RedisMissing, RedisServer


class Clock:
    """Stands in for the ``time`` module where the limiter and ``limits``' memory storage
    read the wall clock: ``now`` moves only when a test moves it."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    for module in (limits.aio.storage.memory, router.tenancy.windows, router.tenancy.limiter):
        monkeypatch.setattr(module, "time", fake)
    return fake


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        server.start()
    except RedisMissing as exc:  # fail, never skip: a skipped test hides breakage
        server.close()
        pytest.fail(str(exc), pytrace=False)
    yield server
    server.close()
