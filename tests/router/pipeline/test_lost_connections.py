"""Connections and workers lost under a request: a pooled keep-alive connection the engine had
closed is retried, and a prefill marked down while its leg waits ends the leg at once (and the
request goes to another prefill) instead of waiting out the 900 s prefill timeout."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import httpx

from router import create_app
from testkit.fake_cluster import FakeClusterFactory, serve_engine, settings_for
from testkit.fake_engine import FakeConfig, FakeEngine
from testkit.servers import run_server

COMPLETION = {"model": "fake-model", "prompt": "hello there", "max_tokens": 4}


@contextlib.contextmanager
def closing_reused_connections(target_port: int) -> Iterator[tuple[int, list[int]]]:
    """A TCP proxy to ``target_port`` that closes a connection when a second request arrives on
    it, as an engine closing an idle keep-alive connection just as the router reuses it. Yields
    its port and the count of connections it closed that way."""
    closed: list[int] = []
    ready = threading.Event()
    port: list[int] = []
    stop: list[asyncio.AbstractEventLoop] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", target_port)
        requests = 0

        async def back() -> None:
            with contextlib.suppress(ConnectionError):
                while data := await upstream_reader.read(65536):
                    writer.write(data)
                    await writer.drain()

        relay = asyncio.create_task(back())
        try:
            while data := await reader.read(65536):
                requests += data.count(b"POST ")
                if requests > 1:  # a reused connection: drop it without an answer
                    closed.append(1)
                    break
                upstream_writer.write(data)
                await upstream_writer.drain()
        finally:
            relay.cancel()
            writer.close()
            upstream_writer.close()

    def serve() -> None:
        async def main() -> None:
            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            port.append(server.sockets[0].getsockname()[1])
            stop.append(asyncio.get_running_loop())
            ready.set()
            async with server:
                await server.serve_forever()

        with contextlib.suppress(asyncio.CancelledError, RuntimeError):
            asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(5)
    try:
        yield port[0], closed
    finally:
        loop = stop[0]
        for task in asyncio.all_tasks(loop):
            loop.call_soon_threadsafe(task.cancel)
        thread.join(5)


def test_a_pooled_connection_closed_by_the_engine_is_retried() -> None:
    prefill = FakeEngine("prefill", "vllm-nixl", config=FakeConfig(check_kv=False))
    decode = FakeEngine("decode", "vllm-nixl", config=FakeConfig(check_kv=False))
    with (
        serve_engine(prefill) as (p_port, *_),
        serve_engine(decode) as (d_port, *_),
        closing_reused_connections(d_port) as (proxy_port, closed),
    ):
        settings = settings_for(
            "vllm-nixl", [(f"http://127.0.0.1:{p_port}", None)], [f"http://127.0.0.1:{proxy_port}"]
        )
        with (
            run_server(create_app(settings)) as router_port,
            httpx.Client(base_url=f"http://127.0.0.1:{router_port}", timeout=10) as client,
        ):
            deadline = time.monotonic() + 10
            while client.get("/ready").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            statuses = [
                client.post("/v1/completions", json=COMPLETION).status_code for _ in range(3)
            ]
            metrics = client.get("/metrics").text
    assert statuses == [200, 200, 200]
    assert closed  # the router did reuse a pooled connection the "engine" then dropped
    assert (
        f'pdr_upstream_errors_total{{kind="stale_connection",role="decode"}} {float(len(closed))}'
        in metrics
    )


def test_a_prefill_marked_down_mid_leg_sends_the_request_elsewhere(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("vllm-nixl", prefill=2)
    frozen = cluster.prefills[0].config
    frozen.hang, frozen.health_status = True, 500  # answers nothing, and probes fail
    with cluster.client() as client:
        started = time.monotonic()
        statuses = [client.post("/v1/completions", json=COMPLETION).status_code for _ in range(2)]
        elapsed = time.monotonic() - started
        metrics = client.get("/metrics").text
    assert statuses == [200, 200]
    assert cluster.prefills[0].records  # a leg did wait there, until the prefill went down
    assert elapsed < 10.0  # not the 900 s prefill timeout
    assert 'pdr_upstream_errors_total{kind="worker_lost",role="prefill"} 1.0' in metrics
