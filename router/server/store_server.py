"""The registry store the processes of ``router --workers N`` share when the router's own is
``memory://``: the supervisor serves a memory store with the registry's own app
(``registry.app.create_registry_app``, its ``/store`` API) on a loopback port of its event loop,
behind a bearer token only the processes get (``ProcessRole.registry_token``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import uvicorn
from pydantic import SecretStr

from registry.app import create_registry_app
from registry.settings import RegistrySettings
from router.server.bootstrap_listeners import EmbeddedServer, started
from router.server.listen_sockets import listening_socket

__all__ = ["served_memory_store"]

_SHUTDOWN_GRACE_S = 1  # the processes' watch streams are cut, not waited for


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
    server = EmbeddedServer(config)
    task = asyncio.create_task(server.serve([sock]))
    try:
        await started(server, task, "the shared registry store")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.gather(task, return_exceptions=True)
        sock.close()
