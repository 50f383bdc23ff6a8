"""HealthProber against a real socket: closing it leaves no probe running."""

from __future__ import annotations

import asyncio
from typing import Any

from router.health import HealthProber
from router.settings import EngineProtocol, HealthSettings
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
