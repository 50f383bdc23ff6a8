"""Upstream HTTP client cost: httpx (stock pool), httpx + our lean pool, aiohttp.

    python -m bench.load.clients [--concurrency 32] [--requests 3000] [--tokens 16]

Each client runs in its own process against one fast fake decode engine and does what the
router's decode leg does: POST a streaming completion and read every SSE chunk. Prints client CPU
per request and req/s, as ratios to stock httpx measured in the same invocation.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import httpx

from bench.common.process import free_port
from bench.common.ready import wait_http_ok

__all__ = ["main"]

CLIENTS = ("httpx", "httpx-lean", "aiohttp")
_NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


async def _closed_loop(
    one: Callable[[], Awaitable[None]], concurrency: int, requests: int
) -> tuple[float, float]:
    remaining = [requests]

    async def user() -> None:
        while remaining[0] > 0:
            remaining[0] -= 1
            await one()

    cpu, wall = time.process_time(), time.monotonic()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    return (time.process_time() - cpu) / requests * 1e6, requests / (time.monotonic() - wall)


async def _httpx(url: str, body: bytes, lean: bool, c: int, n: int) -> tuple[float, float]:
    from router.upstream.lean_pool import LeanPoolTransport

    transport: httpx.AsyncBaseTransport = (
        LeanPoolTransport(
            max_connections=4096, max_idle=1024, keepalive_expiry=4.0, socket_options=_NODELAY
        )
        if lean
        else httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=1024),
            socket_options=_NODELAY,
        )
    )
    async with httpx.AsyncClient(transport=transport, timeout=30) as client:

        async def one() -> None:
            request = client.build_request(
                "POST", url, content=body, headers={"content-type": "application/json"}
            )
            response = await client.send(request, stream=True)
            async for _ in response.aiter_raw():
                pass
            await response.aclose()

        await _closed_loop(one, c, max(c, n // 10))  # warm up the pool
        return await _closed_loop(one, c, n)


async def _aiohttp(url: str, body: bytes, c: int, n: int) -> tuple[float, float]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=4096)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            async with session.post(
                url, data=body, headers={"content-type": "application/json"}
            ) as response:
                while (await response.content.readchunk())[0]:
                    pass

        await _closed_loop(one, c, max(c, n // 10))
        return await _closed_loop(one, c, n)


def _child(client: str, url: str, concurrency: int, requests: int, tokens: int) -> None:
    import uvloop

    body = b'{"model":"fake-model","prompt":"hi","stream":true,"max_tokens":%d}' % tokens
    if client == "aiohttp":
        coro = _aiohttp(url, body, concurrency, requests)
    else:
        coro = _httpx(url, body, client == "httpx-lean", concurrency, requests)
    us, rps = uvloop.run(coro)
    print(f"{us:.1f} {rps:.1f}")


def _wait_health(url: str) -> None:
    if not wait_http_ok(url + "/health", time.monotonic() + 20):
        raise SystemExit(f"fake engine at {url} did not start")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench.load.clients", description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--child", choices=CLIENTS, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.url, args.concurrency, args.requests, args.tokens)
        return
    port = free_port()
    fake = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "testkit.fake_engine",
            "--role",
            "decode",
            "--protocol",
            "sglang",
            "--port",
            str(port),
            "--no-check-kv",
            "--tokens",
            str(args.tokens),
        ]
    )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_health(base)
        results = {}
        for client in CLIENTS:
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.load.clients",
                    "--child",
                    client,
                    "--url",
                    base + "/v1/completions",
                    "--concurrency",
                    str(args.concurrency),
                    "--requests",
                    str(args.requests),
                    "--tokens",
                    str(args.tokens),
                ],
                check=True,
                capture_output=True,
                text=True,
                timeout=300,
            ).stdout.split()
            results[client] = (float(out[0]), float(out[1]))
    finally:
        fake.terminate()
        fake.wait(timeout=10)
    base_us, base_rps = results["httpx"]
    print(
        f"streaming POST + {args.tokens} SSE events, C={args.concurrency}, "
        f"{args.requests} requests per client"
    )
    print(f"{'client':<12}{'CPU us/req':>12}{'vs httpx':>10}{'req/s':>10}{'vs httpx':>10}")
    for client, (us, rps) in results.items():
        print(f"{client:<12}{us:>12.0f}{us / base_us:>9.2f}x{rps:>10.0f}{rps / base_rps:>9.2f}x")


if __name__ == "__main__":
    main()
