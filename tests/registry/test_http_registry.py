"""``http://`` stores: the registry process's ``/store`` API and ``HttpStore`` beyond the contract
suite (which runs over ``http`` too), and routers sharing workers through ``registry serve``.

Time-based tests poll with a deadline; the only sleep gives a wrong answer (a quiet watch
breaking) time to show up.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, Iterator
from functools import partial
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import SecretStr

from registry.__main__ import SHUTDOWN_GRACE_S
from registry.app import create_registry_app
from registry.backends import HttpStore, MemoryStore, RegistryStore, WatchEvent
from registry.errors import RegistryUnavailable
from registry.settings import RegistrySettings
from registry.store_api import store_routes
from router import create_app
from testkit.fake_cluster import settings_for
from testkit.polling import wait_until as wait_until_sync
from testkit.servers import free_port, http_process, run_server
from tests.registry.test_store_contract import brief, take, wait_until, watching


def _registry_app(**settings: Any) -> FastAPI:
    return create_registry_app(RegistrySettings(**settings))


# --- the registry server goes away ---------------------------------------------------------------


@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
async def test_watch_raises_when_the_registry_stops_and_store_recovers() -> None:
    port = free_port()
    store = HttpStore(f"http://127.0.0.1:{port}")
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(run_server(_registry_app(), port=port))
            events = store.watch("")
            await store.put("a", b"1")
            assert brief(await take(events, 1)) == [("put", "a", b"1")]
            await asyncio.to_thread(stack.close)  # stop the server off the event loop
        with pytest.raises(RegistryUnavailable):
            await take(events, 1)
        with pytest.raises(RegistryUnavailable):
            await store.get("a")
        with run_server(_registry_app(), port=port):  # a new registry: its memory store is empty

            async def answers() -> bool:
                with contextlib.suppress(RegistryUnavailable):
                    return await store.get("a") is None
                return False

            await wait_until(answers, "the store to reach the restarted registry")
            async with watching(store, "") as again:
                await store.put("b", b"2")
                assert brief(await take(again, 1)) == [("put", "b", b"2")]
    finally:
        await store.close()


async def test_watch_raises_when_the_registry_goes_quiet() -> None:
    """A registry that sent ``ready`` and then nothing, not even keepalives, is taken for dead."""
    hold = asyncio.Event()

    async def ready_then_silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        ready = b'{"kind":"ready"}\n'
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
            b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(ready), ready)
        )
        await writer.drain()
        await hold.wait()
        writer.close()

    server = await asyncio.start_server(ready_then_silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = HttpStore(f"http://127.0.0.1:{port}", idle_timeout=0.5)
    try:
        events = store.watch("")
        started = time.monotonic()
        with pytest.raises(RegistryUnavailable, match="no data"):
            await take(events, 1)
        assert 0.4 < time.monotonic() - started < 2
    finally:
        hold.set()
        await store.close()
        server.close()
        await server.wait_closed()


# --- keepalives and connection hygiene -----------------------------------------------------------


class CountingStore(MemoryStore):
    """A memory store that counts its open watches and the events they delivered."""

    def __init__(self) -> None:
        super().__init__()
        self.open_watches = 0
        self.delivered = 0

    def watch(self, prefix: str) -> AsyncGenerator[WatchEvent, None]:
        return self._counted(super().watch(prefix))

    async def _counted(
        self, events: AsyncGenerator[WatchEvent, None]
    ) -> AsyncGenerator[WatchEvent, None]:
        self.open_watches += 1
        try:
            async for event in events:
                self.delivered += 1
                yield event
        finally:
            self.open_watches -= 1
            await events.aclose()


@contextlib.contextmanager
def _store_server(store: RegistryStore, keepalive_s: float = 5.0) -> Iterator[str]:
    app = FastAPI()
    app.include_router(store_routes(lambda _: store, keepalive_s=keepalive_s))
    with run_server(app) as port:
        yield f"http://127.0.0.1:{port}"


async def test_keepalives_keep_a_quiet_watch_open() -> None:
    backing = MemoryStore()
    with _store_server(backing, keepalive_s=0.1) as url:
        store = HttpStore(url, idle_timeout=0.5)
        seen: list[WatchEvent] = []

        async def consume() -> None:
            async for event in store.watch(""):
                seen.append(event)

        consumer = asyncio.create_task(consume())
        try:
            await store.list("")  # the watch is established once this returns
            await asyncio.sleep(1.5)  # three idle timeouts: a watch without keepalives breaks
            assert not consumer.done()
            await backing.put("a", b"1")

            async def delivered() -> bool:
                return brief(seen) == [("put", "a", b"1")]

            await wait_until(delivered, "the event after the quiet spell")
        finally:
            consumer.cancel()
            await store.close()


async def test_closed_or_dropped_watches_release_the_registry_side() -> None:
    backing = CountingStore()
    with _store_server(backing) as url:
        store = HttpStore(url)

        async def open_watches_are(count: int) -> None:
            async def holds() -> bool:
                return backing.open_watches == count

            await wait_until(holds, f"{count} open watch(es) in the registry", timeout=3)

        try:
            started = store.watch("")
            await store.put("a", b"1")
            assert brief(await take(started, 1)) == [("put", "a", b"1")]
            unstarted = store.watch("")
            await store.list("")  # establishes it
            await open_watches_are(2)
            await started.aclose()
            await open_watches_are(1)
            del unstarted  # never iterated: dropping it closes its connection
            await open_watches_are(0)
        finally:
            await store.close()


async def test_server_side_watch_failure_reaches_the_client() -> None:
    class BrokenWatchStore(MemoryStore):
        def watch(self, prefix: str) -> AsyncGenerator[WatchEvent, None]:
            async def broken() -> AsyncGenerator[WatchEvent, None]:
                raise RegistryUnavailable("etcd watch broke: boom")
                yield  # an async generator

            return broken()

    with _store_server(BrokenWatchStore()) as url:
        store = HttpStore(url)
        try:
            with pytest.raises(RegistryUnavailable, match="boom"):
                await take(store.watch(""), 1)
        finally:
            await store.close()


# --- the wire: keys, auth, the wrong server ------------------------------------------------------


async def test_keys_with_url_special_characters_round_trip(registry_server: str) -> None:
    store = HttpStore(registry_server)
    keys = ["a b/c%2Fd", "q?x=1#frag", "dots/../x", "dots/./y", "..", "unicode/é", "trailing/"]
    try:
        async with watching(store, "") as events:
            for index, key in enumerate(keys):
                await store.put(key, str(index).encode())
            seen = await take(events, len(keys))
        assert [e.key for e in seen] == keys
        assert await store.list("") == {key: str(i).encode() for i, key in enumerate(keys)}
        for index, key in enumerate(keys):
            assert await store.get(key) == str(index).encode()
            assert await store.delete(key) is True
        assert await store.list("") == {}
    finally:
        await store.close()


async def test_store_api_takes_the_admin_token() -> None:
    with run_server(_registry_app(admin_token=SecretStr("s3cret"))) as port:
        url = f"http://127.0.0.1:{port}"
        anonymous, holder = HttpStore(url), HttpStore(url, token="s3cret")
        try:
            with pytest.raises(RegistryUnavailable, match="401"):
                await anonymous.get("a")
            with pytest.raises(RegistryUnavailable, match="401"):
                await take(anonymous.watch(""), 1)
            async with watching(holder, "") as events:
                await holder.put("a", b"1", ttl=30)
                assert brief(await take(events, 1)) == [("put", "a", b"1")]
            assert await holder.refresh("a") is True
        finally:
            await anonymous.close()
            await holder.close()


async def test_a_server_without_the_store_api_is_unavailable_not_empty() -> None:
    with run_server(FastAPI()) as port:
        store = HttpStore(f"http://127.0.0.1:{port}")
        try:
            with pytest.raises(RegistryUnavailable, match="no /store API"):
                await store.get("a")
            with pytest.raises(RegistryUnavailable, match="404"):
                await store.list("")
        finally:
            await store.close()


async def test_bad_ttl_is_a_value_error_before_any_io() -> None:
    store = HttpStore(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ValueError, match="ttl"):
        await store.put("a", b"1", ttl=-1)
    await store.close()


# --- end to end: two routers, one `registry serve` process ---------------------------------------


@contextlib.contextmanager
def _registry_process() -> Iterator[tuple[str, subprocess.Popen[str]]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable,
        "-m",
        "registry",
        "serve",
        "--store",
        "memory://",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    with http_process(argv, url) as process:
        yield url, process


def _router(stack: contextlib.ExitStack, registry: str) -> str:
    settings = settings_for("sglang", [], [], registry={"url": registry})
    return f"http://127.0.0.1:{stack.enter_context(run_server(create_app(settings)))}"


def _synced(router: str) -> bool:
    return httpx.get(router + "/ready", timeout=2).json()["registry"]["ok"] is True


def _decode_urls(router: str) -> set[str]:
    body: dict[str, Any] = httpx.get(router + "/ready", timeout=2).json()
    assert body["registry"]["ok"] is True, body["registry"]
    return {worker["url"] for worker in body["decode"]}


def test_two_routers_share_workers_through_a_registry_process() -> None:
    worker = f"http://127.0.0.1:{free_port()}"  # never answers: /ready lists it all the same
    with _registry_process() as (registry, process), contextlib.ExitStack() as routers:
        first, second = _router(routers, registry), _router(routers, registry)
        for router in (first, second):
            wait_until_sync(partial(_synced, router), 5, "the router to sync with the registry")
        added = httpx.post(
            first + "/admin/workers", timeout=5, json={"role": "decode", "url": worker}
        )
        assert added.status_code == 201, added.text
        wait_until_sync(
            lambda: worker in _decode_urls(second),
            2,
            "router B to list the worker added through router A",
        )
        assert httpx.get(registry + "/admin/workers").json()["workers"][0]["url"] == worker
        removed = httpx.delete(f"{second}/admin/workers/{added.json()['id']}", timeout=5)
        assert removed.status_code == 204
        wait_until_sync(
            lambda: worker not in _decode_urls(first),
            2,
            "router A to drop the worker removed through router B",
        )
        process.send_signal(signal.SIGTERM)  # routers still watching: they must not hold it up
        process.wait(timeout=SHUTDOWN_GRACE_S + 2)


def test_registry_serve_bounds_chunked_trailers_and_drops_them() -> None:
    """An endless trailer section on ``registry serve`` is cut (h11's 16 KiB bound on a head or
    trailer section) instead of being buffered without end."""
    head = (
        b"POST /admin/workers HTTP/1.1\r\nhost: registry\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n"
    )
    with _registry_process() as (url, _):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head)
            sent = 0
            with contextlib.suppress(OSError):  # the registry closes the connection on us
                while sent < 64 * 1024 * 1024:
                    sock.sendall(b"x-trailer-%d: %s\r\n" % (sent, b"v" * 1000))
                    sent += 1024
            answer = b""
            with contextlib.suppress(OSError):
                while chunk := sock.recv(65536):
                    answer += chunk
        assert sent < 16 * 1024 * 1024, "the trailers were read on and on"
        assert answer.startswith(b"HTTP/1.1 400 ") or answer == b"", answer[:200]
