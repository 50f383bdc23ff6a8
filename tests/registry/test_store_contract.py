"""The ``RegistryStore`` contract (registry/backends/base.py), run against every backend.

``store`` is parametrized over ``memory``, ``etcd`` (a real etcd) and ``http`` (a registry app
over a memory store; see conftest.py, and test_http_registry.py for http-only tests). Tests that
only make sense for one backend say why where they are parametrized. Time-based tests poll with a
deadline; the only sleeps pace refreshes or give a wrong answer time to show up.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

import pytest

from registry.backends import (
    EtcdStore,
    HttpStore,
    MemoryStore,
    RegistryStore,
    WatchEvent,
    open_store,
)
from registry.backends.etcd import parse_etcd_url
from registry.errors import ConfigurationError, RegistryUnavailable
from testkit.etcd_server import EtcdServer, free_port

EXPIRY_TIMEOUT_S = 5.0  # ttl=1 expires after 1-1.5 s on etcd (it checks leases every 500 ms)
EVENT_TIMEOUT_S = 5.0

etcd_only = pytest.mark.parametrize("backend", [pytest.param("etcd", marks=pytest.mark.etcd)])


# --- helpers -------------------------------------------------------------------------------------


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], what: str, timeout: float = EXPIRY_TIMEOUT_S
) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


async def take(
    events: AsyncIterator[WatchEvent], count: int, timeout: float = EVENT_TIMEOUT_S
) -> list[WatchEvent]:
    async with asyncio.timeout(timeout):
        return [await anext(events) for _ in range(count)]


@contextlib.asynccontextmanager
async def watching(store: RegistryStore, prefix: str) -> AsyncIterator[AsyncIterator[WatchEvent]]:
    events = store.watch(prefix)
    assert isinstance(events, AsyncGenerator)
    try:
        yield events
    finally:
        await events.aclose()


def brief(events: list[WatchEvent]) -> list[tuple[str, str, bytes | None]]:
    return [(e.kind, e.key, e.value) for e in events]


def gone(store: RegistryStore, key: str) -> Callable[[], Awaitable[bool]]:
    async def predicate() -> bool:
        return await store.get(key) is None

    return predicate


# --- put / get / list / delete -------------------------------------------------------------------


async def test_get_missing_key_is_none(store: RegistryStore) -> None:
    assert await store.get("workers/nobody") is None


async def test_put_creates_and_replaces(store: RegistryStore) -> None:
    await store.put("workers/a", b"one")
    assert await store.get("workers/a") == b"one"
    await store.put("workers/a", b"two")
    assert await store.get("workers/a") == b"two"


async def test_values_are_opaque_bytes(store: RegistryStore) -> None:
    await store.put("bin", b"\x00\xff\x80")
    await store.put("empty", b"")
    assert await store.get("bin") == b"\x00\xff\x80"
    assert await store.get("empty") == b""


async def test_list_returns_live_keys_under_prefix(store: RegistryStore) -> None:
    for key in ("workers/a", "workers/b", "workersX/c", "ranks/d"):
        await store.put(key, key.encode())
    assert await store.list("workers/") == {"workers/a": b"workers/a", "workers/b": b"workers/b"}
    assert await store.list("workers") == {
        "workers/a": b"workers/a",
        "workers/b": b"workers/b",
        "workersX/c": b"workersX/c",
    }
    assert set(await store.list("")) == {"workers/a", "workers/b", "workersX/c", "ranks/d"}
    assert await store.list("nothing/") == {}


async def test_delete_reports_whether_a_key_was_removed(store: RegistryStore) -> None:
    await store.put("workers/a", b"1")
    await store.put("workers/ab", b"2")
    assert await store.delete("workers/a") is True
    assert await store.get("workers/a") is None
    assert await store.get("workers/ab") == b"2"  # delete is exact, not by prefix
    assert await store.delete("workers/a") is False
    assert await store.delete("never/was") is False


# --- leases --------------------------------------------------------------------------------------


async def test_ttl_key_expires(store: RegistryStore) -> None:
    await store.put("lease/a", b"permanent at first")
    await store.put("lease/a", b"1", ttl=1)
    await store.put("keep", b"k")
    assert await store.get("lease/a") == b"1"
    await wait_until(gone(store, "lease/a"), "the ttl key to expire")
    assert await store.list("") == {"keep": b"k"}
    assert await store.refresh("lease/a") is False


async def test_expiry_arrives_as_delete_event(store: RegistryStore) -> None:
    async with watching(store, "lease/") as events:
        await store.put("lease/a", b"1", ttl=1)
        put, expiry = await take(events, 2)
    assert (put.kind, put.key, put.value) == ("put", "lease/a", b"1")
    assert (expiry.kind, expiry.key, expiry.value) == ("delete", "lease/a", None)
    assert expiry.revision > put.revision
    assert await store.get("lease/a") is None


async def test_refresh_keeps_key_alive_past_its_ttl(store: RegistryStore) -> None:
    await store.put("lease/a", b"1", ttl=1)
    started = time.monotonic()
    while time.monotonic() - started < 2.0:  # twice the ttl, past etcd's 500 ms expiry tick
        assert await store.refresh("lease/a") is True
        assert await store.get("lease/a") == b"1"
        await asyncio.sleep(0.2)  # paces the heartbeat
    await wait_until(gone(store, "lease/a"), "the key to expire once refreshes stop")
    assert await store.refresh("lease/a") is False


async def test_refresh_is_false_without_a_lease(store: RegistryStore) -> None:
    assert await store.refresh("missing") is False
    await store.put("permanent", b"1")
    assert await store.refresh("permanent") is False
    await store.put("deleted", b"1", ttl=30)
    assert await store.delete("deleted") is True
    assert await store.refresh("deleted") is False


async def test_put_without_ttl_makes_a_leased_key_permanent(store: RegistryStore) -> None:
    await store.put("lease/a", b"1", ttl=1)
    await store.put("lease/a", b"2")
    await store.put("control", b"c", ttl=1)  # granted last: once it is gone, so is the old ttl
    await wait_until(gone(store, "control"), "the control key to expire")
    assert await store.get("lease/a") == b"2"
    assert await store.refresh("lease/a") is False


async def test_put_with_ttl_replaces_the_old_lease(store: RegistryStore) -> None:
    await store.put("lease/a", b"1", ttl=30)
    await store.put("lease/a", b"2", ttl=1)
    await wait_until(gone(store, "lease/a"), "the key to expire on its new ttl")


async def test_non_positive_ttl_is_rejected(store: RegistryStore) -> None:
    with pytest.raises(ValueError, match="ttl"):
        await store.put("a", b"1", ttl=0)
    assert await store.get("a") is None


# --- watch ---------------------------------------------------------------------------------------


async def test_watch_sees_puts_and_deletes_in_order_under_its_prefix(store: RegistryStore) -> None:
    async with watching(store, "workers/") as events:  # a fresh store: nothing seen yet
        await store.put("workers/a", b"1")
        await store.put("ranks/x", b"not watched")
        await store.put("workers/b", b"2")
        await store.put("workers/a", b"3")
        await store.delete("workers/a")
        await store.delete("ranks/x")
        await store.put("workers/c", b"4")
        seen = await take(events, 5)
    assert brief(seen) == [
        ("put", "workers/a", b"1"),
        ("put", "workers/b", b"2"),
        ("put", "workers/a", b"3"),
        ("delete", "workers/a", None),
        ("put", "workers/c", b"4"),
    ]
    revisions = [e.revision for e in seen]
    assert revisions == sorted(set(revisions))


async def test_watch_starts_after_existing_state(store: RegistryStore) -> None:
    await store.put("workers/old", b"0")
    await store.delete("workers/gone")
    assert await store.list("workers/") == {"workers/old": b"0"}
    async with watching(store, "workers/") as events:
        await store.put("workers/new", b"1")
        (first,) = await take(events, 1)
    assert brief([first]) == [("put", "workers/new", b"1")]


async def test_watches_are_independent(store: RegistryStore) -> None:
    async with watching(store, "a/") as a_events, watching(store, "") as all_events:
        await store.put("a/1", b"1")
        await store.put("b/1", b"2")
        assert brief(await take(a_events, 1)) == [("put", "a/1", b"1")]
        assert brief(await take(all_events, 2)) == [("put", "a/1", b"1"), ("put", "b/1", b"2")]


async def test_close_ends_open_watches(store: RegistryStore) -> None:
    # List first: the consumer task creates the stream while the put below is in flight, and a
    # store that has seen no revision yet watches only "from then on" (see the etcd module doc).
    assert await store.list("") == {}
    events = store.watch("")
    seen: list[WatchEvent] = []

    async def consume() -> None:
        async for event in events:
            seen.append(event)

    consumer = asyncio.create_task(consume())
    await store.put("a", b"1")

    async def consumed() -> bool:
        return len(seen) == 1

    await wait_until(consumed, "the watch to deliver the first event")
    await store.close()
    async with asyncio.timeout(3):
        await consumer  # ends without an error
    assert brief(seen) == [("put", "a", b"1")]


async def test_closed_store_raises_and_new_watches_end(store: RegistryStore) -> None:
    await store.close()
    with pytest.raises(RegistryUnavailable):
        await store.get("a")
    with pytest.raises(RegistryUnavailable):
        await store.put("a", b"1")
    assert [event async for event in store.watch("")] == []
    await store.close()  # idempotent


# --- memory only: the injectable clock -----------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_memory_expiry_follows_the_injected_clock() -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    await store.put("a", b"1", ttl=10)
    clock.now += 9
    assert await store.refresh("a") is True
    clock.now += 9
    assert await store.get("a") == b"1"
    clock.now += 1
    assert await store.get("a") is None  # expired keys vanish at once, reaper or not
    await store.close()


async def test_memory_expiry_event_is_delivered_promptly_without_calls() -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    async with watching(store, "") as events:
        await store.put("a", b"1", ttl=10)
        await take(events, 1)
        clock.now += 10
        started = time.monotonic()
        (expiry,) = await take(events, 1, timeout=1)
        assert time.monotonic() - started < 0.2
    assert brief([expiry]) == [("delete", "a", None)]
    await store.close()


# --- etcd only -----------------------------------------------------------------------------------


@etcd_only  # two memory:// stores never share data: there is nothing to test for memory
async def test_two_stores_on_one_etcd_see_each_others_writes(
    store: RegistryStore, store_url: str
) -> None:
    other = open_store(store_url)
    try:
        async with watching(other, "workers/") as events:
            await store.put("workers/a", b"1", ttl=1)
            assert await other.get("workers/a") == b"1"
            assert await other.refresh("workers/a") is True  # the lease is found through etcd
            assert await other.list("workers/") == {"workers/a": b"1"}
            await store.put("workers/b", b"2")
            seen = await take(events, 3)  # puts of a and b, then a's expiry
        assert brief(seen) == [
            ("put", "workers/a", b"1"),
            ("put", "workers/b", b"2"),
            ("delete", "workers/a", None),
        ]
        assert await other.delete("workers/b") is True
        assert await store.get("workers/b") is None
    finally:
        await other.close()


@etcd_only
async def test_store_prefix_isolates_and_is_hidden(store: RegistryStore, store_url: str) -> None:
    sibling = open_store(store_url + "-sibling")  # shares the string prefix, not the path
    try:
        await store.put("a", b"1")
        await sibling.put("a", b"2")
        assert await store.list("") == {"a": b"1"}
        assert await sibling.list("") == {"a": b"2"}
    finally:
        await sibling.close()


@pytest.mark.parametrize("scheme", [pytest.param("etcd", marks=pytest.mark.etcd), "http"])
@pytest.mark.parametrize("op", ["get", "put", "list", "delete", "refresh", "watch"])
async def test_unreachable_store_raises_registry_unavailable_fast(scheme: str, op: str) -> None:
    store = open_store(f"{scheme}://127.0.0.1:{free_port()}")  # nothing listens there
    started = time.monotonic()
    with pytest.raises(RegistryUnavailable):
        await call_op(store, op)
    assert time.monotonic() - started < 3
    await store.close()


_SILENT_STORES: dict[str, Callable[[int], RegistryStore]] = {
    "etcd": lambda port: EtcdStore("127.0.0.1", port, timeout=0.5),
    "http": lambda port: HttpStore(f"http://127.0.0.1:{port}", timeout=0.5),
}


@pytest.mark.parametrize("scheme", [pytest.param("etcd", marks=pytest.mark.etcd), "http"])
async def test_silent_store_hits_the_call_deadline(scheme: str) -> None:
    with socket.socket() as listener:  # accepts TCP connections (backlog), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        store = _SILENT_STORES[scheme](listener.getsockname()[1])
        for op in ("get", "put", "watch"):
            started = time.monotonic()
            with pytest.raises(RegistryUnavailable):
                await call_op(store, op)
            assert time.monotonic() - started < 2
        await store.close()


async def call_op(store: RegistryStore, op: str) -> object:
    """Run store operation ``op`` with fixed arguments."""
    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "get": lambda: store.get("a"),
        "put": lambda: store.put("a", b"1", ttl=5),
        "list": lambda: store.list(""),
        "delete": lambda: store.delete("a"),
        "refresh": lambda: store.refresh("a"),
        "watch": lambda: anext(store.watch("")),
    }
    return await calls[op]()


@pytest.mark.etcd
async def test_watch_raises_when_etcd_stops_and_store_recovers(private_etcd: EtcdServer) -> None:
    store = open_store(private_etcd.url + "/recovery")
    try:
        events = store.watch("")
        await store.put("a", b"1")
        assert brief(await take(events, 1)) == [("put", "a", b"1")]
        private_etcd.stop()
        with pytest.raises(RegistryUnavailable):
            await take(events, 1)
        with pytest.raises(RegistryUnavailable):
            await store.get("a")
        private_etcd.start()

        async def answers() -> bool:
            with contextlib.suppress(RegistryUnavailable):
                return await store.get("a") == b"1"
            return False

        await wait_until(answers, "the store to reconnect to the restarted etcd")
        async with watching(store, "") as again:  # re-watch from the last revision seen
            await store.put("b", b"2")
            assert brief(await take(again, 1)) == [("put", "b", b"2")]
    finally:
        await store.close()


@pytest.mark.etcd
async def test_watch_raises_when_etcd_hangs(private_etcd: EtcdServer) -> None:
    store = EtcdStore("127.0.0.1", private_etcd.client_port, prefix="/hang", keepalive=1.0)
    try:
        events = store.watch("")
        await store.put("a", b"1")
        assert brief(await take(events, 1)) == [("put", "a", b"1")]
        private_etcd.pause()  # the TCP connection stays up; only keepalive pings can tell
        started = time.monotonic()
        with pytest.raises(RegistryUnavailable):
            await take(events, 1)
        assert time.monotonic() - started < 4
    finally:
        private_etcd.resume()
        await store.close()


# --- open_store ----------------------------------------------------------------------------------


async def test_open_store_picks_the_backend_by_scheme() -> None:
    memory = open_store("memory://")
    etcd = open_store("etcd://127.0.0.1:1/custom/prefix/")  # no I/O until the first call
    http = open_store("http://127.0.0.1:1")
    https = open_store("https://registry.example:8443/behind/a/proxy/")
    assert isinstance(memory, MemoryStore)
    assert isinstance(etcd, EtcdStore)
    assert isinstance(http, HttpStore)
    assert isinstance(https, HttpStore)
    assert open_store("memory://") is not memory
    for store in (memory, etcd, http, https):
        await store.close()


@pytest.mark.parametrize("url", ["redis://localhost", "localhost:2379", "", "memory:"])
def test_open_store_rejects_unknown_schemes(url: str) -> None:
    with pytest.raises(ConfigurationError, match="memory://, etcd://"):
        open_store(url)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("memory://somewhere", "memory:// takes no"),
        ("etcd://", "no host"),
        ("etcd://host:port", "bad port"),
        ("etcd://user:secret@host", "credentials"),
        ("etcd://h1:2379,h2:2379", "one endpoint"),
        ("etcd://host?timeout=2", "no query"),
        ("http://", "no host"),
        ("http://host:port", "bad port"),
        ("https://user:secret@host", "credentials"),
        ("http://host?token=secret", "no query"),
    ],
)
def test_open_store_rejects_malformed_urls(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as info:
        open_store(url)
    assert "secret" not in str(info.value)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("etcd://10.0.0.5", ("10.0.0.5", 2379, "/pdr")),
        ("etcd://etcd.local:2380/", ("etcd.local", 2380, "/pdr")),
        ("etcd://h:1/a/b/", ("h", 1, "/a/b")),
        ("etcd://[::1]:2379/x", ("::1", 2379, "/x")),
    ],
)
def test_parse_etcd_url(url: str, expected: tuple[str, int, str]) -> None:
    assert parse_etcd_url(url) == expected


def test_missing_aetcd_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "aetcd", None)  # makes `import aetcd` raise ImportError
    with pytest.raises(ConfigurationError, match="pip install aetcd"):
        open_store("etcd://localhost")


def test_registry_imports_without_aetcd() -> None:
    code = (
        "import sys; sys.modules['aetcd'] = None; "
        "import registry, registry.backends; registry.backends.open_store('memory://')"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
