"""SGLang bootstrap API (registry/engine_api/sglang_*) against docs/concepts/protocols.md 5.5/5.6,
every version.

Request/response checks go through ``httpx.ASGITransport``; one test serves ``namespace_app`` on a
real socket; the shared-store tests run over memory and a real etcd (``store`` fixture).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from registry.backends import MemoryStore, RegistryStore
from registry.engine_api import (
    RankAddress,
    SglangRankTable,
    namespace_app,
    sglang_routes,
)
from registry.engine_api.app import BootstrapProtection
from registry.engine_api.rank_checks import RegistrationGuard
from registry.errors import NotFound
from registry.settings import DEFAULT_BOOTSTRAP_ALLOW
from testkit.servers import run_server
from tests.registry.test_engine_api_vllm import Outage

# the protocol on a real listener: loopback allowed, the test's made-up rank addresses unchecked
PROTOCOL_ONLY = BootstrapProtection(
    allow=DEFAULT_BOOTSTRAP_ALLOW,
    max_body_bytes=1 << 20,
    guard=RegistrationGuard(check_reachable=False),
)

INFO_04 = "/route?engine_rank=-1&target_dp_group=-1"
INFO_051 = "/route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1"
INFO_0510 = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
JSON = "application/json; charset=utf-8"
TEXT = "text/plain; charset=utf-8"
DECODE_NULLS: dict[str, Any] = dict.fromkeys(
    [
        "target_tp_rank",
        "target_tp_ranks",
        "target_cp_ranks",
        "target_pp_ranks",
        "required_dst_info_num",
        "required_prefill_response_num",
    ]
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- payloads of each engine generation ---------------------------------------------------------


def v04(
    engine_rank: int, *, tp_size: int = 4, dp_size: int = 2, role: str = "Prefill"
) -> dict[str, Any]:
    """SGLang 0.4.9-0.4.10."""
    return {
        "role": role,
        "tp_size": tp_size,
        "dp_size": dp_size,
        "rank_ip": "10.0.0.4",
        "rank_port": 7000 + engine_rank,
        "engine_rank": engine_rank,
    }


def v051(
    tp_rank: int,
    *,
    pp_rank: int = 0,
    tp: int = 2,
    pp: int = 1,
    page_size: int | None = None,
    role: str = "Prefill",
    **fields: Any,
) -> dict[str, Any]:
    """SGLang 0.5.1-0.5.9 (``page_size`` from 0.5.8)."""
    body: dict[str, Any] = {
        "role": role,
        "attn_tp_size": tp,
        "attn_tp_rank": tp_rank,
        "attn_dp_size": 1,
        "attn_dp_rank": 0,
        "pp_size": pp,
        "pp_rank": pp_rank,
        "system_dp_size": 1,
        "system_dp_rank": 0,
        "rank_ip": "10.0.0.5",
        "rank_port": 7100 + 10 * tp_rank + pp_rank,
    }
    if page_size is not None:
        body["page_size"] = page_size
    return body | fields


def v0510(
    tp_rank: int,
    *,
    dp_rank: int = 0,
    cp_rank: int = 0,
    tp: int = 2,
    dp: int = 1,
    cp: int = 1,
    **fields: Any,
) -> dict[str, Any]:
    """SGLang 0.5.10+ (no ``role``; DP attention: ``system_dp_size`` 1)."""
    body: dict[str, Any] = {
        "attn_tp_size": tp,
        "attn_tp_rank": tp_rank,
        "attn_cp_size": cp,
        "attn_cp_rank": cp_rank,
        "attn_dp_size": dp,
        "attn_dp_rank": dp_rank,
        "pp_size": 1,
        "pp_rank": 0,
        "system_dp_size": 1,
        "system_dp_rank": 0,
        "rank_ip": "10.0.0.6",
        "rank_port": 7200 + 100 * dp_rank + 10 * cp_rank + tp_rank,
        "page_size": 64,
        "kv_cache_dtype": "auto",
        "load_balance_method": "follow_bootstrap_room",
    }
    return body | fields


def v0523(tp_rank: int, **fields: Any) -> dict[str, Any]:
    """SGLang 0.5.23: 0.5.17's fields plus the 0.5.23 layout fields."""
    return (
        v0510(
            tp_rank,
            prefill_http_port=30000,
            enable_dsa_cache_layer_split=False,
            kv_layout=None,
            dsv41_spec_layout={"block_size": 128},
            enable_kv_cache_sharding=False,
            decode_allocation_policy="early",
        )
        | fields
    )


