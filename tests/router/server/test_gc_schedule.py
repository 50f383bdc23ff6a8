"""The router's cyclic garbage lives about a second (router/server/gc_schedule.py), not until 50,000
objects pile up: the health prober's and load monitor's httpx responses are reference cycles,
and the raised young-generation threshold alone let them grow the router's RSS for minutes.

Each test turns the automatic collector off, so only the router's own schedule can free the
garbage it makes."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from collections.abc import Iterator

import uvicorn

from router.__main__ import _RouterServer
from router.server.gc_schedule import collect_periodically
from router.server.lifecycle import RouterLifecycle
from testkit.polling import await_until
from testkit.servers import free_port


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _garbage() -> weakref.ref[_Cycle]:
    """A reference cycle nothing else holds: only a collection frees it."""
    return weakref.ref(_Cycle())


@contextlib.contextmanager
def _no_automatic_gc() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


async def _empty_app(scope: object, receive: object, send: object) -> None:
    return None


async def test_the_router_server_frees_cyclic_garbage_within_seconds() -> None:
    config = uvicorn.Config(
        _empty_app, host="127.0.0.1", port=free_port(), lifespan="off", log_config=None
    )
    server = _RouterServer(config, RouterLifecycle(), grace_s=0.1)
    with _no_automatic_gc():
        serving = asyncio.create_task(server.serve())
        try:
            await await_until(lambda: server.started, 10.0, "the server to start")
            garbage = _garbage()
            assert garbage() is not None  # not freed by reference counting
            await await_until(lambda: garbage() is None, 5.0, "the garbage to be collected")
        finally:
            server.should_exit = True
            await asyncio.wait_for(serving, 10.0)


async def test_long_lived_garbage_goes_at_the_periodic_full_collection() -> None:
    with _no_automatic_gc():
        cycle = _Cycle()
        gc.collect(1)
        gc.collect(1)  # survived two young collections: now in the oldest generation
        garbage = weakref.ref(cycle)
        del cycle
        collector = asyncio.create_task(collect_periodically(0.01, full_every=5))
        try:
            await await_until(lambda: garbage() is None, 5.0, "the full collection")
        finally:
            collector.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collector
