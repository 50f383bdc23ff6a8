"""An ASGI app served by uvicorn on this event loop, on 127.0.0.1 at a port the OS chooses."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Generator
from typing import Literal

import uvicorn
from fastapi import FastAPI

from bench.common.process import LOOPBACK

__all__ = ["serve"]

STOP_GRACE_S = 5.0


class _QuietServer(uvicorn.Server):
    """Leaves signal handling alone: Ctrl-C reaches asyncio.run and every finally runs."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


@contextlib.asynccontextmanager
async def serve(
    app: FastAPI, start_timeout: float = 10.0, *, lifespan: Literal["on", "off"] = "off"
) -> AsyncIterator[int]:
    """Run ``app`` on uvicorn at 127.0.0.1 (an OS-chosen port) on this event loop; yields the
    port, stops the server on exit (forced after ``STOP_GRACE_S``)."""
    config = uvicorn.Config(
        app,
        host=LOOPBACK,
        port=0,
        lifespan=lifespan,
        log_config=None,
        log_level="warning",
        access_log=False,
    )
    server = _QuietServer(config)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(start_timeout):
            while not server.started:
                if task.done():
                    await task
                    raise RuntimeError("uvicorn stopped during start-up")
                await asyncio.sleep(0.005)
        yield int(server.servers[0].sockets[0].getsockname()[1])
    finally:
        server.should_exit = True
        done, _ = await asyncio.wait([task], timeout=STOP_GRACE_S)
        if not done:
            server.force_exit = True
            await asyncio.wait([task], timeout=STOP_GRACE_S)