def lookup(dp: int, tp: int, *, cp: int = 0, pp: int = 0) -> str:
    return (
        f"/route?prefill_dp_rank={dp}&prefill_cp_rank={cp}&target_tp_rank={tp}&target_pp_rank={pp}"
    )


# --- fixtures -------------------------------------------------------------------------------------


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def mem(clock: FakeClock) -> AsyncIterator[MemoryStore]:
    store = MemoryStore(clock=clock)
    yield store
    await store.close()


def app_for(*tables: SglangRankTable) -> FastAPI:
    by_name = {table.namespace: table for table in tables}

    def resolve(name: str) -> SglangRankTable:
        if name not in by_name:
            raise NotFound(f"Unknown bootstrap namespace: {name!r}")
        return by_name[name]

    app = FastAPI()
    app.include_router(sglang_routes(resolve))
    return app


def client_for(*tables: SglangRankTable) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app_for(*tables))
    return httpx.AsyncClient(transport=transport, base_url="http://bootstrap")


@pytest.fixture
def table(mem: MemoryStore) -> SglangRankTable:
    return SglangRankTable(mem, "default")


@pytest.fixture
async def client(table: SglangRankTable) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(table) as client:
        yield client


async def put_all(
    client: httpx.AsyncClient, bodies: list[dict[str, Any]], path: str = "/route"
) -> None:
    for body in bodies:
        response = await client.put(path, json=body)
        assert (response.status_code, response.text) == (200, "OK")
        assert response.headers["content-type"] == TEXT


# --- 0.4.x ----------------------------------------------------------------------------------------


async def test_v04_register_then_parallel_info_and_rank_lookup(client: httpx.AsyncClient) -> None:
    await put_all(client, [v04(rank) for rank in range(3)])
    assert (await client.get(INFO_04)).status_code == 503  # 3 of tp 4 ranks
    await put_all(client, [v04(3)])

    info = await client.get(INFO_04)
    assert info.status_code == 200
    assert info.headers["content-type"] == JSON
    assert info.text == '{"prefill_tp_size": 4, "prefill_dp_size": 2}'  # aiohttp's separators
    # engine_rank 3 of tp 4 / dp 2: dp group 3 // 2 = 1, rank in group 3 % 2 = 1
    rank = await client.get("/route?engine_rank=1&target_dp_group=1")
    assert rank.text == '{"rank_ip": "10.0.0.4", "rank_port": 7003}'
    assert rank.headers["content-type"] == JSON


async def test_v04_unknown_rank_is_404_not_the_engines_500(client: httpx.AsyncClient) -> None:
    await put_all(client, [v04(0)])
    response = await client.get("/route?engine_rank=1&target_dp_group=0")
    assert response.status_code == 404
    assert response.text.startswith("Bootstrap info not found for dp_rank=0")


async def test_v04_decode_role_is_acknowledged_and_ignored(
    client: httpx.AsyncClient, table: SglangRankTable
) -> None:
    await put_all(client, [v04(0, role="Decode")])
    assert await table.parallel_info() is None


# --- 0.5.1 - 0.5.9 --------------------------------------------------------------------------------


async def test_v051_parallel_info_and_pp_rank_lookup(client: httpx.AsyncClient) -> None:
    await put_all(
        client, [v051(tp, pp_rank=pp, pp=2, page_size=16) for tp in range(2) for pp in range(2)]
    )
    info = await client.get(INFO_051)
    assert info.json() == {
        "prefill_attn_tp_size": 2,
        "prefill_dp_size": 1,
        "prefill_pp_size": 2,
        "prefill_page_size": 16,
    }
    rank = await client.get("/route?engine_rank=1&target_dp_group=0&target_pp_rank=1")
    assert rank.json() == {"rank_ip": "10.0.0.5", "rank_port": 7111}
    missing = await client.get("/route?engine_rank=0&target_dp_group=0&target_pp_rank=2")
    assert missing.status_code == 404


async def test_v051_before_page_size_has_no_prefill_page_size(client: httpx.AsyncClient) -> None:
    await put_all(client, [v051(0), v051(1)])
    info = await client.get(INFO_051)
    assert info.json() == {"prefill_attn_tp_size": 2, "prefill_dp_size": 1, "prefill_pp_size": 1}


