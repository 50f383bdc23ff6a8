"""``router`` console script: settings from env and flags, then uvicorn with uvloop + httptools
(with the connection limits of ``router.server.http_limits``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from types import FrameType

import uvicorn
from pydantic import SecretStr

from registry.models import redact_url
from router.app import create_app
from router.observability.logs import configure_logging
from router.process_role import ProcessRole
from router.server.cli import parse_args, show_settings
from router.server.connection_caps import (
    auto_max_connections,
    default_per_source,
    raise_open_file_limit,
)
from router.server.cores import process_count
from router.server.doctor import doctor
from router.server.gc_schedule import collect_periodically, tune_gc
from router.server.http_limits import HttpLimits, limited_http_protocol
from router.server.lifecycle import RouterLifecycle
from router.server.listen_sockets import reserved_port
from router.server.supervisor import Supervisor, die_with_parent
from router.settings import RouterSettings

__all__ = ["main"]

logger = logging.getLogger("router")


# uvicorn's own cut-off comes this long after the router's (which ends streams cleanly)
_UVICORN_MARGIN_S = 5.0


class _RouterServer(uvicorn.Server):
    """uvicorn, plus the router's graceful shutdown: SIGTERM/SIGINT make the router unready at
    once and start its grace period (``RouterLifecycle``); the process exits 0 once done (plain
    uvicorn re-raises the signal after shutting down: exit status 143)."""

    def __init__(self, config: uvicorn.Config, lifecycle: RouterLifecycle, grace_s: float) -> None:
        super().__init__(config)
        self._lifecycle = lifecycle
        self._grace_s = grace_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        with contextlib.suppress(RuntimeError):  # no loop running: nothing in flight either
            loop = asyncio.get_running_loop()
            loop.call_soon_threadsafe(self._lifecycle.begin_shutdown, self._grace_s)
        super().handle_exit(sig, frame)

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        collector = asyncio.create_task(collect_periodically())  # router.server.gc_schedule: why
        try:
            await super().serve(sockets)
        finally:
            collector.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def _http_limits(settings: RouterSettings) -> HttpLimits:
    """The client connection limits; raises the open file limit first (the connection cap
    defaults to what it leaves room for)."""
    server = settings.server
    fd_limit = raise_open_file_limit()
    max_connections = server.max_connections or auto_max_connections(fd_limit)
    per_source = server.max_connections_per_source
    if per_source is None:
        per_source = default_per_source(max_connections)
    logger.info(
        "open file limit %d; at most %d client connections, %s per source",
        fd_limit,
        max_connections,
        per_source or "any number",
    )
    if max_connections > fd_limit:
        logger.warning(
            "--max-connections %d exceeds the open file limit %d", max_connections, fd_limit
        )
    return HttpLimits(
        max_header_bytes=server.max_header_bytes,
        header_timeout_s=server.header_timeout_s,
        body_timeout_s=server.body_timeout_s,
        max_connections=max_connections,
        max_connections_per_source=per_source,
    )


def _as_process(settings: RouterSettings, role: ProcessRole) -> RouterSettings:
    """The settings of one of ``router --workers N``'s processes: the supervisor's port (a
    port 0 resolved) and, when the router's registry is in memory, the supervisor's store."""
    server = settings.server.model_copy(update={"port": role.port, "workers": "1"})
    registry = settings.registry
    if role.registry_url is not None:
        token = SecretStr(role.registry_token) if role.registry_token else None
        registry = registry.model_copy(update={"url": role.registry_url, "store_token": token})
    return settings.model_copy(update={"server": server, "registry": registry})


def _client_socket(settings: RouterSettings, role: ProcessRole) -> socket.socket:
    """The process's client socket: the supervisor's (``--worker-sockets shared``), or its own
    bound with SO_REUSEPORT and not yet listening: the server listens once the app started
    (the lifespan: the workers known and probed once), so the kernel sends this process no
    connection before it can answer as its siblings do."""
    if role.listen_fd is not None:
        return socket.socket(fileno=role.listen_fd)
    return reserved_port(settings.server.host, role.port)


def main(argv: Sequence[str] | None = None) -> None:
    given = sys.argv[1:] if argv is None else list(argv)
    if given[:2] == ["config", "show"]:  # the effective settings, secrets redacted
        sys.stdout.write(show_settings(parse_args(given[2:])))
        return
    if given[:1] == ["doctor"]:  # ask a running router why routing does (not) work
        raise SystemExit(doctor(given[1:]))
    role = ProcessRole.take_from(os.environ)
    settings = parse_args(given)
    configure_logging(settings.logging.level)
    count = process_count(settings.server.workers)
    if role is None and count > 1:
        raise SystemExit(Supervisor(settings, count, given).run())
    if role is not None:
        die_with_parent(role.supervisor_pid)
        settings = _as_process(settings, role)
    logger.info(
        "pd-router: engine=%s prefill=%s decode=%s",
        settings.engine.value,
        [redact_url(w.url) for w in settings.prefill],
        [redact_url(w.url) for w in settings.decode],
    )
    app = create_app(settings, role)
    grace_s = settings.server.graceful_shutdown_s
    config = uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        loop="uvloop",
        http=limited_http_protocol(_http_limits(settings)),
        lifespan="on",
        access_log=False,
        proxy_headers=False,
        server_header=False,
        log_config=None,
        backlog=4096,
        timeout_keep_alive=75,
        timeout_graceful_shutdown=int(grace_s + _UVICORN_MARGIN_S),
    )
    tune_gc()
    sockets = None if role is None else [_client_socket(settings, role)]
    _RouterServer(config, app.lifecycle, grace_s).run(sockets)


if __name__ == "__main__":
    main()
