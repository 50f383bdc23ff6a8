"""Bounded memory under the hostile re-test's attacks (issue 21, finding 5).

The router runs as a child process (``python -m router``) so that its RSS is its own, in front
of stub engines that never parse what they get. The attacks: 8 concurrent 28 MB ``logit_bias``
bodies (they took the router from 84 to 1,838 MB and stalled ``/health`` 6.3 s) and a 256 MB
non-streaming engine answer (829 MB). ``/health`` is polled from a process of its own.
"""

from __future__ import annotations

import asyncio
import functools
import signal
import subprocess
import sys
from functools import partial

import httpx
import msgspec

from testkit.polling import await_until, wait_until
from testkit.servers import run_servers
from tests.router.api.stub_engine import RouterProcess, StubEngine, rss_bytes, run_router

MB = 1 << 20
ATTACKERS = 8


@functools.cache
def attack_body() -> bytes:
    """The attack's body: 2,000,000 logit_bias entries, 27.5 MB."""
    bias = {str(token): -100 for token in range(2_000_000)}
    return msgspec.json.encode({"model": "m", "prompt": "x", "logit_bias": bias})


HEADERS = {"content-type": "application/json"}

_POLLER = """
import signal, sys, time, httpx
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
waits = []
with httpx.Client(timeout=30) as client:
    print("polling", flush=True)
    while not stop:
        started = time.perf_counter()
        assert client.get(sys.argv[1]).status_code == 200
        waits.append(time.perf_counter() - started)
        time.sleep(0.005)
print(max(waits), sorted(waits)[len(waits) // 2], len(waits), flush=True)
"""


async def _attack(router: RouterProcess) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=router.url, timeout=60) as client:
        posts = [
            client.post("/v1/completions", content=attack_body(), headers=HEADERS)
            for _ in range(ATTACKERS)
        ]
        return await asyncio.gather(*posts)


def test_big_bodies_leave_health_responsive_and_rss_bounded() -> None:
    """With the default budget all 8 bodies are admitted: the large field stays raw (no 10x
    parse) and the bodies are checked and decoded one at a time in loop steps of ~20 ms, so
    /health answers at once. Measured on the 2-core dev machine: quiet, p50 1-2 ms and worst
    ~100-130 ms; with other test runs loading it (load average 5), worst 0.15-0.5 s. Unfixed:
    worst 3.0-3.3 s (each body's parse alone holds the loop ~0.85 s), RSS +1,700 MB. The
    bound on the worst wait is the loaded machine's, with a margin."""
    engine = StubEngine("refuse")
    with (
        run_servers(engine, engine, lifespan="off") as (prefill, decode),
        run_router(f"http://127.0.0.1:{prefill}", f"http://127.0.0.1:{decode}") as router,
    ):
        before = rss_bytes(router.pid)
        with subprocess.Popen(
            [sys.executable, "-c", _POLLER, router.url + "/health"],
            stdout=subprocess.PIPE,
            text=True,
        ) as poller:
            assert poller.stdout is not None
            assert poller.stdout.readline() == "polling\n"
            responses = asyncio.run(_attack(router))
            poller.send_signal(signal.SIGTERM)
            longest, median, polls = map(float, poller.communicate(timeout=30)[0].split())
        grown = rss_bytes(router.pid, "VmHWM") - before
    assert polls >= 10
    assert median < 0.1 and longest < 1.0, (longest, median)
    # the bodies' bytes and their copies for the prefill leg, 2x (unfixed: 1,700 MB, ~8x)
    assert grown < ATTACKERS * len(attack_body()) * 2.5, grown / MB
    assert [r.status_code for r in responses] == [400] * ATTACKERS  # the stub's refusal


def test_bodies_past_the_memory_budget_get_429_before_they_are_read() -> None:
    engine = StubEngine("hang")
    budget = str(300 * MB)  # one 27.5 MB body holds 8x its size: room for one only
    with (
        run_servers(engine, engine, lifespan="off") as (prefill, decode),
        run_router(
            f"http://127.0.0.1:{prefill}",
            f"http://127.0.0.1:{decode}",
            "--max-body-memory",
            budget,
        ) as router,
    ):
        before = rss_bytes(router.pid)

        async def attack() -> None:
            async with httpx.AsyncClient(base_url=router.url, timeout=60) as client:
                posts = [
                    asyncio.create_task(
                        client.post("/v1/completions", content=attack_body(), headers=HEADERS)
                    )
                    for _ in range(ATTACKERS)
                ]
                done: set[asyncio.Task[httpx.Response]] = set()
                pending = set(posts)
                async with asyncio.timeout(30):  # all but the one held are answered at once
                    while len(done) < ATTACKERS - 1:
                        finished, pending = await asyncio.wait(
                            pending, return_when="FIRST_COMPLETED"
                        )
                        done |= finished
                assert len(pending) == 1  # held by the hanging engine
                for task in done:
                    response = task.result()
                    assert response.status_code == 429 and response.headers["retry-after"]
                    error = response.json()["error"]
                    assert error["type"] == "rate_limit_exceeded"
                    assert "--max-body-memory" in error["message"]
                await asyncio.to_thread(wait_until, lambda: engine.received == 1, 10, "held")
                grown = rss_bytes(router.pid, "VmHWM") - before
                assert grown < 4 * len(attack_body()), grown / MB  # the held body, not eight
                for task in pending:
                    task.cancel()  # its client leaves: its share comes back
                await asyncio.gather(*pending, return_exceptions=True)
                await _admitted_again(client, engine)

        asyncio.run(attack())


def _answered_or_held(retry: asyncio.Task[httpx.Response], engine: StubEngine) -> bool:
    return retry.done() or engine.received == 2


async def _admitted_again(client: httpx.AsyncClient, engine: StubEngine) -> None:
    """A body is admitted again once the router has seen the held request's client leave (a
    retry sent before that gets 429, as it should: then it is sent again)."""
    async with asyncio.timeout(10):
        while True:
            retry = asyncio.create_task(
                client.post("/v1/completions", content=attack_body(), headers=HEADERS)
            )
            await await_until(partial(_answered_or_held, retry, engine), 10, "an answer")
            if engine.received == 2:
                break
            assert retry.result().status_code == 429
    retry.cancel()
    await asyncio.gather(retry, return_exceptions=True)


def test_an_engine_answer_over_the_limit_is_a_502_and_is_not_buffered() -> None:
    prefill = StubEngine("flood", answer_bytes=256 * MB, chunked=True)
    decode = StubEngine("refuse")
    with (
        run_servers(prefill, decode, lifespan="off") as (prefill_port, decode_port),
        run_router(
            f"http://127.0.0.1:{prefill_port}",
            f"http://127.0.0.1:{decode_port}",
            "--max-answer-bytes",
            str(4 * MB),
        ) as router,
    ):
        before = rss_bytes(router.pid)
        body = {"model": "m", "prompt": "x"}
        with httpx.Client(base_url=router.url, timeout=30) as client:
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 502
            message = response.json()["error"]["message"]
            assert "exceeds the router's 4194304-byte limit (--max-answer-bytes)" in message
            wait_until(lambda: prefill.done, 10, "the engine saw the connection close")
            assert prefill.sent < 64 * MB
            assert rss_bytes(router.pid, "VmHWM") - before < 32 * MB
            prefill.chunked = False  # with a Content-Length over the limit: not even read
            prefill.sent = 0
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 502 and "of 268435456 bytes" in response.text
            ready = client.get("/ready").json()  # the prefill is not held to blame
            assert all(worker["healthy"] for worker in ready["prefill"])