async def test_v051_system_dp_keys_the_table_by_system_dp_rank(client: httpx.AsyncClient) -> None:
    bodies = [
        v051(tp, attn_dp_size=1, system_dp_size=2, system_dp_rank=dp, rank_port=7000 + dp)
        for dp in range(2)
        for tp in range(2)
    ]
    await put_all(client, bodies)
    assert (await client.get(INFO_051)).json()["prefill_dp_size"] == 2
    rank = await client.get("/route?engine_rank=0&target_dp_group=1&target_pp_rank=0")
    assert rank.json()["rank_port"] == 7001


# --- 0.5.10+ --------------------------------------------------------------------------------------


async def test_v0510_server_info_is_503_until_every_rank_registered(
    client: httpx.AsyncClient,
) -> None:
    await put_all(
        client, [v0510(0, dp=2, dp_rank=0), v0510(1, dp=2, dp_rank=0), v0510(0, dp=2, dp_rank=1)]
    )
    not_ready = await client.get(INFO_0510)
    assert not_ready.status_code == 503
    assert not_ready.text == "Prefill server not fully registered yet (3 workers registered)."
    assert (await client.get(lookup(0, 0))).status_code == 503  # rank lookups wait too

    await put_all(client, [v0510(1, dp=2, dp_rank=1)])
    info = await client.get(INFO_0510)
    assert info.status_code == 200
    assert info.json() == {
        "attn_tp_size": 2,
        "attn_cp_size": 1,
        "dp_size": 2,
        "pp_size": 1,
        "page_size": 64,
        "kv_cache_dtype": "auto",
        "follow_bootstrap_room": True,
        **DECODE_NULLS,
    }
    assert list(info.json())[:7] == [
        "attn_tp_size",
        "attn_cp_size",
        "dp_size",
        "pp_size",
        "page_size",
        "kv_cache_dtype",
        "follow_bootstrap_room",
    ]
    assert (await client.get(lookup(1, 1))).json() == {"rank_ip": "10.0.0.6", "rank_port": 7301}


async def test_v0510_cp_ranks_are_part_of_the_table(client: httpx.AsyncClient) -> None:
    await put_all(client, [v0510(tp, cp=2, cp_rank=cp) for cp in range(2) for tp in range(2)])
    assert (await client.get(INFO_0510)).json()["attn_cp_size"] == 2
    assert (await client.get(lookup(0, 1, cp=1))).json()["rank_port"] == 7211
    not_found = await client.get(lookup(0, 0, cp=2))
    assert not_found.status_code == 404
    assert not_found.text == "Bootstrap info not found for dp_rank=0 cp_rank=2 tp_rank=0 pp_rank=0"


async def test_v0523_server_info_echoes_the_version_specific_fields(
    client: httpx.AsyncClient,
) -> None:
    await put_all(client, [v0523(0), v0523(1)])
    info = (await client.get(INFO_0510)).json()
    assert info == {
        "attn_tp_size": 2,
        "attn_cp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "page_size": 64,
        "kv_cache_dtype": "auto",
        "follow_bootstrap_room": True,
        "enable_dsa_cache_layer_split": False,
        "decode_allocation_policy": "early",
        "enable_kv_cache_sharding": False,
        "dsv41_spec_layout": {"block_size": 128},
        "prefill_http_port": 30000,
        **DECODE_NULLS,
    }  # kv_layout was null: left out, as 0.5.23 does


async def test_server_info_without_decode_side_fields(mem: MemoryStore) -> None:
    table = SglangRankTable(mem, "default", server_info_decode_fields=False)
    async with client_for(table) as client:
        await put_all(client, [v0510(0, tp=1)])
        info = (await client.get(INFO_0510)).json()
    assert set(info) == {
        "attn_tp_size",
        "attn_cp_size",
        "dp_size",
        "pp_size",
        "page_size",
        "kv_cache_dtype",
        "follow_bootstrap_room",
    }


@pytest.mark.parametrize(
    ("fields", "follow"),
    [
        ({"load_balance_method": "round_robin"}, False),
        ({"load_balance_method": "follow_bootstrap_room"}, True),
    ],
)
async def test_follow_bootstrap_room_comes_from_load_balance_method(
    client: httpx.AsyncClient, fields: dict[str, Any], follow: bool
) -> None:
    await put_all(client, [v0510(0, tp=1, **fields)])
    assert (await client.get(INFO_0510)).json()["follow_bootstrap_room"] is follow


