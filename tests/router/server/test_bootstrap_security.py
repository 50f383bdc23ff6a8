"""The engine bootstrap APIs (issue 11, item 2): off the client port, behind a source allow-list,
with bounded bodies and validated registrations; on the router's bootstrap ports and on the
standalone registry service. Real routers and registries on 127.0.0.1; ranks are real listening
sockets (or ports nothing listens on)."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from registry.app import create_registry_app
from registry.settings import RegistrySettings
from router import RouterSettings, create_app
from testkit.servers import free_port, run_server

TOKEN = "s3cret"
MAX_BODY = 64 * 1024
NOT_ON_ANY_MACHINE = "192.0.2.1"  # TEST-NET-1: documentation only, never this machine
INFO = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"


def lookup(tp: int) -> str:
    return f"/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank={tp}&target_pp_rank=0"


def rank(tp: int, port: int, *, host: str = "127.0.0.1", tp_size: int = 2) -> dict[str, Any]:
    """An SGLang 0.5.10+ ``PUT /route`` body: TP rank ``tp`` listening at ``host:port``."""
    return {
        "attn_tp_size": tp_size,
        "attn_tp_rank": tp,
        "attn_dp_size": 1,
        "attn_dp_rank": 0,
        "pp_size": 1,
        "pp_rank": 0,
        "system_dp_size": 1,
        "system_dp_rank": 0,
        "rank_ip": host,
        "rank_port": port,
    }


def vllm_worker(port: int, *, engine: str = "eng-a", host: str = "127.0.0.1") -> dict[str, Any]:
    return {
        "engine_id": engine,
        "dp_rank": 0,
        "tp_rank": 0,
        "pp_rank": 0,
        "addr": f"tcp://{host}:{port}",
    }


@contextlib.contextmanager
def listening(count: int, host: str = "127.0.0.1") -> Iterator[list[int]]:
    """``count`` real TCP listeners on ``host`` (the kernel accepts: a rank's KV socket)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket())
            sock.bind((host, 0))
            sock.listen(16)
            ports.append(int(sock.getsockname()[1]))
        yield ports


@dataclass
class Router:
    client_url: str
    namespace_url: str  # namespace p0's port (owned by the prefill on 127.0.0.1)
    shared_url: str  # --bootstrap-port


def _settings(max_body: int, **registry: Any) -> RouterSettings:
    values: dict[str, Any] = {
        "engine": "sglang",
        "prefill": [{"url": f"http://127.0.0.1:{free_port()}", "bootstrap_namespace": "p0"}],
        "decode": [{"url": f"http://127.0.0.1:{free_port()}"}],
        "health": {"interval_s": 60.0, "timeout_s": 0.5},
        "load": {"interval_s": 0},
        "server": {"max_body_bytes": max_body},
        "registry": {"admin_token": TOKEN, **registry},
    }
    return RouterSettings(**values)


@contextlib.contextmanager
def running_router(max_body: int = MAX_BODY, **registry: Any) -> Iterator[Router]:
    ns_port, shared_port = free_port(), free_port()
    ports = {"bootstrap_ports": {"p0": ns_port}, "bootstrap_port": shared_port}
    settings = _settings(max_body, **ports, **registry)
    with run_server(create_app(settings)) as port:
        yield Router(
            f"http://127.0.0.1:{port}",
            f"http://127.0.0.1:{ns_port}",
            f"http://127.0.0.1:{shared_port}",
        )


@pytest.fixture(scope="module")
def router() -> Iterator[Router]:
    with running_router() as running:
        yield running


def error_of(response: httpx.Response) -> str:
    body = response.json()
    assert body["error"]["code"] == response.status_code, body
    message: str = body["error"]["message"]
    return message


# --- item 2: the client port serves no engine API ------------------------------------------------


def test_client_port_cannot_hijack_a_namespace(router: Router) -> None:
    """The issue's hijack: an unauthenticated PUT /bootstrap/p0/route on the client port with a
    listener's port. It is 404 now, and decoders still get the real rank."""
    with listening(2) as (real, attacker), httpx.Client(timeout=5) as http:
        assert http.put(router.namespace_url + "/route", json=rank(0, real, tp_size=1)).text == "OK"
        hijack = rank(0, attacker, tp_size=1)
        for method, path, body in [
            ("PUT", "/bootstrap/p0/route", hijack),
            ("PUT", "/route", hijack),
            ("POST", "/register", vllm_worker(attacker)),
            ("POST", "/bootstrap/p0/register", vllm_worker(attacker)),
            ("POST", "/register_dp_rank", {"bootstrap_room": 1, "dp_rank": 0}),
            ("POST", "/query_dp_ranks", {"bootstrap_rooms": [1]}),
            ("GET", "/bootstrap/p0" + lookup(0), None),
            ("GET", "/query", None),
        ]:
            answer = http.request(method, router.client_url + path, json=body)
            assert answer.status_code == 404, (method, path, answer.text)
        seen = http.get(router.namespace_url + lookup(0)).json()
        assert seen == {"rank_ip": "127.0.0.1", "rank_port": real}
        assert http.get(router.shared_url + "/bootstrap/p0" + lookup(0)).json() == seen
        paths = http.get(router.client_url + "/openapi.json").json()["paths"]
        assert not [p for p in paths if p in ("/route", "/register", "/query")]
        assert not [p for p in paths if p.startswith("/bootstrap/")]


# --- allow-list ----------------------------------------------------------------------------------


def test_sources_outside_the_allow_list_get_403_before_the_body(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only 10.0.0.0/8 allowed: this test's 127.0.0.1 is outside, on every bootstrap port."""
    caplog.set_level(logging.WARNING, logger="registry.engine_api.source_allow")
    oversized = b"x" * (MAX_BODY + 1)  # would be 413 if the body were looked at
    with (
        running_router(bootstrap_allow=["10.0.0.0/8"]) as r,
        listening(1) as (port,),
        httpx.Client(timeout=5) as http,
    ):
        for url in (r.namespace_url, r.shared_url):
            refused = http.put(url + "/route", json=rank(0, port))
            assert refused.status_code == 403
            assert "127.0.0.1 is not allowed" in error_of(refused)
            assert http.put(url + "/route", content=oversized).status_code == 403
            assert http.get(url + INFO).status_code == 403
            assert http.get(url + "/openapi.json").status_code == 403
        assert http.get(r.client_url + "/health").status_code == 200  # the client port is open
    warnings = [rec for rec in caplog.records if "outside the allowed sources" in rec.message]
    # one warning per listener; the repeats from the same source are debug lines
    assert len(warnings) == 2, [rec.message for rec in warnings]


def test_registry_service_allow_lists_its_engine_paths_only() -> None:
    settings = RegistrySettings.model_validate({"bootstrap_allow": ["10.0.0.0/8"]})
    with run_server(create_registry_app(settings)) as port, httpx.Client(timeout=5) as http:
        base = f"http://127.0.0.1:{port}"
        for method, path in [
            ("PUT", "/route"),
            ("POST", "/register"),
            ("GET", "/query"),
            ("POST", "/query_dp_ranks"),
            ("PUT", "/bootstrap/p1/route"),
        ]:
            answer = http.request(method, base + path, json={})
            assert answer.status_code == 403, (method, path)
        assert http.get(base + "/health").status_code == 200
        assert http.get(base + "/admin/workers").status_code == 200  # loopback admin, no token


# --- registration checks -------------------------------------------------------------------------


def test_unreachable_rank_is_refused(router: Router) -> None:
    dead = free_port()
    with httpx.Client(base_url=router.shared_url + "/bootstrap/u1", timeout=5) as http:
        refused = http.put("/route", json=rank(0, dead))
        assert refused.status_code == 400
        assert f"127.0.0.1:{dead}, which is not reachable" in error_of(refused)
        assert "(0 workers registered)" in http.get(INFO).text
        vllm = http.post("/register", json=vllm_worker(dead))
        assert vllm.status_code == 400 and "not reachable" in error_of(vllm)
        assert http.get("/query").json() == {}


def test_rank_on_another_host_than_its_prefill_is_refused(router: Router) -> None:
    """Namespace p0 belongs to the prefill on 127.0.0.1: a rank elsewhere is refused (409)."""
    with httpx.Client(timeout=5) as http, listening(1) as (port,):
        for url in (router.namespace_url, router.shared_url + "/bootstrap/p0"):
            refused = http.put(url + "/route", json=rank(1, port, host=NOT_ON_ANY_MACHINE))
            assert refused.status_code == 409
            assert "belongs to the prefill worker on 127.0.0.1" in error_of(refused)
            vllm = http.post(url + "/register", json=vllm_worker(port, host=NOT_ON_ANY_MACHINE))
            assert vllm.status_code == 409
        assert http.get(router.namespace_url + lookup(1)).status_code == 404
    with httpx.Client(timeout=5) as http, listening(1, "127.0.0.2") as (alias_port,):
        # a loopback alias is the same host
        alias = rank(1, alias_port, host="127.0.0.2")
        accepted = http.put(router.namespace_url + "/route", json=alias)
        assert accepted.status_code == 200, accepted.text


def test_moving_a_live_rank_needs_the_admin_token(
    router: Router, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="registry.engine_api.rank_checks")
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    with (
        httpx.Client(base_url=router.shared_url + "/bootstrap/m1", timeout=5) as http,
        listening(3) as (first, second, third),
    ):
        assert http.put("/route", json=rank(0, first, tp_size=1)).status_code == 200
        assert (
            http.put("/route", json=rank(0, first, tp_size=1)).status_code == 200
        )  # same address: fine
        refused = http.put("/route", json=rank(0, second, tp_size=1))
        assert refused.status_code == 409 and "needs the admin token" in error_of(refused)
        wrong = http.put(
            "/route", json=rank(0, second, tp_size=1), headers={"Authorization": "Bearer x"}
        )
        assert wrong.status_code == 409
        assert http.get(lookup(0)).json()["rank_port"] == first
        moved = http.put("/route", json=rank(0, second, tp_size=1), headers=bearer)
        assert moved.status_code == 200, moved.text
        assert http.get(lookup(0)).json()["rank_port"] == second
        assert http.post("/register", json=vllm_worker(first)).status_code == 200
        vllm = http.post("/register", json=vllm_worker(third, engine="eng-b"))
        assert vllm.status_code == 409
        assert http.get("/query").json()["0"]["worker_addr"] == {
            "0": {"0": f"tcp://127.0.0.1:{first}"}
        }
    logged = [rec.message for rec in caplog.records]
    assert any("refused moving rank" in m and f":{second}" in m for m in logged), logged
    assert any("moved from" in m and "with the admin token" in m for m in logged), logged


def test_a_rank_whose_old_address_is_gone_may_move(router: Router) -> None:
    """An engine restarted on a new port (SGLang and vLLM bind random ports) re-registers."""
    with httpx.Client(base_url=router.shared_url + "/bootstrap/m2", timeout=5) as http:
        with listening(1) as (old,):
            assert http.put("/route", json=rank(0, old, tp_size=1)).status_code == 200
        with listening(1) as (new,):
            assert http.put("/route", json=rank(0, new, tp_size=1)).status_code == 200
            assert http.get(lookup(0)).json()["rank_port"] == new


def test_dp_rank_beyond_the_prefills_dp_size_is_400(router: Router) -> None:
    with httpx.Client(base_url=router.shared_url + "/bootstrap/d1", timeout=5) as http:
        with listening(1) as (port,):
            assert http.put("/route", json=rank(0, port, tp_size=1)).status_code == 200
        ok = http.post("/register_dp_rank", json={"bootstrap_room": 7, "dp_rank": 0})
        assert ok.status_code == 200
        beyond = http.post("/register_dp_rank", json={"bootstrap_room": 8, "dp_rank": 1})
        assert beyond.status_code == 400 and "dp_size=1" in beyond.text
        answer = http.post("/query_dp_ranks", json={"bootstrap_rooms": [7, 8]})
        assert answer.json() == {"7": 0}


# --- bounds --------------------------------------------------------------------------------------


def test_bodies_over_max_body_bytes_are_413(router: Router) -> None:
    big = b'{"pad": "' + b"x" * MAX_BODY + b'"}'

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(MAX_BODY // 1024 + 2):
            yield b"x" * 1024

    with httpx.Client(timeout=5) as http:
        for url in (router.namespace_url, router.shared_url):
            for path in ("/route", "/register", "/register_dp_rank", "/query_dp_ranks"):
                method = "PUT" if path == "/route" else "POST"
                declared = http.request(method, url + path, content=big)
                assert declared.status_code == 413, (url, path, declared.text)
                assert "limit" in error_of(declared)
                streamed = http.request(method, url + path, content=chunked())
                assert streamed.status_code == 413, (url, path, streamed.text)


def test_query_dp_ranks_with_too_many_rooms_is_400_at_once() -> None:
    """10^6 rooms stalled the event loop for 7 s (one store read each): at most 4096 now."""
    router = running_router(max_body=32 * 1024 * 1024)  # the default: 10^6 rooms are ~7 MB
    with router as r, httpx.Client(base_url=r.shared_url, timeout=10) as http:
        assert (
            http.post("/query_dp_ranks", json={"bootstrap_rooms": list(range(4096))}).json() == {}
        )
        rooms = list(range(1_000_000))
        started = time.monotonic()
        answer = http.post("/query_dp_ranks", json={"bootstrap_rooms": rooms})
        elapsed = time.monotonic() - started
        assert answer.status_code == 400 and "at most 4096" in answer.text
        assert elapsed < 3.0, elapsed


# --- OpenAPI -------------------------------------------------------------------------------------


def _statuses(schema: dict[str, Any], path: str, method: str) -> set[str]:
    return set(schema["paths"][path][method]["responses"])


def test_bootstrap_listeners_document_what_they_answer(router: Router) -> None:
    with httpx.Client(timeout=5) as http:
        shared = http.get(router.shared_url + "/openapi.json").json()
        namespace = http.get(router.namespace_url + "/openapi.json").json()
        with run_server(create_registry_app(RegistrySettings())) as port:
            registry = http.get(f"http://127.0.0.1:{port}/openapi.json").json()
    for schema in (shared, namespace, registry):
        assert {"200", "400", "403", "404", "409", "413", "503"} <= _statuses(
            schema, "/route", "put"
        )
        assert {"403", "409", "413", "422"} <= _statuses(schema, "/register", "post")
        assert {"200", "403", "404", "503"} <= _statuses(schema, "/route", "get")
        assert "413" in _statuses(schema, "/bootstrap/{namespace}/query_dp_ranks", "post")


# --- issue 21: the client port's framing limits on the bootstrap listeners ----------------------


def _raw_exchange(url: str, request: bytes, *, trailers: bool = False) -> bytes:
    """Send ``request`` on a fresh connection, then with ``trailers`` endless trailer fields
    until the server cuts it (4 MiB at most); return all the server answered."""
    port = httpx.URL(url).port
    assert port is not None
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        with contextlib.suppress(OSError):  # the server closed it mid-flood
            for _ in range(64 if trailers else 0):
                sock.sendall(b"x-t: " + b"t" * 65530 + b"\r\n")
        data = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                data += chunk
        return data


def _error_json(raw: bytes, status: int) -> dict[str, Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), raw[:200]
    assert b"connection: close" in head.lower()
    error: dict[str, Any] = json.loads(body)["error"]
    assert error["code"] == status and error["type"] == "invalid_request_error", error
    return error


def test_bootstrap_ports_bound_trailers_and_answer_malformed_requests_in_json(
    router: Router,
) -> None:
    for url in (router.namespace_url, router.shared_url):
        chunked = b"PUT /route HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n"
        flood = _raw_exchange(url, chunked + b"0\r\n", trailers=True)
        assert "trailers exceed" in _error_json(flood, 431)["message"]
        malformed = _raw_exchange(url, b"GET /route HTTP/1.1\r\nbad header: x\r\n\r\n")
        assert _error_json(malformed, 400)["message"].startswith("malformed HTTP request")
