"""vLLM Mooncake bootstrap API (registry/engine_api/vllm_*.py) against docs/concepts/protocols.md
3.2 and 3.6.

Answers are compared byte for byte with a copy of vLLM 0.32's own FastAPI server
(``mooncake_utils.py``: the same pydantic payload and handler logic), built below.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from registry.backends import MemoryStore, RegistryStore
from registry.backends.base import WatchEvent
from registry.engine_api import (
    RegisterWorkerPayload,
    SglangRankTable,
    VllmRankSnapshot,
    VllmRankTable,
    namespace_app,
    vllm_routes,
)
from registry.engine_api.app import BootstrapProtection
from registry.engine_api.rank_checks import RegistrationGuard
from registry.errors import NotFound, RegistryUnavailable
from registry.settings import DEFAULT_BOOTSTRAP_ALLOW
from testkit.servers import run_server

# the protocol on a real listener: loopback allowed, the test's made-up rank addresses unchecked
PROTOCOL_ONLY = BootstrapProtection(
    allow=DEFAULT_BOOTSTRAP_ALLOW,
    max_body_bytes=1 << 20,
    guard=RegistrationGuard(check_reachable=False),
)


def worker(
    dp: int = 0, tp: int = 0, pp: int = 0, *, engine: str = "eng-a", addr: str | None = None
) -> dict[str, Any]:
    return {
        "engine_id": f"{engine}_dp{dp}",
        "dp_rank": dp,
        "tp_rank": tp,
        "pp_rank": pp,
        "addr": addr or f"tcp://10.0.0.{dp + 1}:{40000 + 10 * tp + pp}",
    }


# --- vLLM 0.32's server, the reference for byte-level answers ------------------------------------


class ReferencePayload(BaseModel):
    engine_id: str
    dp_rank: int
    tp_rank: int
    pp_rank: int
    addr: str


def reference_vllm_app() -> FastAPI:
    """The logic of vLLM 0.32 ``MooncakeBootstrapServer.register_worker`` in a fresh app."""
    app = FastAPI()
    workers: dict[int, dict[str, Any]] = {}

    @app.post("/register")
    async def register_worker(payload: ReferencePayload) -> dict[str, str]:
        entry = workers.setdefault(
            payload.dp_rank, {"engine_id": payload.engine_id, "worker_addr": {}}
        )
        if entry["engine_id"] != payload.engine_id:
            raise HTTPException(
                400,
                f"Engine ID mismatch for dp_rank={payload.dp_rank}: "
                f"expected {entry['engine_id']}, got {payload.engine_id}",
            )
        tp_entry = entry["worker_addr"].setdefault(payload.tp_rank, {})
        existing = tp_entry.get(payload.pp_rank)
        if existing is not None:
            if existing == payload.addr:
                return {"status": "ok"}
            raise HTTPException(
                400,
                f"Worker with dp_rank={payload.dp_rank}, "
                f"tp_rank={payload.tp_rank}, pp_rank={payload.pp_rank} "
                f"is already registered at {existing}, "
                f"but still want to register at {payload.addr}",
            )
        tp_entry[payload.pp_rank] = payload.addr
        return {"status": "ok"}

    @app.get("/query")
    async def query() -> dict[int, Any]:
        return workers

    return app


# --- fixtures -------------------------------------------------------------------------------------


@pytest.fixture
async def mem() -> AsyncIterator[MemoryStore]:
    store = MemoryStore()
    yield store
    await store.close()


def resolver(*tables: VllmRankTable) -> Any:
    by_name = {table.namespace: table for table in tables}

    def resolve(name: str) -> VllmRankTable:
        if name not in by_name:
            raise NotFound(f"Unknown bootstrap namespace: {name!r}")
        return by_name[name]

    return resolve


def client_of(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bootstrap")


def client_for(*tables: VllmRankTable) -> httpx.AsyncClient:
    app = FastAPI()
    app.include_router(vllm_routes(resolver(*tables)))
    return client_of(app)


@pytest.fixture
def table(mem: MemoryStore) -> VllmRankTable:
    return VllmRankTable(mem, "default")


@pytest.fixture
async def client(table: VllmRankTable) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(table) as client:
        yield client


@pytest.fixture
async def reference() -> AsyncIterator[httpx.AsyncClient]:
    async with client_of(reference_vllm_app()) as client:
        yield client


async def register_ok(
    client: httpx.AsyncClient, *bodies: dict[str, Any], path: str = "/register"
) -> None:
    for body in bodies:
        response = await client.post(path, json=body)
        assert (response.status_code, response.text) == (200, '{"status":"ok"}'), response.text


async def both(
    client: httpx.AsyncClient, reference: httpx.AsyncClient, method: str, path: str, **kwargs: Any
) -> httpx.Response:
    """Send to the registry and to vLLM's server; the answers must be identical."""
    ours = await client.request(method, path, **kwargs)
    theirs = await reference.request(method, path, **kwargs)
    assert (ours.status_code, ours.headers["content-type"], ours.content) == (
        theirs.status_code,
        theirs.headers["content-type"],
        theirs.content,
    )
    return ours


