"""The fleet's GETs to its workers (router.fleet.probe_client), over real sockets to a real
uvicorn server: keep-alive, the answer bound, the time bound, credentials from the URL, a refused
port told apart, and the connections of workers that left closed."""

from __future__ import annotations

import asyncio
import base64
import time

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.errors import UpstreamError, UpstreamTimeout
from router.fleet.health import connection_refused
from router.fleet.probe_client import ProbeClient
from router.workers import Role, Worker
from testkit.servers import arun_server, free_port


class _Server:
    """Records each request's client port and headers; ``/big`` answers ``big`` bytes,
    ``/slow`` after ``slow_s``."""

    def __init__(self) -> None:
        self.ports: list[int] = []
        self.authorization: list[str | None] = []
        self.queries: list[str] = []
        self.big = 0
        self.slow_s = 0.0
        self.app = Starlette(
            routes=[
                Route("/health", self._health),
                Route("/big", self._big),
                Route("/slow", self._slow),
            ]
        )

    def _record(self, request: Request) -> None:
        assert request.client is not None
        self.ports.append(request.client.port)
        self.authorization.append(request.headers.get("authorization"))
        self.queries.append(request.url.query)

    async def _health(self, request: Request) -> Response:
        self._record(request)
        return Response(b"ok")

    async def _big(self, request: Request) -> Response:
        self._record(request)
        return Response(b"x" * self.big)

    async def _slow(self, request: Request) -> Response:
        self._record(request)
        await asyncio.sleep(self.slow_s)
        return Response(b"late")


async def test_reads_keep_one_connection_alive_and_send_the_query() -> None:
    server = _Server()
    async with arun_server(server.app) as port:
        client = ProbeClient(2.0)
        worker = Worker(Role.DECODE, f"http://127.0.0.1:{port}")
        try:
            for _ in range(5):
                answer = await client.get(worker, "/health?include=core,disagg")
                assert (answer.status, answer.body) == (200, b"ok")
            missing = await client.get(worker, "/nowhere")
        finally:
            await client.aclose()
    assert missing.status == 404
    assert len(set(server.ports)) == 1  # one keep-alive connection served every read
    assert server.queries[0] == "include=core,disagg"


async def test_an_answer_over_the_bound_fails_and_its_connection_is_closed() -> None:
    server = _Server()
    async with arun_server(server.app) as port:
        client = ProbeClient(2.0, max_answer_bytes=64 * 1024)
        worker = Worker(Role.PREFILL, f"http://127.0.0.1:{port}")
        try:
            server.big = 64 * 1024
            assert len((await client.get(worker, "/big")).body) == 64 * 1024
            server.big = 64 * 1024 + 1
            with pytest.raises(UpstreamError, match="65536-byte limit"):
                await client.get(worker, "/big")
            assert (await client.get(worker, "/health")).status == 200
        finally:
            await client.aclose()
    assert server.ports[0] == server.ports[1] != server.ports[2]  # closed after the refusal


async def test_a_read_is_bounded_in_time_whole() -> None:
    server = _Server()
    server.slow_s = 1.5
    async with arun_server(server.app) as port:
        client = ProbeClient(0.3)
        worker = Worker(Role.DECODE, f"http://127.0.0.1:{port}")
        started = time.monotonic()
        try:
            with pytest.raises(UpstreamTimeout):
                await client.get(worker, "/slow")
            waited = time.monotonic() - started
        finally:
            await client.aclose()
    assert waited < 1.0


async def test_a_url_password_goes_as_basic_authorization_unless_the_caller_sends_one() -> None:
    server = _Server()
    async with arun_server(server.app) as port:
        client = ProbeClient(2.0)
        worker = Worker(Role.DECODE, f"http://probe:s%40cret@127.0.0.1:{port}")
        plain = Worker(Role.DECODE, f"http://127.0.0.1:{port}")
        try:
            await client.get(worker, "/health")
            await client.get(worker, "/health", {"authorization": "Bearer engine-key"})
            await client.get(plain, "/health")
        finally:
            await client.aclose()
    basic = "Basic " + base64.b64encode(b"probe:s@cret").decode()
    assert server.authorization == [basic, "Bearer engine-key", None]


async def test_a_refused_port_is_told_apart() -> None:
    client = ProbeClient(2.0)
    worker = Worker(Role.DECODE, f"http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(UpstreamError) as failed:
            await client.get(worker, "/health")
    finally:
        await client.aclose()
    assert connection_refused(failed.value)


async def test_the_connections_of_workers_that_left_are_closed() -> None:
    server = _Server()
    async with arun_server(server.app) as port:
        client = ProbeClient(2.0)
        kept = Worker(Role.DECODE, f"http://127.0.0.1:{port}", id="kept")
        gone = Worker(Role.DECODE, f"http://127.0.0.1:{port}", id="gone")
        try:
            await client.get(kept, "/health")
            await client.get(gone, "/health")
            await client.prune({"kept"})
            await client.get(kept, "/health")
            await client.get(gone, "/health")  # back in the pool: a new connection
        finally:
            await client.aclose()
    kept_port, gone_port, kept_again, gone_again = server.ports
    assert kept_again == kept_port
    assert gone_again not in (gone_port, kept_port)
