"""Bootstrap listeners: the ports serving the engines' bootstrap APIs, never the client port.

Engines call the bootstrap APIs without credentials, so they are served only where engines
reach them, each on an embedded uvicorn server in the router's loop, bound to
``--bootstrap-host`` (default ``--host``):

* ``--bootstrap-port PORT``: the shared API (``registry.engine_api.shared_app``): namespace
  ``"default"`` on the engines' plain paths and every namespace under ``/bootstrap/{ns}/...``;
* ``--bootstrap-namespace NAME=PORT`` (repeat): one namespace on the plain paths
  (``namespace_app``): vLLM prefills (``bootstrap_server_address``) and SGLang decoders can only
  be pointed at a ``host:port``, so each prefill instance registering here gets a port.

Every listener enforces the same ``BootstrapProtection``: ``--bootstrap-allow`` (403),
``--max-body-bytes`` (413) and the registration checks, where a namespace owned by a prefill in
the pool (``WorkerSpec.bootstrap_namespace``, or a registry record naming it) only accepts ranks
on that prefill's host, and the client port's HTTP limits (``router.server.http_limits``: header
size and timeouts, trailers dropped, malformed requests answered 400) with connection caps of
their own per port (``MAX_CONNECTIONS``, half of them per source; engines hold a few connections
each). ``_server_config`` is the one place the listeners' uvicorn settings are made.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Collection, Iterator

import uvicorn
from fastapi import FastAPI

from registry.engine_api import (
    BootstrapProtection,
    OwnerHosts,
    RankTables,
    namespace_app,
    shared_app,
)
from router.server.connection_caps import default_per_source
from router.server.http_limits import HttpLimits, limited_http_protocol
from router.server.listen_sockets import listening_socket
from router.settings import RouterSettings
from router.upstream.base import UpstreamPool

__all__ = ["MAX_CONNECTIONS", "EmbeddedServer", "bootstrap_servers", "pool_owner_hosts", "started"]

_START_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 1024  # per bootstrap port (503 beyond, router.server.http_limits)


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server inside the router's loop; the router's own server owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _limits(settings: RouterSettings) -> HttpLimits:
    server = settings.server
    return HttpLimits(
        max_header_bytes=server.max_header_bytes,
        header_timeout_s=server.header_timeout_s,
        body_timeout_s=server.body_timeout_s,
        max_connections=MAX_CONNECTIONS,
        max_connections_per_source=default_per_source(MAX_CONNECTIONS),
    )


def _server_config(app: FastAPI, host: str, port: int, limits: HttpLimits) -> uvicorn.Config:
    """The uvicorn settings of every bootstrap listener."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="off",
        http=limited_http_protocol(limits),
        log_config=None,
        access_log=False,
        proxy_headers=False,  # the allow-list judges the peer address, never a header
        server_header=False,
    )


def pool_owner_hosts(pool: UpstreamPool) -> OwnerHosts:
    """Namespace -> the hosts of the pool's prefills registering under it (the guard's view)."""

    async def owner_hosts(namespace: str) -> Collection[str]:
        return {w.host for w in pool.prefill if w.bootstrap_namespace == namespace}

    return owner_hosts


def _apps(
    tables: RankTables, settings: RouterSettings, protection: BootstrapProtection
) -> list[tuple[int, FastAPI]]:
    registry = settings.registry
    apps = [
        (port, namespace_app(tables.sglang(namespace), tables.vllm(namespace), protection))
        for namespace, port in registry.bootstrap_ports.items()
    ]
    if registry.bootstrap_port is not None:
        apps.append((registry.bootstrap_port, shared_app(tables, protection)))
    return apps


async def started(server: EmbeddedServer, task: asyncio.Task[None], what: str) -> None:
    """Until ``server`` (run by ``task``) listens; RuntimeError naming ``what`` when it failed
    to start."""
    async with asyncio.timeout(_START_TIMEOUT_S):
        while not server.started:
            if task.done():
                raise RuntimeError(f"{what} failed to start")
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def bootstrap_servers(
    tables: RankTables,
    settings: RouterSettings,
    owner_hosts: OwnerHosts | None = None,
    *,
    reuse_port: bool = False,
) -> AsyncIterator[None]:
    """Serve the shared bootstrap port and every namespace port while the block runs;
    ``reuse_port``: each port bound with SO_REUSEPORT (``router --workers N``: every process
    serves them, over the one registry store they share)."""
    protection = BootstrapProtection.from_settings(
        settings.registry, settings.server.max_body_bytes, owner_hosts
    )
    host = settings.registry.bootstrap_host or settings.server.host
    running: list[tuple[EmbeddedServer, asyncio.Task[None]]] = []
    try:
        for port, app in _apps(tables, settings, protection):
            server = EmbeddedServer(_server_config(app, host, port, _limits(settings)))
            sockets = [listening_socket(host, port, reuse_port=True)] if reuse_port else None
            task = asyncio.create_task(server.serve(sockets))
            running.append((server, task))
            await started(server, task, f"bootstrap port {port}")
        yield
    finally:
        for server, _ in running:
            server.should_exit = True
        await asyncio.gather(*(task for _, task in running), return_exceptions=True)
