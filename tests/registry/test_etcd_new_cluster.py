"""An etcd replaced by a new, empty one on the same address (issue 21, item 4): revisions start
over, and a store that keeps following its old history would wait for the new cluster to pass
the old revision before any watch saw a change. The store starts over with the new history."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest

from registry.backends import RegistryStore, open_store
from registry.errors import RegistryUnavailable
from testkit.etcd_server import EtcdServer
from tests.registry.test_store_contract import watching

EVENT_TIMEOUT_S = 3.0
RECONNECT_S = 10.0


async def listed(store: RegistryStore) -> dict[str, bytes]:
    """The first listing the restarted etcd answers (the client reconnects within ~2 s)."""
    deadline = time.monotonic() + RECONNECT_S
    while True:
        try:
            return await store.list("w/")
        except RegistryUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


@pytest.mark.etcd
async def test_watch_after_a_fresh_etcd_sees_new_changes(private_etcd: EtcdServer) -> None:
    store = open_store(private_etcd.url + "/fresh")
    try:
        for index in range(20):  # the old cluster's history: revision 21
            await store.put(f"w/{index}", b"old")
        private_etcd.stop()
        shutil.rmtree(private_etcd.data_dir / "data")
        private_etcd.start()
        # Discovery's order: the watch first, then the list (which meets the new cluster)
        async with watching(store, "w/") as events:
            assert await listed(store) == {}
            await store.put("w/new", b"1")
            async with asyncio.timeout(EVENT_TIMEOUT_S):
                event = await anext(events)
        assert (event.kind, event.key, event.value) == ("put", "w/new", b"1")
    finally:
        await store.close()
