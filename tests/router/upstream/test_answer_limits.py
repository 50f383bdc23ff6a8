"""Engine answers read whole are bounded (issue 21, finding 5): both upstream clients.

An answer over ``max_answer_bytes`` (an error answer over ``max_error_answer_bytes``) fails the
leg with a 502 ``UpstreamUnavailable`` of kind ``answer_too_large`` that is no fault of the
worker's health, and its connection is closed: the engine stops sending, nothing more is read.
A stub engine on a real uvicorn socket sends the answers.
"""

from __future__ import annotations

from typing import Literal

import pytest

from router.errors import UpstreamUnavailable
from router.settings import UpstreamSettings
from router.upstream import build_upstream
from router.upstream.base import is_worker_fault
from router.workers import Role, Worker
from testkit.polling import await_until
from testkit.servers import run_server
from tests.router.api.stub_engine import StubEngine

Client = Literal["lean", "aiohttp", "httpx"]
CLIENTS: list[Client] = ["lean", "aiohttp", "httpx"]
MIB = 1 << 20
HUGE = 256 * MIB  # what the stub would send: far more than read


async def _read(engine: StubEngine, client: Client, whole: bool = False) -> bytes:
    settings = UpstreamSettings(
        client=client, max_answer_bytes=2 * MIB, max_error_answer_bytes=64 * 1024
    )
    with run_server(engine, lifespan="off") as port:
        upstream = build_upstream(Worker(Role.DECODE, f"http://127.0.0.1:{port}"), settings)
        try:
            response = await upstream.open("/v1/completions", b"{}", {}, whole=whole)
            return await response.read()
        finally:
            await upstream.aclose()


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("whole", [False, True])  # True: the client may wait for all of it
async def test_an_answer_within_the_limit_is_read_whole(
    client: Client, chunked: bool, whole: bool
) -> None:
    engine = StubEngine("flood", answer_bytes=2 * MIB, chunked=chunked)
    assert len(await _read(engine, client, whole)) == 2 * MIB


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("whole", [False, True])
async def test_an_answer_over_the_limit_fails_the_leg_and_drops_the_connection(
    client: Client, chunked: bool, whole: bool
) -> None:
    engine = StubEngine("flood", answer_bytes=HUGE, chunked=chunked)
    with pytest.raises(UpstreamUnavailable) as info:
        await _read(engine, client, whole)
    error = info.value
    assert error.status == 502 and error.kind == "answer_too_large"
    assert "exceeds the router's 2097152-byte limit (--max-answer-bytes)" in error.message
    assert not is_worker_fault(error)
    # the engine saw the connection close long before it could send its answer
    await await_until(lambda: engine.done, 10, "the engine stopped sending")
    assert engine.sent < HUGE // 4


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("whole", [False, True])
async def test_an_error_answer_is_read_up_to_its_own_small_limit(
    client: Client, whole: bool
) -> None:
    engine = StubEngine("flood", status=500, answer_bytes=MIB, chunked=True)
    with pytest.raises(UpstreamUnavailable) as info:
        await _read(engine, client, whole)
    message = info.value.message
    assert "HTTP 500 error answer exceeds the router's 65536-byte limit" in message