async def test_follow_bootstrap_room_defaults_to_true(
    client: httpx.AsyncClient, table: SglangRankTable
) -> None:
    body = v0510(0, tp=1)
    del body["load_balance_method"]
    await put_all(client, [body])
    info = await table.parallel_info()
    assert info is not None and info.follow_bootstrap_room is True


async def test_any_query_form_reads_any_registration_form(client: httpx.AsyncClient) -> None:
    await put_all(client, [v04(rank) for rank in range(4)])
    assert (await client.get(INFO_0510)).json()["attn_tp_size"] == 2  # per dp group
    assert (await client.get(INFO_051)).json()["prefill_dp_size"] == 2
    assert (await client.get(lookup(1, 0))).json()["rank_port"] == 7002


async def test_mixed_minus_one_query_is_a_rank_lookup(client: httpx.AsyncClient) -> None:
    await put_all(client, [v0510(0, tp=1)])
    query = "/route?prefill_dp_rank=-1&prefill_cp_rank=0&target_tp_rank=-1&target_pp_rank=-1"
    assert (await client.get(query)).status_code == 404


# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "query",
    [
        "/route",
        "/route?engine_rank=0",
        "/route?target_dp_group=0&target_pp_rank=0",
        "/route?engine_rank=&target_dp_group=0",
        "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0",
        "/route?prefill_dp_rank=-1",
    ],
)
async def test_missing_query_params_are_400(client: httpx.AsyncClient, query: str) -> None:
    response = await client.get(query)
    assert (response.status_code, response.text) == (400, "Missing inputs for bootstrap server.")


async def test_non_integer_query_params_are_400(client: httpx.AsyncClient) -> None:
    response = await client.get("/route?engine_rank=x&target_dp_group=0")
    assert response.status_code == 400
    assert "integers" in response.text


@pytest.mark.parametrize("method", ["POST", "DELETE", "PATCH"])
async def test_other_methods_on_route_are_405(client: httpx.AsyncClient, method: str) -> None:
    response = await client.request(method, "/route")
    assert (response.status_code, response.text) == (405, "Method not allowed")
    assert response.headers["allow"] == "GET, PUT"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"rank_ip": "10.0.0.1", "rank_port": 1}', "expected the SGLang 0.4.x fields"),
        (v04(0) | {"rank_port": None}, "rank_port"),
        ({k: v for k, v in v04(0).items() if k != "engine_rank"}, "engine_rank: Field required"),
        (v04(4), "engine_rank=4 >= tp_size=4"),
        (v04(0, tp_size=3, dp_size=2), "not a multiple"),
        ({k: v for k, v in v051(0).items() if k != "attn_tp_rank"}, "attn_tp_rank: Field required"),
        (v051(2), "attn_tp_rank=2 is out of range"),
        (v0510(0, cp_rank=1), "attn_cp_rank=1 is out of range"),
        (v0510(0, rank_port=70000), "rank_port"),
        (v0510(0, attn_tp_size=0, attn_tp_rank=0), "attn_tp_size"),
        (v0510(0, rank_ip=""), "rank_ip"),
    ],
)
async def test_invalid_registrations_are_400_with_the_reason(
    client: httpx.AsyncClient, table: SglangRankTable, body: Any, needle: str
) -> None:
    content = body if isinstance(body, bytes) else None
    response = await client.put("/route", content=content, json=None if content else body)
    assert response.status_code == 400
    assert needle in response.text
    assert await table.parallel_info() is None


async def test_unreachable_store_is_503(mem: MemoryStore, client: httpx.AsyncClient) -> None:
    await mem.close()
    response = await client.put("/route", json=v0510(0))
    assert response.status_code == 503
    assert response.text.startswith("Bootstrap registry unavailable")


# --- leases, parallel config changes, namespaces ---------------------------------------------


async def test_rank_lease_is_kept_alive_by_re_registering(
    mem: MemoryStore, clock: FakeClock
) -> None:
    table = SglangRankTable(mem, "default", rank_ttl=10)
    async with client_for(table) as client:
        await put_all(client, [v0510(0, tp=1)])
        clock.now += 8
        await put_all(client, [v0510(0, tp=1)])  # heartbeat
        clock.now += 8
        assert (await client.get(INFO_0510)).status_code == 200
        clock.now += 3
        assert (await client.get(INFO_0510)).status_code == 503
        assert await table.rank_address(0, 0, 0) is None


