"""bench.soak.traffic's outcome classes and pd-worker's opt-in fault API (the soak's hooks)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from bench.soak.traffic import RequestSpec, send
from testkit.polling import wait_until
from testkit.servers import run_server
from worker.app import SimWorker, WorkerConfig, create_app

COMPLETION = RequestSpec("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 4})
STREAM = RequestSpec("/v1/completions", {**COMPLETION.body, "stream": True})
EVENT = b'data: {"choices": [{"text": "a"}]}\n\n'
ERROR = b'{"error": {"message": "KV pool full", "code": 503}}'


async def _truncated() -> AsyncIterator[bytes]:
    yield EVENT
    raise httpx.RemoteProtocolError("peer closed connection without sending complete message")


async def _slow() -> AsyncIterator[bytes]:
    yield EVENT
    await asyncio.sleep(5)
    yield b"data: [DONE]\n\n"


def _classify(spec: RequestSpec, response: httpx.Response, deadline_s: float = 2.0) -> str:
    async def go() -> str:
        transport = httpx.MockTransport(lambda _request: response)
        async with httpx.AsyncClient(transport=transport) as http:
            outcome = await send(http, "http://x", spec, deadline_s, time.monotonic)
        return outcome.kind

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("spec", "response", "kind"),
    [
        (COMPLETION, httpx.Response(200, json={"choices": [{"text": "ab"}]}), "ok"),
        (COMPLETION, httpx.Response(200, json={"id": "x"}), "unclean"),
        (COMPLETION, httpx.Response(503, content=ERROR), "error"),
        (COMPLETION, httpx.Response(500, text="Internal Server Error"), "unclean"),
        (STREAM, httpx.Response(200, content=EVENT + b"data: [DONE]\n\n"), "ok"),
        (STREAM, httpx.Response(200, content=EVENT + b"data: " + ERROR + b"\n\n"), "error"),
        (STREAM, httpx.Response(200, content=EVENT), "unclean"),  # no [DONE], no error event
        (STREAM, httpx.Response(200, content=_truncated()), "unclean"),
    ],
)
def test_outcome_classes(spec: RequestSpec, response: httpx.Response, kind: str) -> None:
    assert _classify(spec, response) == kind


def test_a_request_past_its_deadline_is_hung() -> None:
    assert _classify(STREAM, httpx.Response(200, content=_slow()), deadline_s=0.2) == "hung"


def _worker_app(fault_api: bool) -> FastAPI:
    return create_app(SimWorker(WorkerConfig("both"), None), fault_api=fault_api)


def test_fault_api_is_off_by_default() -> None:
    with run_server(_worker_app(False)) as port:
        url = f"http://127.0.0.1:{port}"
        assert httpx.post(f"{url}/debug/fault", json={"http_5xx_s": 5}).status_code == 404
        assert httpx.post(f"{url}/v1/completions", json=COMPLETION.body).status_code == 200


def test_fault_api_injects_5xx_for_a_while_and_slow_decoding() -> None:
    with run_server(_worker_app(True)) as port:
        url = f"http://127.0.0.1:{port}"
        assert httpx.post(f"{url}/debug/fault", json={"bogus": 1}).status_code == 400
        state = httpx.post(f"{url}/debug/fault", json={"http_5xx_s": 0.5}).json()
        assert state["http_5xx_left_s"] > 0
        failed = httpx.post(f"{url}/v1/completions", json=COMPLETION.body)
        assert failed.status_code == 500 and failed.json()["error"]["code"] == 500
        wait_until(
            lambda: httpx.post(f"{url}/v1/completions", json=COMPLETION.body).status_code == 200,
            5.0,
            "the injected 5xx window to end",
            interval=0.05,
        )
        assert httpx.get(f"{url}/debug/fault").json()["served_ok"] == 1
        httpx.post(f"{url}/debug/fault", json={"slow_s": 5, "slow_s_per_token": 0.05})
        started = time.monotonic()
        assert httpx.post(f"{url}/v1/completions", json=COMPLETION.body).status_code == 200
        assert time.monotonic() - started >= 4 * 0.05