# --- vLLM >= 0.32 semantics, byte for byte --------------------------------------------------------


async def test_register_and_query_match_vllm(
    client: httpx.AsyncClient, reference: httpx.AsyncClient
) -> None:
    for body in (worker(0, 0), worker(0, 1), worker(1, 0), worker(1, 1)):
        assert (await both(client, reference, "POST", "/register", json=body)).json() == {
            "status": "ok"
        }
    answer = await both(client, reference, "GET", "/query")
    assert answer.json() == {
        "0": {
            "engine_id": "eng-a_dp0",
            "worker_addr": {"0": {"0": "tcp://10.0.0.1:40000"}, "1": {"0": "tcp://10.0.0.1:40010"}},
        },
        "1": {
            "engine_id": "eng-a_dp1",
            "worker_addr": {"0": {"0": "tcp://10.0.0.2:40000"}, "1": {"0": "tcp://10.0.0.2:40010"}},
        },
    }


async def test_identical_re_registration_is_idempotent(
    client: httpx.AsyncClient, reference: httpx.AsyncClient
) -> None:
    for _ in range(2):
        await both(client, reference, "POST", "/register", json=worker(0, 0))


async def test_same_rank_at_another_address_is_400(
    client: httpx.AsyncClient, reference: httpx.AsyncClient
) -> None:
    await both(client, reference, "POST", "/register", json=worker(0, 0))
    await both(client, reference, "POST", "/register", json=worker(0, 1))
    moved = worker(0, 0, addr="tcp://10.0.0.9:1")
    answer = await both(client, reference, "POST", "/register", json=moved)
    assert answer.status_code == 400
    assert answer.json() == {
        "detail": "Worker with dp_rank=0, tp_rank=0, pp_rank=0 is already "
        "registered at tcp://10.0.0.1:40000, but still want to register "
        "at tcp://10.0.0.9:1"
    }


async def test_engine_id_mismatch_while_incomplete_is_400(
    mem: MemoryStore, reference: httpx.AsyncClient
) -> None:
    async with client_for(VllmRankTable(mem, "default", tp_size=2)) as client:
        await both(client, reference, "POST", "/register", json=worker(0, 0))
        answer = await both(
            client, reference, "POST", "/register", json=worker(0, 1, engine="eng-b")
        )
    assert answer.json() == {
        "detail": "Engine ID mismatch for dp_rank=0: expected eng-a_dp0, got eng-b_dp0"
    }


@pytest.mark.parametrize(
    "body",
    [
        {"engine_id": "e", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0},
        {"engine_id": "e", "dp_rank": "zero", "tp_rank": 0, "pp_rank": 0, "addr": "tcp://a:1"},
        {"engine_id": 7, "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://a:1"},
        [],
        b"{not json",
    ],
)
async def test_schema_errors_are_vllms_422(
    client: httpx.AsyncClient, reference: httpx.AsyncClient, body: Any
) -> None:
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    assert (await both(client, reference, "POST", "/register", **kwargs)).status_code == 422


