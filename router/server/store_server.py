"""The registry store the processes of ``router --workers N`` share when the router's own is
``memory://``: the supervisor serves a memory store with the registry's own app
(``registry.app.create_registry_app``, its ``/store`` API) on a loopback port of its event loop,
behind a bearer token only the processes get (``ProcessRole.registry_token``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import uvicorn
from pydantic import SecretStr

from registry.app import create_registry_app
from registry.settings import RegistrySettings
from router.server.listen_sockets import listening_socket

__all__ = ["served_memory_store"]

_START_TIMEOUT_S = 10.0
_SHUTDOWN_GRACE_S = 1  # the processes' watch streams are cut, not waited for


class _EmbeddedServer(uvicorn.Server):
    """The supervisor owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def served_memory_store(token: str, max_body_bytes: int) -> AsyncIterator[str]:
    """A memory store served on 127.0.0.1 while the block runs; yields its URL."""
    settings = RegistrySettings(url="memory://", admin_token=SecretStr(token))
    sock = listening_socket("127.0.0.1", 0, reuse_port=False)
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        create_registry_app(settings, max_body_bytes=max_body_bytes),
        lifespan="on",
        http="h11",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=_SHUTDOWN_GRACE_S,
    )
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve([sock]))
    try:
        async with asyncio.timeout(_START_TIMEOUT_S):
            while not server.started:
                if task.done():
                    raise RuntimeError("the shared registry store did not start")
                await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.gather(task, return_exceptions=True)
        sock.close()
