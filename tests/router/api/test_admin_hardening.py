"""The admin API and worker discovery under hostile or broken input (issue 11: 3, 8, 12, 15).

A bad worker URL is refused by the admin API and, when it reaches the store anyway (an older
version wrote it, or someone wrote the store directly), skipped by discovery without stopping it;
admin-added workers may not live at link-local or unspecified addresses; worker credentials never
show; auth runs before the body is read and bodies are bounded (the registry's /store too); a
client gone mid-body ends quietly (no ERROR, no traceback); a store outage is a 503 JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import socket
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from registry.app import create_registry_app
from registry.backends import open_store
from registry.models import WorkerRecord, encode_worker, worker_key
from registry.settings import RegistrySettings
from router import create_app
from router.server.http_limits import HttpLimits, limited_http_protocol
from testkit.etcd_server import EtcdServer
from testkit.fake_cluster import FakeClusterFactory, settings_for
from testkit.fake_engine import FakeEngine
from testkit.polling import wait_until
from testkit.servers import TestServer, run_server, run_servers, serving
from tests.router.pipeline.test_protocols import COMPLETION

TOKEN = {"authorization": "Bearer s3cret"}
HUGE = 300 * 1024 * 1024  # the 300 MB body, declared but never sent
SECRET = "hunter2"


def _store_url(etcd: EtcdServer) -> str:
    return f"{etcd.url}/pdr-test/{uuid.uuid4().hex}"


def _put_raw_record(store_url: str, record: WorkerRecord) -> None:
    """Write a worker record straight into the store, past every check of the admin API."""

    async def put() -> None:
        store = open_store(store_url)
        try:
            await store.put(worker_key(record.id), encode_worker(record))
        finally:
            await store.close()

    asyncio.run(put())


def _post_declared(
    port: int, path: str, length: int, headers: dict[str, str], *, method: str = "POST"
) -> tuple[int, Any]:
    """POST announcing ``length`` body bytes and sending none: a server that reads the body
    before answering never answers (the 5 s socket timeout fails the test)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.putrequest(method, path)
        for name, value in {"content-type": "application/json", **headers}.items():
            connection.putheader(name, value)
        connection.putheader("content-length", str(length))
        connection.endheaders()
        response = connection.getresponse()
        return response.status, httpx.Response(200, content=response.read()).json()
    finally:
        connection.close()


def _error_message(response: httpx.Response) -> str:
    assert response.headers["content-type"].startswith("application/json"), response.text
    message: str = response.json()["error"]["message"]
    return message


def _urls(body: dict[str, Any], role: str) -> list[str]:
    return [w["url"] for w in body[role]]


# -- item 3: a bad worker URL --------------------------------------------------------------------


