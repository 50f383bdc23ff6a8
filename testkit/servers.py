"""Real-socket uvicorn servers for tests, in the style of uvicorn's tests/utils.py.

`ASGITransport` buffers whole responses and skips lifespan, so timing, streaming and
disconnect tests run the app behind a real uvicorn on 127.0.0.1 with an OS-chosen port:

    with run_server(app) as port:
        ...  # http://127.0.0.1:{port}

    with run_servers(prefill.app, prefill.bootstrap_app, decode.app) as (p, b, d):
        ...  # several apps on one background event loop, stopped together (faster teardown)

    async with arun_server(app) as port:  # on the test's own event loop
        ...
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Generator, Iterator
from typing import Any, Literal

import httpx
import uvicorn

__all__ = [
    "arun_server",
    "bound_port",
    "free_port",
    "http_process",
    "run_server",
    "run_servers",
    "serving",
    "stop_process",
]


def stop_process(process: subprocess.Popen[Any], timeout: float = 15.0) -> None:
    """SIGTERM ``process`` if it still runs and reap it; SIGKILL it if it will not stop."""
    if process.poll() is None:
        process.terminate()
    try:
        process.communicate(timeout=timeout)  # also closes its pipes, if any
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


LifespanMode = Literal["auto", "on", "off"]
ASGIApp = Any  # any ASGI 3 application
SHUTDOWN_GRACE_S = 2
_SHUTDOWN_POLL_S = 0.005


class TestServer(uvicorn.Server):
    """A uvicorn server that leaves process signal handlers to pytest and stops as soon as it
    can: uvicorn notices ``should_exit`` on its next 0.1 s tick, then sleeps 0.1 s and polls its
    connections every 0.1 s, 0.1-0.2 s a server that a test's teardown waits for, server after
    server. Here setting ``should_exit`` (from any thread) wakes the main loop, and the
    shutdown polls every ``_SHUTDOWN_POLL_S``; what it waits for is uvicorn's."""

    __test__ = False  # not a pytest test class

    def __init__(self, config: uvicorn.Config) -> None:
        self._should_exit = False
        self._exit_wakeup: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        if value and self._exit_wakeup is not None:
            loop, event = self._exit_wakeup
            with contextlib.suppress(RuntimeError):  # its loop has closed: nothing to wake
                loop.call_soon_threadsafe(event.set)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def main_loop(self) -> None:
        """uvicorn's: ``on_tick`` every 0.1 s until it says to exit, and at once when told."""
        woken = asyncio.Event()
        self._exit_wakeup = (asyncio.get_running_loop(), woken)
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), 0.1)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown (no new connections, each open one asked to close once its
        response is out, then the lifespan's shutdown), its waits polled every
        ``_SHUTDOWN_POLL_S`` instead of every 0.1 s."""
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        state = self.server_state
        for connection in list(state.connections):
            connection.shutdown()
        try:
            async with asyncio.timeout(self.config.timeout_graceful_shutdown):
                while (state.connections or state.tasks) and not self.force_exit:  # noqa: ASYNC110 - uvicorn sets no event for these
                    await asyncio.sleep(_SHUTDOWN_POLL_S)
        except TimeoutError:
            for task in state.tasks:
                task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        if not self.force_exit:
            await self.lifespan.shutdown()


def make_server(app: ASGIApp, *, host: str, port: int, lifespan: LifespanMode) -> TestServer:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="asyncio",
        http="httptools",
        ws="none",
        lifespan=lifespan,
        log_level="warning",
        log_config=None,  # leave logging (and pytest's capture) alone
        access_log=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    return TestServer(config)


def bound_port(server: uvicorn.Server) -> int:
    """The port the OS gave a started server."""
    return int(server.servers[0].sockets[0].getsockname()[1])


async def _serve_all(servers: list[TestServer]) -> None:
    await asyncio.gather(*(server.serve() for server in servers))


def _run_thread(servers: list[TestServer], failures: list[BaseException]) -> None:
    try:
        asyncio.run(_serve_all(servers))
    except BaseException as exc:  # noqa: BLE001 - handed to the test thread, not swallowed
        failures.append(exc)


def _wait_started(
    servers: list[TestServer],
    thread: threading.Thread,
    failures: list[BaseException],
    timeout: float,
) -> None:
    deadline = time.monotonic() + timeout
    while not all(server.started for server in servers):
        if failures or not thread.is_alive():
            cause = failures[0] if failures else None
            raise RuntimeError("uvicorn server failed to start") from cause
        if time.monotonic() > deadline:
            raise TimeoutError(f"uvicorn server not started after {timeout}s")
        time.sleep(0.002)


def _stop(servers: list[TestServer], thread: threading.Thread) -> None:
    for server in servers:
        server.should_exit = True
    thread.join(timeout=SHUTDOWN_GRACE_S + 3)
    if thread.is_alive():
        for server in servers:
            server.force_exit = True
        thread.join(timeout=5)


@contextlib.contextmanager
def serving(servers: list[TestServer], start_timeout: float) -> Iterator[list[int]]:
    """Run ``servers`` on one loop in a thread; yields their ports once all listen."""
    failures: list[BaseException] = []
    thread = threading.Thread(
        target=_run_thread, args=(servers, failures), name="test-uvicorn", daemon=True
    )
    thread.start()
    try:
        _wait_started(servers, thread, failures, start_timeout)
        yield [bound_port(server) for server in servers]
    finally:
        _stop(servers, thread)


@contextlib.contextmanager
def run_server(
    app: ASGIApp,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    lifespan: LifespanMode = "on",
    start_timeout: float = 10.0,
) -> Iterator[int]:
    """Serve `app` on a daemon thread with its own event loop; yield the bound port."""
    server = make_server(app, host=host, port=port, lifespan=lifespan)
    with serving([server], start_timeout) as ports:
        yield ports[0]


@contextlib.contextmanager
def run_servers(
    *apps: ASGIApp,
    host: str = "127.0.0.1",
    lifespan: LifespanMode = "on",
    start_timeout: float = 10.0,
) -> Iterator[list[int]]:
    """Serve several apps (OS-chosen ports) on one background event loop; yield the ports."""
    servers = [make_server(app, host=host, port=0, lifespan=lifespan) for app in apps]
    with serving(servers, start_timeout) as ports:
        yield ports


@contextlib.asynccontextmanager
async def arun_server(
    app: ASGIApp,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    lifespan: LifespanMode = "on",
    start_timeout: float = 10.0,
) -> AsyncIterator[int]:
    """Serve `app` as a task on the running event loop; yield the bound port."""
    server = make_server(app, host=host, port=port, lifespan=lifespan)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(start_timeout):
            while not server.started:
                if task.done():
                    task.result()
                    raise RuntimeError("uvicorn server exited before it started")
                await asyncio.sleep(0.002)
        yield bound_port(server)
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(task, timeout=SHUTDOWN_GRACE_S + 3)
        except TimeoutError:
            server.force_exit = True


@contextlib.contextmanager
def http_process(
    argv: list[str],
    url: str,
    *,
    path: str = "/health",
    timeout: float = 20.0,
    env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen[str]]:
    """Run ``argv`` (stdout+stderr captured as text; ``env``: its environment) until
    ``url + path`` answers 200, then yield it; afterwards SIGTERM it if still running and reap it
    (SIGKILL if it will not stop)."""
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                if httpx.get(url + path, timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, process.communicate()[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {argv[2:4]} at {url}")
            time.sleep(0.01)
        yield process
    finally:
        stop_process(process)
