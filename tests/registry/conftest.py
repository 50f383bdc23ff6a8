"""Store fixtures: ``store`` runs each contract test against ``memory://``, a real etcd, and a
standalone registry app over HTTP (``http://``, a ``memory://`` store behind it).

The etcd server is started once per session (``etcd_server``); each test gets its own key prefix
(the store URL's path), so tests never see each other's keys. Tests that stop etcd use
``private_etcd``, a server of their own. Without the etcd binary these tests fail, naming the fix.
Each ``http`` test gets a registry server of its own (``registry_server``, about 0.2 s).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from registry.app import create_registry_app
from registry.backends import RegistryStore, open_store
from registry.settings import RegistrySettings
from testkit.etcd_server import EtcdMissing, EtcdServer
from testkit.servers import run_server

BACKENDS = [
    pytest.param("memory"),
    pytest.param("etcd", marks=pytest.mark.etcd),
    pytest.param("http"),
]


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


@pytest.fixture
def registry_server() -> Iterator[str]:
    """A standalone registry (``memory://`` store) on 127.0.0.1; yields its URL."""
    with run_server(create_registry_app(RegistrySettings())) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def store_url(backend: str, request: pytest.FixtureRequest) -> str:
    if backend == "memory":
        return "memory://"
    if backend == "http":
        url: str = request.getfixturevalue("registry_server")
        return url
    server: EtcdServer = request.getfixturevalue("etcd_server")
    return f"{server.url}/pdr-test/{uuid.uuid4().hex}"


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[RegistryStore]:
    opened = open_store(store_url)
    yield opened
    await opened.close()
