"""HealthProber against a real socket: closing it leaves no probe running."""

from __future__ import annotations

import asyncio
from typing import Any

from router.fleet.circuit_breaker import build_circuits
from router.fleet.health import HealthProber
from router.settings import CircuitBreakerSettings, EngineProtocol, HealthSettings
from router.workers import Role, Worker, WorkerPool
from testkit.polling import await_until


def _probes() -> list[asyncio.Task[Any]]:
    return [
        task
        for task in asyncio.all_tasks()
        if getattr(task.get_coro(), "__qualname__", "") == "HealthProber.probe"
    ]


async def test_aclose_waits_for_the_refresh_probes_it_cancels() -> None:
    """A refresh probe stuck on an engine that never answers ends before ``aclose`` returns,
    so no probe outlives the HTTP client it uses."""
    connections: list[asyncio.StreamWriter] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        await reader.read()  # until the prober hangs up

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        prober = HealthProber(
            WorkerPool(needs_engine_ids=False),
            EngineProtocol.SGLANG,
            HealthSettings(timeout_s=30.0),
        )
        worker = Worker(Role.DECODE, f"http://127.0.0.1:{port}", id="d1")
        prober.refresh_soon(worker)
        await await_until(lambda: bool(connections), 5.0, "the probe to connect")
        [probe] = _probes()

        await prober.aclose()

        assert probe.done()
        assert probe.cancelled()
        assert _probes() == []
    finally:
        server.close()
        for writer in connections:
            writer.close()
        await server.wait_closed()


async def test_a_stall_that_fails_one_probe_round_flips_no_worker() -> None:
    """Issue 11, item 10: a 2 s stall of the router or the host made every probe of one round
    time out, and one failed probe took all 4 workers out in the same millisecond. One failed
    round is noise (``unhealthy_threshold`` 3 by default): every worker stays in. Only a stall
    that lasts three rounds takes them out."""
    answering = asyncio.Event()  # cleared: the host stalls, no /health is answered
    answering.set()

    async def health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            await answering.wait()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the prober gave up on this probe
        finally:
            writer.close()

    servers = [await asyncio.start_server(health, "127.0.0.1", 0) for _ in range(4)]
    pool: WorkerPool[None] = WorkerPool(needs_engine_ids=False)
    for server in servers:
        port = server.sockets[0].getsockname()[1]
        pool.add(Worker(Role.DECODE, f"http://127.0.0.1:{port}"), None)
    prober = HealthProber(pool, EngineProtocol.SGLANG, HealthSettings(timeout_s=0.3))
    try:
        await prober.probe_all()
        assert [w.healthy for w in pool.all()] == [True] * 4

        answering.clear()  # the stall: longer than the probe timeout
        await prober.probe_all()
        assert [w.probe_failures for w in pool.all()] == [1] * 4  # every probe failed ...
        assert [w.healthy for w in pool.all()] == [True] * 4  # ... and nobody flipped
        answering.set()
        await prober.probe_all()
        assert [w.probe_failures for w in pool.all()] == [0] * 4

        answering.clear()  # a stall of three rounds is no blip any more
        for _ in range(3):
            await prober.probe_all()
        assert [w.healthy for w in pool.all()] == [False] * 4
    finally:
        answering.set()
        await prober.aclose()
        for server in servers:
            server.close()
            await server.wait_closed()


async def test_a_worker_back_up_starts_with_closed_breakers() -> None:
    """A restarted worker (marked down when its port refused, its breaker open after the
    requests it refused) is routable as soon as its probes bring it back: its breaker and its
    pairs' are forgotten, not left open for another ``--breaker-open``."""

    async def health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(health, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool: WorkerPool[None] = WorkerPool(needs_engine_ids=False)
    decode = Worker(Role.DECODE, f"http://127.0.0.1:{port}")
    prefill = Worker(Role.PREFILL, "http://127.0.0.1:1", healthy=True)
    pool.add(decode, None)
    circuits = build_circuits(HealthSettings(failure_threshold=2), CircuitBreakerSettings())
    prober = HealthProber(pool, EngineProtocol.SGLANG, HealthSettings())
    prober.on_back = circuits.worker_back
    try:
        for _ in range(3):  # the requests it refused while it was down
            circuits.worker_failure(decode, "refused")
            circuits.pair_failure(prefill, decode, "refused")
        assert not circuits.worker_allows(decode)
        decode.healthy = False  # marked down (as a refused connection does)
        await prober.probe_all()
        assert decode.healthy
        assert circuits.worker_allows(decode) and circuits.pair_allows(prefill, decode)
    finally:
        await prober.aclose()
        server.close()
        await server.wait_closed()
