"""The fake engine itself: wire format, PD field checks, KV rendezvous and disconnects."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest

from testkit.fake_engine import FakeConfig, FakeEngine
from testkit.servers import run_servers

MODEL = "fake-model"
CHAT = [{"role": "user", "content": "hello there"}]


def asgi_client(engine: FakeEngine) -> httpx.AsyncClient:
    """In-process client: enough for validation and formatting (no KV rendezvous)."""
    transport = httpx.ASGITransport(app=engine.app)
    return httpx.AsyncClient(transport=transport, base_url="http://fake")


def socket_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=5.0, trust_env=False)


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def mooncake_prefill_body(transfer_id: str) -> dict[str, Any]:
    kv = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
    return {
        "model": MODEL,
        "messages": CHAT,
        "stream": False,
        "max_tokens": 1,
        "kv_transfer_params": kv,
    }


def mooncake_decode_body(transfer_id: str, engine_id: str, bootstrap_port: int) -> dict[str, Any]:
    kv = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_engine_id": engine_id,
        "remote_bootstrap_addr": f"http://127.0.0.1:{bootstrap_port}",
    }
    return {"model": MODEL, "messages": CHAT, "max_tokens": 4, "kv_transfer_params": kv}


def sglang_body(bootstrap_port: int, rooms: int | list[int], **extra: Any) -> dict[str, Any]:
    many = isinstance(rooms, list)
    count = len(rooms) if isinstance(rooms, list) else 1
    body = {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 3,
        "bootstrap_host": ["127.0.0.1"] * count if many else "127.0.0.1",
        "bootstrap_port": [bootstrap_port] * count if many else bootstrap_port,
        "bootstrap_room": rooms,
    }
    return {**body, **extra}


# --------------------------------------------------------------------------- wire format


async def test_basic_endpoints() -> None:
    async with asgi_client(FakeEngine("decode", "vllm-mooncake")) as client:
        health = await client.get("/health")
        assert (health.status_code, health.content) == (200, b"")
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == MODEL and models["object"] == "list"
        assert (await client.get("/nope")).status_code == 404
        assert (await client.get("/v1/completions")).status_code == 405
        wrong = await client.post("/v1/completions", json={"model": "other", "prompt": "x"})
        assert wrong.status_code == 404
        assert wrong.json()["error"]["message"] == "The model `other` does not exist."
        for bad in (b"{", b"[1]", b'{"model": "fake-model"}'):
            response = await client.post("/v1/completions", content=bad)
            assert response.status_code == 400
            assert response.json()["error"]["type"] == "BadRequestError"


async def test_batched_completion_with_n_and_request_id() -> None:
    engine = FakeEngine("decode", "vllm-nixl", config=FakeConfig(tokens=3))
    body = {"model": MODEL, "prompt": [[1, 2], [3, 4]], "n": 2, "max_tokens": 10}
    async with asgi_client(engine) as client:
        response = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "r"})
        single = await client.post("/v1/completions", json={**body, "prompt": [1, 2, 3]})
    data = response.json()
    assert response.headers["x-request-id"] == "r"
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    assert data["choices"][0] == {
        "index": 0,
        "text": " tok0 tok1 tok2",
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": None,
    }
    assert data["usage"] == {"prompt_tokens": 4, "completion_tokens": 12, "total_tokens": 16}
    assert data["kv_transfer_params"] is None
    assert len(single.json()["choices"]) == 2
    assert engine.records[0].headers["x-request-id"] == "r" and engine.records[0].done


async def test_chat_stream_format() -> None:
    engine = FakeEngine("decode", "sglang", config=FakeConfig(tokens=8))
    body = {
        "model": MODEL,
        "messages": CHAT,
        "stream": True,
        "max_tokens": 2,
        "stream_options": {"include_usage": True},
    }
    async with (
        asgi_client(engine) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.headers["content-type"] == "text/event-stream"
        events = [event async for event in sse_data(response)]
    assert events[-1] == "[DONE]"
    chunks = [msgspec.json.decode(event) for event in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"content": " tok0"},
        {"content": " tok1"},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    assert "kv_transfer_params" not in chunks[0]


# --------------------------------------------------------------------------- field checks

MOONCAKE_KV = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "t"}
BASE = {"model": MODEL, "prompt": "hi", "stream": False, "max_tokens": 1}


@pytest.mark.parametrize(
    ("protocol", "body", "message"),
    [
        (
            "vllm-mooncake",
            {**BASE, "max_tokens": 2, "kv_transfer_params": MOONCAKE_KV},
            "max_tokens=1",
        ),
        (
            "vllm-mooncake",
            {**BASE, "stream": True, "kv_transfer_params": MOONCAKE_KV},
            "stream=false",
        ),
        (
            "vllm-mooncake",
            {**BASE, "max_completion_tokens": 5, "kv_transfer_params": MOONCAKE_KV},
            "max_completion_tokens=1",
        ),
        (
            "vllm-mooncake",
            {**BASE, "stream_options": {}, "kv_transfer_params": MOONCAKE_KV},
            "stream_options",
        ),
        (
            "vllm-mooncake",
            {**BASE, "kv_transfer_params": {**MOONCAKE_KV, "transfer_id": ""}},
            "transfer_id",
        ),
        (
            "vllm-mooncake",
            {**BASE, "min_tokens": 4, "kv_transfer_params": MOONCAKE_KV},
            "min_tokens must be less than or equal to max_tokens=1, got 4.",
        ),
        (
            "vllm-nixl",
            {**BASE, "min_tokens": 3, "kv_transfer_params": {"do_remote_decode": True}},
            "min_tokens",
        ),
        (
            "vllm-nixl",
            {**BASE, "kv_transfer_params": {"do_remote_decode": False}},
            "do_remote_decode",
        ),
        ("sglang", sglang_body(1, [1, 2]), "single value"),
        ("sglang", {**sglang_body(1, [1, 2]), "n": 3}, "list of 3 values"),
        (
            "sglang",
            {
                "model": MODEL,
                "prompt": ["a", "b"],
                "bootstrap_host": "h",
                "bootstrap_port": 1,
                "bootstrap_room": 7,
            },
            "lists of 2 values",
        ),
        ("sglang", sglang_body(1, 2**63), "bootstrap_room"),
        ("sglang", {**sglang_body(1, [5, 5]), "n": 2}, "distinct"),
        ("sglang", {"model": MODEL, "prompt": "x", "bootstrap_host": "h"}, "missing"),
    ],
)
async def test_prefill_rejects_bad_pd_fields(
    protocol: Any, body: dict[str, Any], message: str
) -> None:
    engine = FakeEngine("prefill", protocol, config=FakeConfig(kv_timeout=0.1))
    async with asgi_client(engine) as client:
        response = await client.post(
            "/v1/chat/completions" if "messages" in body else "/v1/completions", json=body
        )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert message in error["message"]
    assert engine.records[0].status == 400


async def test_mooncake_prefill_needs_dp_rank_header_when_dp() -> None:
    engine = FakeEngine("prefill", "vllm-mooncake", dp_size=2)
    async with asgi_client(engine) as client:
        missing = await client.post("/v1/chat/completions", json=mooncake_prefill_body("t"))
        out_of_range = await client.post(
            "/v1/chat/completions",
            json=mooncake_prefill_body("t"),
            headers={"X-data-parallel-rank": "2"},
        )
    assert missing.status_code == out_of_range.status_code == 400
    assert "x-data-parallel-rank" in missing.json()["error"]["message"]


async def test_sglang_routed_dp_rank_conflict() -> None:
    engine = FakeEngine("prefill", "sglang", dp_size=4)
    async with asgi_client(engine) as client:
        response = await client.post(
            "/v1/chat/completions", json=sglang_body(1, 10, routed_dp_rank=1)
        )
    assert response.status_code == 500
    assert "follow_bootstrap_room conflict" in response.json()["error"]["message"]


# --------------------------------------------------------------------------- KV rendezvous


async def test_mooncake_pair_rendezvous() -> None:
    prefill = FakeEngine("prefill", "vllm-mooncake", dp_size=2)
    decode = FakeEngine("decode", "vllm-mooncake")
    assert prefill.bootstrap_app is not None
    with run_servers(prefill.app, prefill.bootstrap_app, decode.app) as (p_port, b_port, d_port):
        async with socket_client() as client:
            table = (await client.get(f"http://127.0.0.1:{b_port}/query")).json()
            assert [table[r]["engine_id"] for r in ("0", "1")] == prefill.engine_ids
            d_body = {**mooncake_decode_body("x1", table["1"]["engine_id"], b_port), "stream": True}

            async def run_decode() -> list[str]:
                url = f"http://127.0.0.1:{d_port}/v1/chat/completions"
                async with client.stream("POST", url, json=d_body) as response:
                    assert response.status_code == 200
                    return [event async for event in sse_data(response)]

            decode_task = asyncio.create_task(run_decode())
            await decode.wait_for(lambda e: e.inflight == 1)  # D pulls before P has run
            p_resp = await client.post(
                f"http://127.0.0.1:{p_port}/v1/chat/completions",
                json=mooncake_prefill_body("x1"),
                headers={"X-data-parallel-rank": "1"},
            )
            events = await decode_task
    assert p_resp.status_code == 200, p_resp.text
    assert p_resp.json()["kv_transfer_params"] is None
    assert p_resp.json()["usage"]["completion_tokens"] == 1
    assert prefill.records[0].dp_ranks == [1]
    assert events[-1] == "[DONE]" and len(events) == 1 + 4 + 1


async def test_mooncake_decode_engine_id_lookup() -> None:
    prefill = FakeEngine("prefill", "vllm-mooncake", dp_size=2)
    decode = FakeEngine("decode", "vllm-mooncake", config=FakeConfig(kv_timeout=2.0))
    assert prefill.bootstrap_app is not None
    with run_servers(prefill.app, prefill.bootstrap_app, decode.app) as (p_port, b_port, d_port):
        d_url = f"http://127.0.0.1:{d_port}/v1/chat/completions"
        p_url = f"http://127.0.0.1:{p_port}/v1/chat/completions"
        async with socket_client() as client:
            unknown = await client.post(d_url, json=mooncake_decode_body("a", "nope", b_port))
            # P computes on rank 0 but D names rank 1's engine id: the pull is refused.
            rank0 = {"X-data-parallel-rank": "0"}
            await client.post(p_url, json=mooncake_prefill_body("b"), headers=rank0)
            wrong_rank = await client.post(
                d_url, json=mooncake_decode_body("b", prefill.engine_ids[1], b_port)
            )
            old_id = prefill.engine_ids[0]
            prefill.restart()
            stale = await client.post(d_url, json=mooncake_decode_body("c", old_id, b_port))
            await client.post(p_url, json=mooncake_prefill_body("d"), headers=rank0)
            fresh = await client.post(
                d_url, json=mooncake_decode_body("d", prefill.engine_ids[0], b_port)
            )
    assert unknown.status_code == 500
    assert (
        "remote engine_id nope not found from bootstrap server"
        in unknown.json()["error"]["message"]
    )
    assert wrong_rank.status_code == 500 and "409" in wrong_rank.json()["error"]["message"]
    assert stale.status_code == 500 and "not found" in stale.json()["error"]["message"]
    assert fresh.status_code == 200, fresh.text  # re-queried the bootstrap after the restart


async def test_nixl_sequential_pair() -> None:
    prefill, decode = FakeEngine("prefill", "vllm-nixl"), FakeEngine("decode", "vllm-nixl")
    with run_servers(prefill.app, decode.app) as (p_port, d_port):
        async with socket_client() as client:
            p_body = {**BASE, "kv_transfer_params": {"do_remote_decode": True}}
            p_resp = await client.post(f"http://127.0.0.1:{p_port}/v1/completions", json=p_body)
            params = p_resp.json()["kv_transfer_params"]
            d_body = {"model": MODEL, "prompt": "hi", "min_tokens": 2, "kv_transfer_params": params}
            d_url = f"http://127.0.0.1:{d_port}/v1/completions"
            ok = await client.post(d_url, json=d_body)
            again = await client.post(d_url, json=d_body)  # the KV was already read
    assert params["remote_port"] == p_port and params["some_future_field"] == "x"
    assert params["remote_engine_id"] == prefill.engine_id
    assert ok.status_code == 200, ok.text
    assert decode.records[0].body["min_tokens"] == 2
    assert again.status_code == 500 and "404" in again.json()["error"]["message"]


async def test_sglang_pair_with_dp_and_n() -> None:
    prefill = FakeEngine("prefill", "sglang", dp_size=2)
    decode = FakeEngine("decode", "sglang")
    assert prefill.bootstrap_app is not None
    with run_servers(prefill.app, prefill.bootstrap_app, decode.app) as (p_port, b_port, d_port):
        listed = sglang_body(b_port, [10, 13], n=2, stream=True)
        # A scalar room with n > 1: the engines use rooms 20 and 21 (SGLang's io_struct).
        scalar = {key: v for key, v in sglang_body(b_port, 20, n=2).items() if key != "messages"}
        scalar["prompt"] = "hi"

        async def pair(path: str, body: dict[str, Any]) -> list[httpx.Response]:
            return list(
                await asyncio.gather(
                    client.post(f"http://127.0.0.1:{p_port}{path}", json=body),
                    client.post(f"http://127.0.0.1:{d_port}{path}", json=body),
                )
            )

        async with socket_client() as client:
            p_resp, d_resp = await pair("/v1/chat/completions", listed)
            scalar_resps = await pair("/v1/completions", scalar)
            route = await client.get(
                f"http://127.0.0.1:{b_port}/route",
                params={
                    "prefill_dp_rank": -1,
                    "prefill_cp_rank": -1,
                    "target_tp_rank": -1,
                    "target_pp_rank": -1,
                },
            )
    assert p_resp.status_code == d_resp.status_code == 200
    assert [r.status_code for r in scalar_resps] == [200, 200]
    assert [r.dp_ranks for r in prefill.records] == [[0, 1], [0, 1]]
    assert d_resp.text.count(" tok") == 2 * 3 and d_resp.text.endswith("data: [DONE]\n\n")
    assert route.json()["dp_size"] == 2 and route.json()["follow_bootstrap_room"] is True


async def test_sglang_decode_times_out_without_prefill() -> None:
    config = FakeConfig(kv_timeout=0.3)
    prefill = FakeEngine("prefill", "sglang", config=config)
    decode = FakeEngine("decode", "sglang", config=config)
    assert prefill.bootstrap_app is not None
    with run_servers(prefill.bootstrap_app, decode.app) as (b_port, d_port):
        async with socket_client() as client:
            started = time.monotonic()
            response = await client.post(
                f"http://127.0.0.1:{d_port}/v1/chat/completions", json=sglang_body(b_port, 12345)
            )
            elapsed = time.monotonic() - started
    assert response.status_code == 500
    assert "bootstrap_room 12345" in response.json()["error"]["message"]
    assert 0.25 < elapsed < 2.0


# --------------------------------------------------------------------------- failure knobs


async def test_disconnects_are_recorded() -> None:
    engine = FakeEngine("decode", "vllm-mooncake", config=FakeConfig(hang=True))
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 50}
    with run_servers(engine.app) as (port,):
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with socket_client() as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(url, json=body, timeout=0.2)
            await engine.wait_for(lambda e: e.records[0].done)
            engine.config.hang, engine.config.token_delay = False, 0.02
            async with client.stream("POST", url, json={**body, "stream": True}) as response:
                await anext(aiter(response.aiter_lines()))  # read one line, then leave
            await engine.wait_for(lambda e: e.records[1].done)
    hung, streamed = engine.records
    assert hung.disconnected and hung.status is None
    assert streamed.disconnected and streamed.status == 200
    assert engine.inflight == 0


async def test_fail_after_events_and_fail_status() -> None:
    engine = FakeEngine("decode", "sglang", config=FakeConfig(fail_after_events=2))
    body = {"model": MODEL, "prompt": "hi", "stream": True}
    with run_servers(engine.app) as (port,):
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with socket_client() as client:
            seen: list[str] = []
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream("POST", url, json=body) as response:
                    async for event in sse_data(response):
                        seen.append(event)
            engine.config.fail_status = 503
            failed = await client.post(url, json=body)
    assert failed.status_code == 503
    assert failed.json()["error"]["type"] == "ServiceUnavailableError"
    assert len(seen) == 2
    assert engine.records[0].aborted and not engine.records[0].disconnected