async def test_a_rank_restarted_at_a_new_port_replaces_its_entry(
    client: httpx.AsyncClient, table: SglangRankTable
) -> None:
    await put_all(client, [v0510(0), v0510(1)])
    await put_all(client, [v0510(1, rank_port=9999)])
    assert await table.rank_address(0, 1, 0) == RankAddress("10.0.0.6", 9999)
    info = await table.parallel_info()
    assert info is not None and (info.registered, info.complete) == (2, True)


async def test_new_parallel_config_on_a_complete_table_replaces_it(
    client: httpx.AsyncClient, table: SglangRankTable
) -> None:
    await put_all(client, [v0510(0), v0510(1)])
    await put_all(client, [v0510(0, tp=4, page_size=32)])  # restarted with tp 4
    info = await table.parallel_info()
    assert info is not None
    assert (info.tp_size, info.page_size, info.registered, info.complete) == (4, 32, 1, False)
    assert await table.rank_address(0, 1, 0) is None  # the old tp-2 ranks are gone


async def test_new_parallel_config_on_a_partial_table_is_refused(
    client: httpx.AsyncClient, table: SglangRankTable
) -> None:
    await put_all(client, [v0510(0)])
    response = await client.put("/route", json=v0510(1, page_size=32))
    assert response.status_code == 400
    assert "1 of 2 ranks registered" in response.text
    await table.reset()  # the operator's way out
    await put_all(client, [v0510(1, page_size=32)])
    info = await table.parallel_info()
    assert info is not None and (info.page_size, info.registered) == (32, 1)


async def test_namespaces_do_not_collide(mem: MemoryStore) -> None:
    first, second = SglangRankTable(mem, "default"), SglangRankTable(mem, "p1")
    async with client_for(first, second) as client:
        await put_all(client, [v0510(0, tp=1)])
        await put_all(client, [v0510(0, tp=1, rank_port=8000)], "/bootstrap/p1/route")
        assert (await client.get(lookup(0, 0))).json()["rank_port"] == 7200
        assert (await client.get("/bootstrap/default" + lookup(0, 0))).json()["rank_port"] == 7200
        assert (await client.get("/bootstrap/p1" + lookup(0, 0))).json()["rank_port"] == 8000
        assert (await client.get("/bootstrap/p1/health")).text == "OK"
        unknown = await client.get("/bootstrap/p2/health")
        assert (unknown.status_code, unknown.text) == (404, "Unknown bootstrap namespace: 'p2'")
        assert (await client.get("/bootstrap/p2" + INFO_0510)).status_code == 404


def test_namespace_names_are_checked(mem: MemoryStore) -> None:
    with pytest.raises(ValueError, match="invalid bootstrap namespace"):
        SglangRankTable(mem, "a/b")


# --- register_dp_rank / query_dp_ranks ------------------------------------------------------------


async def test_dp_rank_rooms_are_answered_for_known_rooms_and_expire(
    client: httpx.AsyncClient, clock: FakeClock
) -> None:
    for room, dp in ((11, 0), (2**63 - 1, 1)):
        response = await client.post(
            "/register_dp_rank", json={"bootstrap_room": room, "dp_rank": dp}
        )
        assert (response.status_code, response.text) == (200, "OK")
    query = {"bootstrap_rooms": [11, 12, 2**63 - 1]}
    answer = await client.post("/query_dp_ranks", json=query)
    assert answer.headers["content-type"] == JSON
    assert answer.text == '{"11": 0, "9223372036854775807": 1}'
    clock.now += 121
    assert (await client.post("/query_dp_ranks", json=query)).json() == {}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/register_dp_rank", {"bootstrap_room": 1}),
        ("/register_dp_rank", {"bootstrap_room": "x", "dp_rank": 0}),
        ("/register_dp_rank", {"bootstrap_room": 1, "dp_rank": -1}),
        ("/register_dp_rank", b"{"),
        ("/query_dp_ranks", {"bootstrap_rooms": 5}),
        ("/query_dp_ranks", {}),
        ("/query_dp_ranks", b"nope"),
    ],
)
async def test_bad_dp_rank_bodies_are_400(client: httpx.AsyncClient, path: str, body: Any) -> None:
    content = body if isinstance(body, bytes) else None
    response = await client.post(path, content=content, json=None if content else body)
    assert response.status_code == 400


