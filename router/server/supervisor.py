"""``router --workers N``: the supervisor of N serving router processes on one host.

The supervisor serves no client. It
* holds what the processes share: with ``--registry memory://`` it serves a memory store over
  HTTP on a loopback port, behind a bearer token made at start (``registry.store_api``), and
  every process uses it as its registry (workers added through any process's admin REST, ranks
  registered through any process's bootstrap port, are every process's); a router given etcd,
  Kubernetes or a ``registry serve`` keeps using that;
* holds the host's load board (``router.load_board``: the in-flight legs and pending prefill
  tokens per worker rank, the admission units and body memory of every process), zeroing a
  process's share when it exits;
* holds the client port: ``reuseport`` (default) binds it with SO_REUSEPORT without listening
  (a port 0 is resolved once) and each process binds its own listening socket on it, so the
  kernel spreads new connections evenly; ``shared`` binds and listens once and each process
  inherits the socket;
* starts the processes (``python -m router`` with the same arguments and its ``ProcessRole``),
  restarts one that exits (after 0.5 s, doubling up to 10 s while it keeps failing within
  ``_STABLE_S``); a process that exits before it ever answered ends the whole router with its
  status (a bad flag, a port in use: restarting would not help);
* on SIGTERM or SIGINT sends each process SIGTERM once (each drains with ``--shutdown-grace``,
  as a router on its own does), waits for all, and exits 0; processes that outlive the grace
  period and uvicorn's margin get SIGKILL.

The processes run in a session of their own (a terminal's Ctrl-C reaches the supervisor only,
which passes it on once) and die with the supervisor (``die_with_parent``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import replace

from router.load_board import LoadBoard, board_path
from router.process_role import ROLE_ENV, ProcessRole
from router.server.listen_sockets import listening_socket, reserved_port
from router.server.store_server import served_memory_store
from router.settings import RouterSettings

__all__ = ["Supervisor", "die_with_parent"]

logger = logging.getLogger("router.supervisor")

_FIRST_BACKOFF_S = 0.5
_MAX_BACKOFF_S = 10.0
_STABLE_S = 30.0  # a process that ran this long starts over at the first back-off
_STOP_MARGIN_S = 10.0  # beyond the grace period and uvicorn's own margin
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when its parent (the supervisor) dies (Linux ``prctl``); exits at
    once if the parent is already gone."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:
        raise SystemExit("router process: its supervisor is gone")


class Supervisor:
    """Runs ``count`` router processes until SIGTERM/SIGINT; ``run()`` is the exit status."""

    def __init__(self, settings: RouterSettings, count: int, argv: Sequence[str]) -> None:
        self._settings = settings
        self._count = count
        self._argv = list(argv)
        self._stopping = asyncio.Event()
        self._processes: dict[int, asyncio.subprocess.Process] = {}
        self._failure: int | None = None
        self.restarts = 0

    def run(self) -> int:
        import uvloop

        return uvloop.run(self._main())

    def _pass_on_hangup(self) -> None:
        """SIGHUP (reread the API keys file) goes to every serving process."""
        for process in self._processes.values():
            if process.returncode is None:
                process.send_signal(signal.SIGHUP)

    async def _main(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        loop.add_signal_handler(signal.SIGHUP, self._pass_on_hangup)
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        run_dir = tempfile.mkdtemp(prefix="pd-router-", dir=shm)  # mode 0700
        LoadBoard.create(board_path(run_dir), self._count)
        try:
            async with self._shared_store() as (url, token):
                with self._client_socket() as (port, fd):
                    role = ProcessRole(
                        index=0,
                        count=self._count,
                        supervisor_pid=os.getpid(),
                        run_dir=run_dir,
                        port=port,
                        listen_fd=fd,
                        registry_url=url,
                        registry_token=token,
                    )
                    logger.info(
                        "pd-router: %d processes on port %d (%s sockets)",
                        self._count,
                        port,
                        "inherited" if fd is not None else "SO_REUSEPORT",
                    )
                    await self._supervise(role)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
        return self._failure or 0

    @contextlib.asynccontextmanager
    async def _shared_store(self) -> AsyncIterator[tuple[str | None, str | None]]:
        if self._settings.registry.url != "memory://":
            yield None, None  # etcd, a registry process: the processes share it already
            return
        token = secrets.token_urlsafe(32)
        async with served_memory_store(token, self._settings.server.max_body_bytes) as url:
            yield url, token

    @contextlib.contextmanager
    def _client_socket(self) -> Iterator[tuple[int, int | None]]:
        server = self._settings.server
        sock: socket.socket
        if server.worker_sockets == "shared":
            sock = listening_socket(server.host, server.port, reuse_port=False)
        else:
            sock = reserved_port(server.host, server.port)
        with sock:
            port = sock.getsockname()[1]
            yield port, sock.fileno() if server.worker_sockets == "shared" else None

    async def _supervise(self, role: ProcessRole) -> None:
        keepers = [
            asyncio.create_task(self._keep(replace(role, index=index)))
            for index in range(self._count)
        ]
        await self._stopping.wait()
        await self._stop_all()
        for keeper in keepers:
            keeper.cancel()
        await asyncio.gather(*keepers, return_exceptions=True)

    async def _start(self, role: ProcessRole) -> asyncio.subprocess.Process:
        python = [sys.executable] + (["-P"] if sys.flags.safe_path else [])
        return await asyncio.create_subprocess_exec(
            *python,
            "-m",
            "router",
            *self._argv,
            env={**os.environ, ROLE_ENV: role.to_env()},
            pass_fds=() if role.listen_fd is None else (role.listen_fd,),
            stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )

    async def _keep(self, role: ProcessRole) -> None:
        """Run process ``role.index`` until the supervisor stops, restarting it when it exits."""
        loop = asyncio.get_running_loop()
        backoff = _FIRST_BACKOFF_S
        answered_once = False
        while not self._stopping.is_set():
            started = loop.time()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(role.up_path(role.index))
            process = await self._start(role)
            self._processes[role.index] = process
            status = await process.wait()
            LoadBoard.clear(board_path(role.run_dir), role.count, role.index)
            answered_once = answered_once or _came_up(role)
            if self._stopping.is_set():
                return
            if not answered_once:
                logger.error(
                    "router process %d exited with status %s before it served: stopping",
                    role.index,
                    status,
                )
                self._failure = status if status > 0 else 1  # (killed by a signal: < 0)
                self._stopping.set()
                return
            backoff = _FIRST_BACKOFF_S if loop.time() - started > _STABLE_S else backoff
            self.restarts += 1
            logger.warning(
                "router process %d (pid %d) exited with status %s: restarting in %.1fs",
                role.index,
                process.pid,
                status,
                backoff,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF_S)

    async def _stop_all(self) -> None:
        """SIGTERM to every process once; SIGKILL to those still running past the grace."""
        running = [p for p in self._processes.values() if p.returncode is None]
        logger.info("stopping %d router processes", len(running))
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        grace_s = self._settings.server.graceful_shutdown_s + _STOP_MARGIN_S
        waits = [asyncio.ensure_future(process.wait()) for process in running]
        if not waits:
            return
        _, late = await asyncio.wait(waits, timeout=grace_s)
        for process in running:
            if process.returncode is None:
                logger.warning("router process pid %d did not stop: killed", process.pid)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
        if late:
            await asyncio.gather(*late, return_exceptions=True)


def _came_up(role: ProcessRole) -> bool:
    return os.path.exists(role.up_path(role.index))
