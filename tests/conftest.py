"""Fixtures: fake engines and the router, each a real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

from testkit.etcd_server import EtcdMissing, EtcdServer
from testkit.fake_cluster import FakeClusterFactory, fake_cluster_factory


@pytest.fixture
def make_cluster() -> Iterator[FakeClusterFactory]:
    """``make_cluster(engine, prefill=1, decode=1, dp_size=1, config=..., **router_overrides)``."""
    with contextlib.ExitStack() as stack:
        yield fake_cluster_factory(stack)


# The real-engine suite needs its own engine environments: only ``scripts/test-real-engines``
# (which sets PDR_REAL_ENGINES=1) collects it.
collect_ignore_glob = [] if os.environ.get("PDR_REAL_ENGINES") == "1" else ["real_engines/*"]


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    server = EtcdServer()
    try:
        server.start()
    except EtcdMissing as exc:  # fail, never skip: a skipped etcd test hides breakage
        server.close()
        pytest.fail(str(exc), pytrace=False)
    yield server
    server.close()