# --- the router's own view, shared stores, a real socket ------------------------------------------


async def test_parallel_info_and_rank_address_for_the_router(table: SglangRankTable) -> None:
    assert await table.parallel_info() is None
    assert await table.rank_address(0, 0, 0) is None
    assert await table.register(v0510(0, dp=2, dp_rank=1, load_balance_method="round_robin"))
    info = await table.parallel_info()
    assert info is not None
    sizes = (info.dp_size, info.tp_size, info.pp_size, info.cp_size, info.page_size)
    assert sizes == (2, 2, 1, 1, 64)
    assert (info.follow_bootstrap_room, info.registered, info.complete) == (False, 1, False)
    assert await table.rank_address(dp=1, tp=0, pp=0) == RankAddress("10.0.0.6", 7300)


async def test_routers_sharing_a_store_see_one_table(store: RegistryStore) -> None:
    """Two routers (two tables over one store) on memory and on a real etcd."""
    one, two = SglangRankTable(store, "shared"), SglangRankTable(store, "shared")
    await one.register(v0510(0))
    await two.register(v0510(1))
    for table in (one, two):
        info = await table.parallel_info()
        assert info is not None and info.complete
    await two.register(v0510(0, tp=1, page_size=16))  # a restart seen through the other router
    assert await one.rank_address(0, 1, 0) is None
    await one.register_dp_rank(5, 1)
    assert await two.query_dp_ranks([5, 6]) == {"5": 1}


def test_namespace_app_on_a_real_socket() -> None:
    app = namespace_app(SglangRankTable(MemoryStore(), "p7"), None, PROTOCOL_ONLY)  # server loop
    with run_server(app) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        assert client.put("/route", json=v0510(0, tp=1)).text == "OK"
        assert client.get(INFO_0510).json()["attn_tp_size"] == 1
        assert client.get("/bootstrap/p7" + lookup(0, 0)).json()["rank_port"] == 7200
        assert client.get("/health").text == "OK"
        assert client.get("/bootstrap/other/health").status_code == 404


# --- store outages (registry/engine_api/last_good.py) ---------------------------------------------


async def test_lookups_answer_the_last_known_ranks_while_the_store_is_down(
    mem: MemoryStore,
) -> None:
    """Issue 11 item 4: a decode's first lookups during an etcd outage (parallel info, a rank it
    never asked for) get the last known table; rank registrations stay 503 (engines retry)."""
    store = Outage(mem)
    table = SglangRankTable(store, "default")
    async with client_for(table) as client:
        await put_all(client, [v0510(tp, dp=2, dp_rank=dp) for dp in (0, 1) for tp in (0, 1)])
        info = await client.get(INFO_0510)  # what the router's layout probe reads
        store.down = True
        for _ in range(3):
            again = await client.get(INFO_0510)
            assert (again.status_code, again.text) == (200, info.text)
            rank = await client.get(lookup(1, 1))
            assert rank.json() == {"rank_ip": "10.0.0.6", "rank_port": 7301}, rank.text
        assert (await client.get(lookup(2, 0))).status_code == 404  # the table knows it has none
        refused = await client.put("/route", json=v0510(0, dp=2, dp_rank=0, rank_port=9999))
        assert refused.status_code == 503, refused.text
        assert refused.text.startswith("Bootstrap registry unavailable")


async def test_dp_rank_rooms_registered_during_an_outage_are_kept_locally(
    mem: MemoryStore,
) -> None:
    """``register_dp_rank`` is accepted while the store is down (the room lives here for
    ``room_ttl``) and ``query_dp_ranks`` answers it, during the outage and after it."""
    store = Outage(mem)
    table = SglangRankTable(store, "default")
    async with client_for(table) as client:
        before = await client.post("/register_dp_rank", json={"bootstrap_room": 1, "dp_rank": 1})
        store.down = True
        during = await client.post("/register_dp_rank", json={"bootstrap_room": 2, "dp_rank": 0})
        assert [r.status_code for r in (before, during)] == [200, 200], during.text
        query = {"bootstrap_rooms": [1, 2, 3]}
        answer = await client.post("/query_dp_ranks", json=query)
        assert (answer.status_code, answer.json()) == (200, {"1": 1, "2": 0}), answer.text
        store.down = False
        assert (await client.post("/query_dp_ranks", json=query)).json() == {"1": 1, "2": 0}
