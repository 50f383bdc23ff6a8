"""pd-cluster waits, with ``--router-workers N``, until every router process can route: its
``/ready`` answers for the one process a connection reaches, and a sibling that heard of the
engines later answered 503 to the first requests (and to the benchmark's layout read)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from testkit.servers import run_servers
from worker.children import Children, wait_ready


def router_of_two(ready_after: int | None) -> tuple[FastAPI, list[int]]:
    """``/ready`` always 200 (the process that answers can route); the second process can
    route from the ``ready_after``-th status read on (None: never)."""
    app = FastAPI()
    reads = [0]

    @app.get("/ready")
    async def ready() -> JSONResponse:
        return JSONResponse({"status": "ready"})

    @app.get("/status/data")
    async def status() -> JSONResponse:
        reads[0] += 1
        second = ready_after is not None and reads[0] >= ready_after
        return JSONResponse(
            {"processes": [{"index": 0, "ready": True}, {"index": 1, "ready": second}]}
        )

    return app, reads


def test_it_waits_for_every_process_of_the_router() -> None:
    app, reads = router_of_two(ready_after=3)
    with run_servers(app) as (port,):
        wait_ready(f"http://127.0.0.1:{port}/ready", Children(), 10.0, processes=2)
    assert reads[0] == 3


def test_a_process_that_never_can_route_is_not_ready() -> None:
    app, _ = router_of_two(ready_after=None)
    with run_servers(app) as (port,), pytest.raises(SystemExit, match="not ready"):
        wait_ready(f"http://127.0.0.1:{port}/ready", Children(), 1.0, processes=2)
    with run_servers(app) as (port,):  # one process: its /ready is the router's
        wait_ready(f"http://127.0.0.1:{port}/ready", Children(), 1.0)