def test_admin_refuses_an_unparseable_url(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang")
    with cluster.client() as client:
        for url in ("https://[::1", "http://a:99999", "http://a b:1", "http:///x"):
            response = client.post("/admin/workers", json={"role": "decode", "url": url})
            assert response.status_code == 400, (url, response.text)
            assert "url" in _error_message(response)
        listed = client.get("/admin/workers").json()["workers"]
        assert len(listed) == 2  # the CLI prefill and decode only


@pytest.mark.etcd
def test_a_bad_record_in_the_store_does_not_stop_discovery(
    make_cluster: FakeClusterFactory, etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    store_url = _store_url(etcd)
    # one written before the router starts (it reads it on every start), one while it runs
    _put_raw_record(store_url, WorkerRecord(id="d-old", role="decode", url="https://[::1"))
    caplog.set_level(logging.WARNING, logger="router.fleet.discovery")
    cluster = make_cluster("sglang", registry={"url": store_url})
    _put_raw_record(store_url, WorkerRecord(id="d-new", role="decode", url="http://a:99999"))
    extra = FakeEngine("decode", "sglang")
    with run_server(extra.app) as port, cluster.client() as client:
        url = f"http://127.0.0.1:{port}"
        added = client.post("/admin/workers", json={"role": "decode", "url": url})
        assert added.status_code == 201, added.text
        wait_until(lambda: url in _urls(cluster.ready_body(), "decode"), 5, "the added decode")
        assert client.delete(f"/admin/workers/{added.json()['id']}").status_code == 204
        wait_until(
            lambda: url not in _urls(cluster.ready_body(), "decode"), 5, "the removal to apply"
        )
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    skipped = [r.getMessage() for r in caplog.records if r.name == "router.fleet.discovery"]
    for bad_id in ("d-old", "d-new"):
        about = [m for m in skipped if bad_id in m]
        assert len(about) == 1 and "url" in about[0].lower(), skipped


# -- item 15: which addresses, and whose credentials ---------------------------------------------


REFUSED = [
    ("http://169.254.169.254/", "link-local"),
    ("http://[fe80::1]:8000", "link-local"),
    ("http://[::ffff:169.254.169.254]:80", "link-local"),
    ("http://2852039166/", "link-local"),  # 169.254.169.254 as getaddrinfo reads it
    ("http://0.0.0.0:8000", "unspecified"),
    ("http://[::]:8000", "unspecified"),
]


def test_admin_refuses_link_local_and_unspecified_addresses(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("sglang")
    with cluster.client() as client:
        for url, why in REFUSED:
            response = client.post("/admin/workers", json={"role": "decode", "url": url})
            assert response.status_code == 400, (url, response.text)
            assert why in _error_message(response), url
        assert len(client.get("/admin/workers").json()["workers"]) == 2


@contextlib.contextmanager
def _router_with_cli_workers(prefill_host: str, decode_userinfo: str) -> Iterator[str]:
    prefill, decode = FakeEngine("prefill", "sglang"), FakeEngine("decode", "sglang")
    with run_servers(prefill.app, prefill.bootstrap_app, decode.app) as (p, b, d):
        settings = settings_for(
            "sglang",
            [(f"http://{prefill_host}:{p}", b)],
            [f"http://{decode_userinfo}@127.0.0.1:{d}"],
        )
        with run_server(create_app(settings)) as port:
            url = f"http://127.0.0.1:{port}"
            wait_until(lambda: httpx.get(url + "/ready").status_code == 200, 10, "ready")
            yield url


def test_cli_workers_may_use_an_unspecified_address_admin_ones_may_not() -> None:
    with _router_with_cli_workers("0.0.0.0", "u:p") as url:  # the operator typed it: it works
        assert httpx.post(url + "/v1/completions", json=COMPLETION, timeout=10).status_code == 200
        body = {"role": "prefill", "url": "http://0.0.0.0:1", "bootstrap_port": 2}
        refused = httpx.post(url + "/admin/workers", json=body)
        assert refused.status_code == 400 and "unspecified" in _error_message(refused)


def test_worker_credentials_never_show(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="router")  # health probes log at DEBUG and INFO
    with _router_with_cli_workers("127.0.0.1", f"admin:{SECRET}") as url:
        assert httpx.post(url + "/v1/completions", json=COMPLETION, timeout=10).status_code == 200
        ready = httpx.get(url + "/ready")
        assert ready.json()["decode"][0]["url"].startswith("http://***@127.0.0.1:")
        added = httpx.post(
            url + "/admin/workers",
            json={"role": "decode", "url": f"http://ops:{SECRET}@127.0.0.1:1"},
        )
        assert added.status_code == 201 and SECRET not in added.text
        for shown in (ready, httpx.get(url + "/admin/workers"), httpx.get(url + "/admin/layout")):
            assert shown.status_code == 200 and SECRET not in shown.text, shown.text
    assert any(
        "***@" in r.getMessage() for r in caplog.records if r.name == "router.fleet.discovery"
    )
    healthy = [r.getMessage() for r in caplog.records if "is now healthy" in r.getMessage()]
    assert any(line.startswith("decode worker http://***@") for line in healthy), healthy
    assert not [r for r in caplog.records if SECRET in r.getMessage()]


# -- item 8 (admin half): auth first, bounded bodies ---------------------------------------------


def test_admin_checks_the_token_before_reading_the_body(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang", registry={"admin_token": "s3cret"})
    port = int(cluster.router_url.rsplit(":", 1)[1])
    malformed = httpx.post(cluster.router_url + "/admin/workers", content=b"{bad")
    assert malformed.status_code == 401, malformed.text
    status, body = _post_declared(port, "/admin/workers", HUGE, {})
    assert status == 401 and body["error"]["message"]


def test_admin_bodies_are_bounded(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang", registry={"admin_token": "s3cret"})
    port = int(cluster.router_url.rsplit(":", 1)[1])
    status, body = _post_declared(port, "/admin/workers", HUGE, TOKEN)
    assert status == 413 and "limit" in body["error"]["message"]


def test_admin_bodies_obey_max_body_bytes(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang", server={"max_body_bytes": 1024})
    body = b'{"role": "decode", "url": "http://127.0.0.1:1"}' + b" " * 2048
    with cluster.client() as client:
        declared = client.post("/admin/workers", content=body)
        assert declared.status_code == 413 and "1024" in _error_message(declared)
        streamed = client.post("/admin/workers", content=iter([body[:1000], body[1000:]]))
        assert streamed.status_code == 413 and "1024" in _error_message(streamed)
        assert len(client.get("/admin/workers").json()["workers"]) == 2


def test_standalone_registry_bounds_and_guards_admin_bodies() -> None:
    settings = RegistrySettings(admin_token="s3cret")  # type: ignore[arg-type]
    with run_server(create_registry_app(settings)) as port:
        assert _post_declared(port, "/admin/workers", 8, {})[0] == 401
        status, body = _post_declared(port, "/admin/workers", HUGE, TOKEN)
        assert status == 413 and body["error"]["message"]
        assert _post_declared(port, "/store/keys/k", 8, {}, method="PUT")[0] == 401
        status, body = _post_declared(port, "/store/keys/k", HUGE, TOKEN, method="PUT")
        assert status == 413 and "limit" in body["error"]["message"]


class _CountFinished:
    """ASGI wrapper counting the HTTP requests the app has finished with, however it ended."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.finished = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            if scope["type"] == "http":
                self.finished += 1


def _cut_mid_body(port: int, method: str, path: str) -> None:
    """Announce 1000 body bytes, send 20, hang up."""
    head = f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head.encode() + b"content-length: 1000\r\n\r\n" + b'{"role": "decode", "u')


def _router_app() -> Any:
    return create_app(settings_for("sglang", [], []))


def _registry_app() -> Any:
    return create_registry_app(RegistrySettings())


@pytest.mark.parametrize(
    "make_app,method,path",
    [
        (_router_app, "POST", "/admin/workers"),
        (_registry_app, "POST", "/admin/workers"),
        (_registry_app, "PUT", "/store/keys/cut"),
    ],
    ids=["router admin", "registry admin", "registry store"],
)
def test_a_body_cut_mid_way_ends_quietly(
    caplog: pytest.LogCaptureFixture, make_app: Callable[[], Any], method: str, path: str
) -> None:
    """A client gone mid-body (or cut off by the body read timeout) is no server error: no
    ERROR and no traceback in the log, and the server goes on answering."""
    app = _CountFinished(make_app())
    with run_server(app) as port:
        _cut_mid_body(port, method, path)
        wait_until(lambda: app.finished >= 1, 5, "the cut request to end")
        assert httpx.get(f"http://127.0.0.1:{port}/admin/workers").status_code == 200
    _assert_quiet(caplog)  # the server thread has stopped: all it logged is in caplog


def test_a_body_read_timeout_mid_body_ends_quietly(caplog: pytest.LogCaptureFixture) -> None:
    """The router's body read timeout answers 408 and closes; the admin API reading that body
    then sees the client gone, and ends without an ERROR or a traceback."""
    app = _CountFinished(_router_app())
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        http=limited_http_protocol(HttpLimits(body_timeout_s=0.3)),
        log_config=None,
        access_log=False,
    )
    head = b"POST /admin/workers HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n"
    with serving([TestServer(config)], start_timeout=10) as (port,):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(head + b'{"role": "decode", "u')  # then nothing: the timeout fires
            answer = sock.recv(100)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        wait_until(lambda: app.finished >= 1, 5, "the cut request to end")
    _assert_quiet(caplog)


def _assert_quiet(caplog: pytest.LogCaptureFixture) -> None:
    loud = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not loud, [f"{r.name}: {r.getMessage()}" for r in loud]


# -- item 12: the store is down ------------------------------------------------------------------


@pytest.mark.etcd
def test_router_admin_answers_503_json_while_the_store_is_down(
    make_cluster: FakeClusterFactory, etcd: EtcdServer
) -> None:
    cluster = make_cluster("sglang", registry={"url": _store_url(etcd)})
    with cluster.client() as client:
        worker_id = client.get("/admin/workers").json()["workers"][0]["id"]
        etcd.stop()
        for method, path, body in (
            ("GET", "/admin/workers", None),
            ("POST", "/admin/workers", {"role": "decode", "url": "http://127.0.0.1:1"}),
            ("POST", f"/admin/workers/{worker_id}/drain", None),
        ):
            response = client.request(method, path, json=body)
            assert response.status_code == 503, (path, response.text)
            assert "unavailable" in _error_message(response)
        # the router keeps serving its last known workers meanwhile
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200


@pytest.mark.etcd
def test_standalone_registry_admin_answers_503_json_while_the_store_is_down(
    etcd: EtcdServer,
) -> None:
    with run_server(create_registry_app(RegistrySettings(url=_store_url(etcd)))) as port:
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/admin/workers", timeout=10).status_code == 200
        etcd.stop()
        for response in (
            httpx.get(url + "/admin/workers", timeout=10),
            httpx.delete(url + "/admin/workers/d-0", timeout=10),
        ):
            assert response.status_code == 503, response.text
            assert "unavailable" in _error_message(response)