async def test_wrong_methods_are_405(
    client: httpx.AsyncClient, reference: httpx.AsyncClient
) -> None:
    assert (await both(client, reference, "GET", "/register")).status_code == 405
    assert (await both(client, reference, "POST", "/query")).status_code == 405


async def test_answers_do_not_depend_on_the_hosting_apps_error_handlers(mem: MemoryStore) -> None:
    app = FastAPI()

    async def openai_style(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"error": "host"}, status_code=400)

    app.add_exception_handler(RequestValidationError, openai_style)
    app.add_exception_handler(HTTPException, openai_style)
    app.include_router(vllm_routes(resolver(VllmRankTable(mem, "default"))))
    async with client_of(app) as client:
        invalid = await client.post("/register", json={"engine_id": "e"})
        assert invalid.status_code == 422 and "detail" in invalid.json()
        await register_ok(client, worker(0, 0))
        moved = await client.post("/register", json=worker(0, 0, addr="tcp://x:1"))
        assert moved.status_code == 400 and moved.json()["detail"].startswith("Worker with")


# --- completeness ---------------------------------------------------------------------------------


async def test_query_hides_incomplete_engines_by_configured_size(mem: MemoryStore) -> None:
    table = VllmRankTable(mem, "default", tp_size=2, dp_size=2)
    async with client_for(table) as client:
        await register_ok(client, worker(0, 0), worker(1, 0))
        assert (await client.get("/query")).json() == {}
        await register_ok(client, worker(1, 1))
        assert list((await client.get("/query")).json()) == ["1"]
    assert await table.snapshot() == VllmRankSnapshot(2, (None, "eng-a_dp1"), 0, False)


@pytest.mark.parametrize(
    ("ranks", "complete"),
    [
        ([(0, 0)], True),
        ([(0, 0), (2, 0)], False),  # tp 1 missing
        ([(0, 0), (1, 0), (0, 1)], False),  # (tp 1, pp 1) missing
        ([(0, 0), (1, 0), (0, 1), (1, 1)], True),
        ([(1, 0)], False),
    ],
)
async def test_without_sizes_a_dp_rank_is_complete_when_its_ranks_fill_a_rectangle(
    table: VllmRankTable, client: httpx.AsyncClient, ranks: list[tuple[int, int]], complete: bool
) -> None:
    await register_ok(client, *(worker(0, tp, pp) for tp, pp in ranks))
    assert ("0" in (await client.get("/query")).json()) is complete
    assert (await table.snapshot()).complete is complete


async def test_without_dp_size_every_dp_rank_up_to_the_highest_counts(
    table: VllmRankTable, client: httpx.AsyncClient
) -> None:
    await register_ok(client, worker(1, 0))
    assert await table.snapshot() == VllmRankSnapshot(2, (None, "eng-a_dp1"), 0, False)
    await register_ok(client, worker(0, 0))
    assert await table.snapshot() == VllmRankSnapshot(2, ("eng-a_dp0", "eng-a_dp1"), 0, True)


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        (worker(0, 2), "Invalid tp_rank=2: must be >= 0 < tp_size=2"),
        (worker(0, 0, 1), "Invalid pp_rank=1: must be >= 0 < pp_size=1"),
        (worker(2, 0), "Invalid dp_rank=2: must be >= 0 < dp_size=2"),
        (worker(0, -1), "Invalid tp_rank=-1: must be >= 0 < tp_size=2"),
    ],
)
async def test_ranks_outside_the_configured_sizes_are_400(
    mem: MemoryStore, body: dict[str, Any], detail: str
) -> None:
    async with client_for(VllmRankTable(mem, "default", tp_size=2, pp_size=1, dp_size=2)) as client:
        response = await client.post("/register", json=body)
    assert (response.status_code, response.json()) == (400, {"detail": detail})


def test_sizes_must_be_positive(mem: MemoryStore) -> None:
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        VllmRankTable(mem, "default", tp_size=0)


# --- the restart rule -----------------------------------------------------------------------------


