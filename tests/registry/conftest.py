"""Store fixtures: ``store`` runs each contract test against ``memory://`` and a real etcd.

The etcd server is started once per session (``etcd_server``); each test gets its own key prefix
(the store URL's path), so tests never see each other's keys. Tests that stop etcd use
``private_etcd``, a server of their own. Without the etcd binary these tests fail, naming the fix.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from registry.backends import RegistryStore, open_store
from tests.etcd_server import EtcdMissing, EtcdServer

BACKENDS = [pytest.param("memory"), pytest.param("etcd", marks=pytest.mark.etcd)]


def _started(server: EtcdServer) -> EtcdServer:
    try:
        server.start()
    except EtcdMissing as exc:
        missing = str(exc)
    else:
        return server
    server.close()
    pytest.fail(missing, pytrace=False)  # fail, never skip: a skipped etcd suite hides breakage


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    server = _started(EtcdServer())
    yield server
    server.close()


@pytest.fixture
def private_etcd() -> Iterator[EtcdServer]:
    """An etcd of the test's own, free to stop and restart."""
    server = _started(EtcdServer())
    yield server
    server.close()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def store_url(backend: str, request: pytest.FixtureRequest) -> str:
    if backend == "memory":
        return "memory://"
    server: EtcdServer = request.getfixturevalue("etcd_server")
    return f"{server.url}/pdr-test/{uuid.uuid4().hex}"


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[RegistryStore]:
    opened = open_store(store_url)
    yield opened
    await opened.close()
