"""Namespace ports: extra listening ports, one per registry namespace, serving the engines'
bootstrap APIs (``--bootstrap-namespace NAME=PORT``).

vLLM prefills (``bootstrap_server_address``) and SGLang decoders can only be pointed at a
``host:port``, so each prefill instance that registers with the router gets a port of its own
(``--bootstrap-namespace NAME=PORT``), answering at the engines' plain paths.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import uvicorn

from registry.engine_api import RankTables, namespace_app
from router.settings import RouterSettings

__all__ = ["namespace_servers"]

_START_TIMEOUT_S = 10.0


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server inside the router's loop; the router's own server owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _started(server: _EmbeddedServer, task: asyncio.Task[None], port: int) -> None:
    async with asyncio.timeout(_START_TIMEOUT_S):
        while not server.started:
            if task.done():
                raise RuntimeError(f"bootstrap namespace port {port} failed to start")
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def namespace_servers(tables: RankTables, settings: RouterSettings) -> AsyncIterator[None]:
    """Serve every configured namespace port while the block runs."""
    running: list[tuple[_EmbeddedServer, asyncio.Task[None]]] = []
    try:
        for namespace, port in settings.registry.bootstrap_ports.items():
            app = namespace_app(tables.sglang(namespace), tables.vllm(namespace))
            config = uvicorn.Config(
                app,
                host=settings.server.host,
                port=port,
                lifespan="off",
                http="httptools",
                log_config=None,
                access_log=False,
            )
            server = _EmbeddedServer(config)
            task = asyncio.create_task(server.serve())
            running.append((server, task))
            await _started(server, task, port)
        yield
    finally:
        for server, _ in running:
            server.should_exit = True
        await asyncio.gather(*(task for _, task in running), return_exceptions=True)