async def test_new_engine_on_a_complete_table_starts_a_new_epoch(
    table: VllmRankTable, client: httpx.AsyncClient
) -> None:
    await register_ok(client, worker(0, 0), worker(0, 1), worker(1, 0), worker(1, 1))
    assert await table.epoch() == 0
    restarted = worker(0, 0, engine="eng-b", addr="tcp://10.0.0.1:50000")  # new ports too
    await register_ok(client, restarted)
    assert await table.epoch() == 1
    assert await table.snapshot() == VllmRankSnapshot(
        1, ("eng-b_dp0",), 1, True
    )  # old dp 1 dropped
    await register_ok(client, worker(1, 0, engine="eng-b"))
    assert (await client.get("/query")).json() == {
        "0": {"engine_id": "eng-b_dp0", "worker_addr": {"0": {"0": "tcp://10.0.0.1:50000"}}},
        "1": {"engine_id": "eng-b_dp1", "worker_addr": {"0": {"0": "tcp://10.0.0.2:40000"}}},
    }


async def test_same_engine_at_a_new_address_stays_400_on_a_complete_table(
    client: httpx.AsyncClient,
) -> None:
    await register_ok(client, worker(0, 0))
    response = await client.post("/register", json=worker(0, 0, addr="tcp://10.0.0.1:1"))
    assert response.status_code == 400
    assert response.json()["detail"].startswith("Worker with dp_rank=0, tp_rank=0, pp_rank=0")


async def test_reset_unblocks_a_table_stuck_half_registered(mem: MemoryStore) -> None:
    table = VllmRankTable(mem, "default", tp_size=2)
    async with client_for(table) as client:
        await register_ok(client, worker(0, 0))  # the old engine died before tp 1 registered
        refused = await client.post("/register", json=worker(0, 0, engine="eng-b"))
        assert refused.status_code == 400
        await table.reset()
        await register_ok(client, worker(0, 0, engine="eng-b"), worker(0, 1, engine="eng-b"))
    assert await table.snapshot() == VllmRankSnapshot(1, ("eng-b_dp0",), 1, True)


async def test_routers_sharing_a_store_share_the_epoch(store: RegistryStore) -> None:
    """Two routers (two tables over one store), on memory and on a real etcd."""
    one, two = VllmRankTable(store, "shared"), VllmRankTable(store, "shared")
    await one.register(RegisterWorkerPayload(**worker(0, 0)))
    await two.register(RegisterWorkerPayload(**worker(0, 0)))  # idempotent through the other router
    await two.register(RegisterWorkerPayload(**worker(0, 0, engine="eng-b")))  # a restart
    assert await one.epoch() == 1
    assert await one.snapshot() == VllmRankSnapshot(1, ("eng-b_dp0",), 1, True)
    assert (await one.query())["0"]["engine_id"] == "eng-b_dp0"


# --- namespaces, failures, a real socket ----------------------------------------------------------


async def test_two_prefill_instances_in_two_namespaces_do_not_collide(mem: MemoryStore) -> None:
    first, second = VllmRankTable(mem, "default"), VllmRankTable(mem, "p1")
    async with client_for(first, second) as client:
        await register_ok(client, worker(0, 0))
        await register_ok(client, worker(0, 0, engine="eng-b"), path="/bootstrap/p1/register")
        plain = (await client.get("/query")).json()
        named = (await client.get("/bootstrap/p1/query")).json()
        assert (await client.get("/bootstrap/default/query")).json() == plain
        unknown = await client.get("/bootstrap/p2/query")
    assert (plain["0"]["engine_id"], named["0"]["engine_id"]) == ("eng-a_dp0", "eng-b_dp0")
    assert (unknown.status_code, unknown.json()) == (
        404,
        {"detail": "Unknown bootstrap namespace: 'p2'"},
    )


async def test_unreachable_store_is_503(mem: MemoryStore, client: httpx.AsyncClient) -> None:
    await mem.close()
    response = await client.post("/register", json=worker(0, 0))
    assert response.status_code == 503
    assert response.json()["detail"].startswith("Bootstrap registry unavailable")
    assert (await client.get("/query")).status_code == 503


