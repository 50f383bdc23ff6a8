"""Engine bootstrap namespaces (issue 21, item 7): a rank registration is tied to the identity
of the prefill that owns its namespace (the registering connection's source and the rank's
address must be on the prefill's host; a squatter's earlier rank gives way to the owner's), and
engines cannot create namespaces without bound (429 beyond ``max_namespaces``). A real
standalone registry on 127.0.0.1; its prefill records name the namespaces' owners. The
reachability check is off, so ranks may advertise an address no machine has."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from registry.app import create_registry_app
from registry.settings import RegistrySettings
from testkit.servers import free_port, run_server

ELSEWHERE = "192.0.2.1"  # TEST-NET-1: documentation only, never this machine
MAX_NAMESPACES = 4


def rank(tp: int, host: str, port: int) -> dict[str, Any]:
    """An SGLang 0.5.10+ ``PUT /route`` body for TP rank ``tp`` of a one-rank prefill."""
    return {
        "attn_tp_size": 1,
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


def vllm_worker(engine: str, host: str, port: int) -> dict[str, Any]:
    addr = f"tcp://{host}:{port}"
    return {"engine_id": engine, "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": addr}


def lookup(tp: int) -> str:
    return f"/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank={tp}&target_pp_rank=0"


@pytest.fixture
def registry() -> Iterator[httpx.Client]:
    settings = RegistrySettings(bootstrap_check_reachable=False, max_namespaces=MAX_NAMESPACES)
    with (
        run_server(create_registry_app(settings)) as port,
        httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as http,
    ):
        yield http


def own(http: httpx.Client, namespace: str, host: str) -> None:
    """A prefill worker on ``host`` registers under ``namespace``: it owns the namespace."""
    body = {
        "role": "prefill",
        "url": f"http://{host}:{free_port()}",
        "bootstrap_namespace": namespace,
    }
    assert http.post("/admin/workers", json=body).status_code == 201


def test_a_squatters_rank_gives_way_to_the_prefill_that_owns_the_namespace(
    registry: httpx.Client,
) -> None:
    base = "/bootstrap/late"
    squat, real = free_port(), free_port()
    # before any prefill names the namespace, a squatter takes rank 0 (SGLang) and dp rank 0
    # (vLLM, under the engine id it read from /query: its address, not its id, gives it away)
    assert registry.put(base + "/route", json=rank(0, ELSEWHERE, squat)).status_code == 200
    assert (
        registry.post(base + "/register", json=vllm_worker("real", ELSEWHERE, squat)).status_code
        == 200
    )
    own(registry, "late", "127.0.0.1")
    # the prefill's own ranks (from its host, at its host) replace the squatter's, alive or not
    taken = registry.put(base + "/route", json=rank(0, "127.0.0.1", real))
    assert taken.status_code == 200, taken.text
    assert registry.get(base + lookup(0)).json() == {"rank_ip": "127.0.0.1", "rank_port": real}
    registered = registry.post(base + "/register", json=vllm_worker("real", "127.0.0.1", real))
    assert registered.status_code == 200, registered.text
    assert registry.get(base + "/query").json() == {
        "0": {"engine_id": "real", "worker_addr": {"0": {"0": f"tcp://127.0.0.1:{real}"}}}
    }
    # and the squatter cannot take them back: its address is not on the prefill's host
    back = registry.put(base + "/route", json=rank(0, ELSEWHERE, squat))
    assert back.status_code == 409
    assert registry.get(base + lookup(0)).json()["rank_port"] == real


def test_a_rank_registers_from_its_prefills_host(registry: httpx.Client) -> None:
    """The namespace belongs to a prefill on another machine: a process here may not register
    ranks in its name, even at the prefill's own address (the body cannot fake its source)."""
    own(registry, "far", ELSEWHERE)
    port = free_port()
    refused = registry.put("/bootstrap/far/route", json=rank(0, ELSEWHERE, port))
    assert refused.status_code == 409
    message = refused.json()["error"]["message"]
    assert "is registered from 127.0.0.1" in message and ELSEWHERE in message
    vllm = registry.post("/bootstrap/far/register", json=vllm_worker("e", ELSEWHERE, port))
    assert vllm.status_code == 409
    nothing = registry.get("/bootstrap/far" + lookup(0))
    assert nothing.status_code == 503 and "(0 workers registered)" in nothing.text
    assert registry.get("/bootstrap/far/query").json() == {}


def test_namespaces_are_capped_with_429(registry: httpx.Client) -> None:
    for index in range(MAX_NAMESPACES):
        body = rank(0, "127.0.0.1", free_port())
        assert registry.put(f"/bootstrap/n{index}/route", json=body).status_code == 200
    for call in (
        lambda: registry.put("/bootstrap/one-more/route", json=rank(0, "127.0.0.1", free_port())),
        lambda: registry.post(
            "/bootstrap/one-more/register", json=vllm_worker("e", "127.0.0.1", 1)
        ),
        lambda: registry.get("/bootstrap/one-more/query"),
        lambda: registry.get("/bootstrap/one-more" + lookup(0)),
    ):
        response = call()
        assert response.status_code == 429, response.text
        error = response.json()["error"]
        assert error["code"] == 429 and "too many bootstrap namespaces" in error["message"]
    # the namespaces already there keep working, through both protocols
    assert registry.get("/bootstrap/n0" + lookup(0)).status_code == 200
    assert registry.get("/bootstrap/n0/query").status_code == 200
