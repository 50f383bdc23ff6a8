"""An empty etcd does not empty the router (issue 21, item 4): a router on a real etcd, with a
command-line prefill and decode and two decodes added through the admin API, serves a bounded
load while the store is wiped (its prefix deleted, or etcd replaced by a fresh one on the same
port). Every request succeeds; the command-line workers stay and are registered again; the
last good set stays routable until the store shows workers again, or until the grace ends."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from registry.backends import open_store
from testkit.etcd_server import EtcdServer
from testkit.fake_cluster import FakeCluster, FakeClusterFactory
from testkit.fake_engine import FakeConfig, FakeEngine
from testkit.polling import wait_until
from testkit.servers import run_server

COMPLETION = {"model": "fake-model", "prompt": "an empty etcd must not matter", "max_tokens": 4}
MAX_REQUESTS = 3000
MAX_LOAD_S = 30.0


@dataclass
class Load:
    """A closed loop of completions on one thread, bounded in count and time."""

    url: str
    statuses: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        deadline = time.monotonic() + MAX_LOAD_S
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self.stop.is_set() and time.monotonic() < deadline:
                if len(self.statuses) >= MAX_REQUESTS:
                    return
                response = client.post("/v1/completions", json=COMPLETION)
                self.statuses.append(response.status_code)
                if response.status_code != 200:
                    self.failures.append(response.text[:200])


@contextlib.contextmanager
def under_load(url: str) -> Iterator[Load]:
    load = Load(url)
    thread = threading.Thread(target=load.run, name="load")
    thread.start()
    try:
        wait_until(lambda: len(load.statuses) >= 5, 10, "the load to start")
        yield load
    finally:
        load.stop.set()
        thread.join(timeout=MAX_LOAD_S + 10)
    assert not load.failures, (len(load.failures), len(load.statuses), load.failures[:3])


@dataclass
class Fleet:
    cluster: FakeCluster
    registry_url: str  # the router's store: etcd://127.0.0.1:PORT/pdr-test/<uuid>
    extra: list[FakeEngine]  # the decodes added through the admin API
    extra_urls: list[str]

    def ready(self) -> dict[str, Any]:
        return self.cluster.ready_body()

    def decode_urls(self) -> set[str]:
        return {w["url"] for w in self.ready()["decode"]}

    def stored_urls(self) -> set[str]:
        workers = httpx.get(self.cluster.router_url + "/admin/workers", timeout=5).json()
        return {w["url"] for w in workers["workers"]}

    def add(self, url: str) -> None:
        added = httpx.post(
            self.cluster.router_url + "/admin/workers",
            json={"role": "decode", "url": url},
            timeout=5,
        )
        assert added.status_code == 201, added.text


@pytest.fixture
def fleet(
    request: pytest.FixtureRequest, make_cluster: FakeClusterFactory, etcd: EtcdServer
) -> Iterator[Fleet]:
    grace_s: float = request.param
    registry: dict[str, Any] = {
        "url": f"{etcd.url}/pdr-test/{uuid.uuid4().hex}",
        "suspect_grace_s": grace_s,
    }
    cluster = make_cluster("sglang", registry=registry)
    extra = [FakeEngine("decode", "sglang", config=FakeConfig(kv_timeout=20.0)) for _ in range(2)]
    with contextlib.ExitStack() as stack:
        urls = [f"http://127.0.0.1:{stack.enter_context(run_server(e.app))}" for e in extra]
        running = Fleet(cluster, registry["url"], extra, urls)
        for url in urls:
            running.add(url)
        wait_until(lambda: len(running.decode_urls()) == 3, 5, "the added decodes to join")
        yield running


def wipe_prefix(fleet: Fleet) -> None:
    """Delete every key of the router's prefix, as ``etcdctl del --prefix`` would."""

    async def wipe() -> None:
        store = open_store(fleet.registry_url)
        try:
            for key in await store.list(""):
                await store.delete(key)
        finally:
            await store.close()

    asyncio.run(wipe())


def fresh_etcd(etcd: EtcdServer) -> None:
    """A new, empty etcd on the same port (a rebuilt cluster)."""
    etcd.stop()
    shutil.rmtree(etcd.data_dir / "data")
    etcd.start()


def registry_error(fleet: Fleet) -> str:
    error = fleet.ready()["registry"]["error"]
    return "" if error is None else str(error)


def served_by_extras(fleet: Fleet) -> int:
    return sum(len(engine.records) for engine in fleet.extra)


@pytest.mark.etcd
@pytest.mark.parametrize("fleet", [60.0], indirect=True)
def test_fresh_etcd_keeps_the_last_good_workers_until_they_register_again(
    fleet: Fleet, etcd: EtcdServer
) -> None:
    cluster = fleet.cluster
    static = {*cluster.prefill_urls, *cluster.decode_urls}
    with under_load(cluster.router_url):
        fresh_etcd(etcd)
        wait_until(lambda: "suspect" in registry_error(fleet), 10, "the store to be suspect")
        assert fleet.decode_urls() == {*cluster.decode_urls, *fleet.extra_urls}
        # the router's own (command-line) records are written to the new etcd again
        wait_until(lambda: static <= fleet.stored_urls(), 5, "the CLI workers re-registered")
        before = served_by_extras(fleet)
        wait_until(lambda: served_by_extras(fleet) > before + 2, 5, "the held decodes to serve")
        # one added decode registers again: the store shows workers, the other one leaves
        fleet.add(fleet.extra_urls[0])
        wait_until(lambda: fleet.ready()["registry"]["ok"] is True, 10, "the suspicion to end")
        assert fleet.decode_urls() == {*cluster.decode_urls, fleet.extra_urls[0]}
        assert fleet.ready()["prefill"][0]["url"] == cluster.prefill_urls[0]


@pytest.mark.etcd
@pytest.mark.parametrize("fleet", [1.5], indirect=True)
def test_wiped_prefix_is_believed_after_the_grace_but_cli_workers_stay(
    fleet: Fleet, etcd: EtcdServer
) -> None:
    cluster = fleet.cluster
    with under_load(cluster.router_url):
        wipe_prefix(fleet)
        wait_until(lambda: "suspect" in registry_error(fleet), 5, "the store to be suspect")
        assert fleet.decode_urls() == {*cluster.decode_urls, *fleet.extra_urls}
        # the grace is over: the store is believed, but the command-line workers are ours
        wait_until(lambda: fleet.decode_urls() == set(cluster.decode_urls), 10, "the grace")
        assert fleet.ready()["registry"]["ok"] is True
        assert [w["url"] for w in fleet.ready()["prefill"]] == cluster.prefill_urls
        assert {*cluster.prefill_urls, *cluster.decode_urls} <= fleet.stored_urls()