def test_namespace_app_serves_both_engines_on_a_real_socket() -> None:
    store = MemoryStore()  # used on the server's event loop only
    app = namespace_app(SglangRankTable(store, "p3"), VllmRankTable(store, "p3"), PROTOCOL_ONLY)
    with run_server(app) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        assert client.post("/register", json=worker(0, 0)).json() == {"status": "ok"}
        assert client.get("/query").json()["0"]["engine_id"] == "eng-a_dp0"
        assert client.get("/bootstrap/p3/query").json()["0"]["engine_id"] == "eng-a_dp0"
        assert client.get("/route?engine_rank=-1&target_dp_group=-1").status_code == 503
        assert client.get("/health").text == "OK"


def test_namespace_app_needs_a_table() -> None:
    with pytest.raises(ValueError, match="needs an SGLang or a vLLM"):
        namespace_app(None, None, PROTOCOL_ONLY)


# --- store outages (registry/engine_api/last_good.py) ---------------------------------------------


class Outage:
    """A store that can be taken down: every call raises ``RegistryUnavailable`` meanwhile."""

    def __init__(self, store: RegistryStore) -> None:
        self.store = store
        self.down = False
        self.refused = 0  # calls made while down

    def _check(self) -> None:
        if self.down:
            self.refused += 1
            raise RegistryUnavailable("etcd get failed: connection refused")

    async def put(self, key: str, value: bytes, *, ttl: float | None = None) -> None:
        self._check()
        await self.store.put(key, value, ttl=ttl)

    async def refresh(self, key: str) -> bool:
        self._check()
        return await self.store.refresh(key)

    async def get(self, key: str) -> bytes | None:
        self._check()
        return await self.store.get(key)

    async def list(self, prefix: str) -> dict[str, bytes]:
        self._check()
        return await self.store.list(prefix)

    async def delete(self, key: str) -> bool:
        self._check()
        return await self.store.delete(key)

    def watch(self, prefix: str) -> AsyncIterator[WatchEvent]:
        return self.store.watch(prefix)

    async def close(self) -> None:
        await self.store.close()


async def test_lookups_answer_the_last_known_table_while_the_store_is_down(
    mem: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 11 item 4: decodes looking a prefill up during an etcd outage get the last known
    table (vLLM ``GET /query``), including this router's own writes never read back; the store is
    asked again at most about once a second meanwhile; registrations stay 503 (vLLM retries)."""
    caplog.set_level(logging.INFO, logger="registry.engine_api.last_good")
    store = Outage(mem)
    table = VllmRankTable(store, "default", dp_size=2)
    async with client_for(table) as client:
        await register_ok(client, worker(0, 0), worker(1, 0))  # written here, never queried
        store.down = True
        answers = [await client.get("/query") for _ in range(20)]
        first = answers[0].text
        assert {(a.status_code, a.text) for a in answers} == {(200, first)}, first
        assert set(answers[0].json()) == {"0", "1"}
        assert store.refused < 10  # not once per lookup: the snapshot answers meanwhile
        assert (await table.snapshot()).engine_ids == ("eng-a_dp0", "eng-a_dp1")
        assert await table.address_of(1, 0, 0) == worker(1, 0)["addr"]  # from the listed table
        refused = await client.post("/register", json=worker(1, 1))
        assert refused.status_code == 503, refused.text

        store.down = False
        await register_ok(client, worker(1, 1))
        assert (await client.get("/query")).json()["1"]["worker_addr"] == {
            "0": {"0": worker(1, 0)["addr"]},
            "1": {"0": worker(1, 1)["addr"]},
        }
    outage_logs = [r.getMessage() for r in caplog.records if "last_good" in r.name]
    assert len(outage_logs) == 2, outage_logs  # one when it went down, one when it came back
    assert "store unavailable" in outage_logs[0]
    assert "reachable again" in outage_logs[1]


async def test_a_lookup_the_snapshot_cannot_answer_is_still_503(mem: MemoryStore) -> None:
    store = Outage(mem)
    async with client_for(VllmRankTable(store, "default")) as client:
        store.down = True
        response = await client.get("/query")
    assert response.status_code == 503
    assert response.json()["detail"].startswith("Bootstrap registry unavailable")
