"""Worker URLs are never logged with their credentials (issue 21, item 7): workers whose URLs
carry ``user:password@`` are configured on the command line, added, listed, drained and removed
through a real router's admin API and a standalone registry's, with every logger at DEBUG (but
httpx and httpcore, at WARNING as the router's logging configures them: httpx logs each request
URL at INFO); no log line holds the password."""

from __future__ import annotations

import logging

import httpx
import pytest

from registry.app import create_registry_app
from registry.settings import RegistrySettings
from router import create_app
from testkit.fake_cluster import serve_engine, settings_for
from testkit.fake_engine import FakeConfig, FakeEngine
from testkit.polling import wait_until
from testkit.servers import run_server

SECRET = "pa55-secret-word"
# as router.observability.logs configures them: httpx logs every request URL at INFO
QUIET_LIBRARIES = ("httpx", "httpcore")


def emitted(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The lines the router's logging would emit (everything, but quiet libraries' INFO)."""
    return [
        record.getMessage()
        for record in caplog.records
        if record.name.split(".")[0] not in QUIET_LIBRARIES or record.levelno >= logging.WARNING
    ]


def with_password(port: int) -> str:
    return f"http://user:{SECRET}@127.0.0.1:{port}"


def exercise_admin(base: str, url: str) -> None:
    """Add, list, drain and remove a decode at ``url`` through ``base``'s admin API."""
    with httpx.Client(base_url=base, timeout=5) as http:
        added = http.post("/admin/workers", json={"role": "decode", "url": url})
        assert added.status_code == 201, added.text
        wid = added.json()["id"]
        assert http.get("/admin/workers").status_code == 200
        assert http.post(f"/admin/workers/{wid}/drain").status_code == 202
        # a router removes a drained worker by itself once idle: gone already is fine
        assert http.delete(f"/admin/workers/{wid}").status_code in (204, 404)


def test_router_never_logs_worker_passwords(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    prefill, decode = FakeEngine("prefill", "sglang"), FakeEngine("decode", "sglang")
    extra = FakeEngine("decode", "sglang", config=FakeConfig(kv_timeout=20.0))
    with (
        serve_engine(prefill) as (p_port, b_port),
        serve_engine(decode) as (d_port,),
        serve_engine(extra) as (e_port,),
    ):
        settings = settings_for(
            "sglang", [(with_password(p_port), b_port)], [with_password(d_port)]
        )
        with run_server(create_app(settings)) as r_port:
            base = f"http://127.0.0.1:{r_port}"
            wait_until(lambda: httpx.get(base + "/ready").status_code == 200, 10, "ready")
            exercise_admin(base, with_password(e_port))
            wait_until(lambda: len(httpx.get(base + "/ready").json()["decode"]) == 1, 5, "removal")
    logged = emitted(caplog)
    assert any("joined" in line for line in logged), logged  # the lines that name workers ran
    assert any("registry: added" in line for line in logged), logged
    leaks = [line for line in logged if SECRET in line]
    assert not leaks, leaks


def test_registry_service_never_logs_worker_passwords(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with run_server(create_registry_app(RegistrySettings())) as port:
        exercise_admin(f"http://127.0.0.1:{port}", with_password(9))
    logged = emitted(caplog)
    assert any("registry: added" in line for line in logged), logged
    leaks = [line for line in logged if SECRET in line]
    assert not leaks, leaks
