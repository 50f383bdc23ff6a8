"""The fake engine itself: wire format, PD field checks, KV rendezvous and disconnects."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest

from testkit.fake_cluster import serve_engine
from testkit.fake_engine import FIRST_TOKEN_ID, FakeConfig, FakeEngine
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
    """The room-list wire format of n > 1 (which the real engines hang on: knob off here)."""
    prefill = FakeEngine("prefill", "sglang", dp_size=2)
    decode = FakeEngine("decode", "sglang", config=FakeConfig(sglang_n_hang=False))
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


# --------------------------------------------------------------------------- real-engine failures
# What vLLM 0.32 / SGLang 0.5.23 did on this machine (docs/real-engines.md section 5), reproduced so
# that the fast suite catches the router bugs they cause.


async def test_token_ids_and_stop_conditions_as_vllm() -> None:
    """Step k emits token FIRST_TOKEN_ID + k: a client (or a router test) can name it in
    stop_token_ids. A stop token ends the choice with an empty text for it and stop_reason its
    id (None for EOS); min_tokens masks stop tokens; a stop string cuts the text before it."""
    engine = FakeEngine("decode", "vllm-mooncake", config=FakeConfig(tokens=8))
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 5}

    async def choice(**extra: Any) -> tuple[dict[str, Any], int]:
        data = (await client.post("/v1/completions", json={**body, **extra})).json()
        return data["choices"][0], data["usage"]["completion_tokens"]

    async with asgi_client(engine) as client:
        first = await choice(stop_token_ids=[FIRST_TOKEN_ID])
        third = await choice(stop_token_ids=[7, FIRST_TOKEN_ID + 2])
        masked = await choice(stop_token_ids=[FIRST_TOKEN_ID], min_tokens=1)
        string = await choice(stop=["tok1", "never"])
        plain = await choice()
        engine.config.first_token_eos = True
        eos = await choice()
        eos_masked = await choice(min_tokens=1)
        eos_ignored = await choice(ignore_eos=True)
    assert first == ({"index": 0, "text": "", "logprobs": None, "finish_reason": "stop",
                      "stop_reason": FIRST_TOKEN_ID}, 1)  # fmt: skip
    assert (third[0]["text"], third[0]["stop_reason"], third[1]) == (" tok0 tok1", 1002, 3)
    assert (masked[0]["finish_reason"], masked[1]) == ("length", 5)
    assert string[0]["text"] == " tok0 " and string[0]["stop_reason"] == "tok1"
    assert (string[0]["finish_reason"], string[1]) == ("stop", 2)
    assert (plain[0]["finish_reason"], plain[0]["stop_reason"], plain[1]) == ("length", None, 5)
    assert eos[0]["text"] == "" and eos[0]["stop_reason"] is None and eos[1] == 1
    assert eos[0]["finish_reason"] == "stop"
    assert eos_masked[0]["finish_reason"] == eos_ignored[0]["finish_reason"] == "length"


async def test_stream_ending_on_a_stop_token() -> None:
    """Streamed, the stop token is one last event with empty content, finish_reason "stop" and
    stop_reason (as vLLM sends it: only on that event)."""
    engine = FakeEngine("decode", "vllm-nixl")
    body = {
        "model": MODEL,
        "messages": CHAT,
        "stream": True,
        "stop_token_ids": [FIRST_TOKEN_ID + 1],
        "stream_options": {"include_usage": True},
    }
    async with (
        asgi_client(engine) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        events = [event async for event in sse_data(response)]
    chunks = [msgspec.json.decode(event) for event in events[:-1]]
    choices = [c["choices"][0] for c in chunks[:-1]]
    assert [c["delta"] for c in choices] == [
        {"role": "assistant", "content": ""},
        {"content": " tok0"},
        {"content": ""},
    ]
    assert [c.get("stop_reason") for c in choices] == [None, None, FIRST_TOKEN_ID + 1]
    assert choices[-1]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == 2 and events[-1] == "[DONE]"


def _mooncake_prefill(transfer_id: str, **extra: Any) -> dict[str, Any]:
    return {**mooncake_prefill_body(transfer_id), **extra}


async def _mooncake_pair_run(
    prefill: FakeEngine, p_port: int, b_port: int, d_port: int, extra: dict[str, Any]
) -> tuple[httpx.Response, httpx.Response, float]:
    """D pulls first (as the router sends both legs at once), then P answers; returns P's and
    D's answers and how long D took after P answered."""
    async with socket_client() as client:
        d_body = mooncake_decode_body("x", prefill.engine_id, b_port)
        d_url = f"http://127.0.0.1:{d_port}/v1/chat/completions"
        decode_task = asyncio.create_task(client.post(d_url, json=d_body))
        p_url = f"http://127.0.0.1:{p_port}/v1/chat/completions"
        p_resp = await client.post(p_url, json=_mooncake_prefill("x", **extra))
        answered = time.monotonic()
        d_resp = await decode_task
    return p_resp, d_resp, time.monotonic() - answered


@pytest.mark.parametrize(
    ("config", "extra", "stop_reason"),
    [
        (FakeConfig(), {"stop_token_ids": [FIRST_TOKEN_ID]}, FIRST_TOKEN_ID),
        (FakeConfig(first_token_eos=True), {}, None),
        (
            FakeConfig(ignore_min_tokens=True),
            {"stop_token_ids": [FIRST_TOKEN_ID], "min_tokens": 1},
            FIRST_TOKEN_ID,
        ),
    ],  # fmt: skip
)
async def test_mooncake_prefill_whose_token_is_a_stop_token_never_serves_the_pull(
    config: FakeConfig, extra: dict[str, Any], stop_reason: int | None
) -> None:
    """vLLM keeps KV for a remote decode only when the prefill ended by length: a stop token
    answers 200 finish "stop" with an empty text, and the decode's pull never completes (vLLM:
    480 s; here kv_timeout, then the usual KV error)."""
    config.kv_timeout = 0.5
    prefill = FakeEngine("prefill", "vllm-mooncake", config=config)
    decode = FakeEngine("decode", "vllm-mooncake", config=FakeConfig(kv_timeout=0.5))
    with serve_engine(prefill) as (p_port, b_port), run_servers(decode.app) as (d_port,):
        p_resp, d_resp, waited = await _mooncake_pair_run(prefill, p_port, b_port, d_port, extra)
    assert p_resp.status_code == 200, p_resp.text
    answer = p_resp.json()
    assert answer["kv_transfer_params"] is None and answer["usage"]["completion_tokens"] == 1
    assert answer["choices"][0]["message"]["content"] == ""
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["choices"][0]["stop_reason"] == stop_reason
    assert d_resp.status_code == 500 and "timed out" in d_resp.json()["error"]["message"]
    assert waited > 0.3  # D waited for the KV; it did not fail at once


@pytest.mark.parametrize(
    ("extra", "finish", "stop_reason"),
    [
        ({"stop": "tok0"}, "stop", "tok0"),  # matched by the front end after a length finish
        ({"stop_token_ids": [FIRST_TOKEN_ID], "min_tokens": 1}, "length", None),  # masked
    ],
)
async def test_mooncake_prefill_stop_string_or_masked_stop_token_still_serves_the_pull(
    extra: dict[str, Any], finish: str, stop_reason: str | None
) -> None:
    prefill = FakeEngine("prefill", "vllm-mooncake", config=FakeConfig(kv_timeout=5.0))
    decode = FakeEngine("decode", "vllm-mooncake", config=FakeConfig(kv_timeout=5.0))
    with serve_engine(prefill) as (p_port, b_port), run_servers(decode.app) as (d_port,):
        p_resp, d_resp, _ = await _mooncake_pair_run(prefill, p_port, b_port, d_port, extra)
    choice = p_resp.json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == (finish, stop_reason)
    assert d_resp.status_code == 200, d_resp.text


@pytest.mark.parametrize(
    ("extra", "finish", "has_params"),
    [
        ({"stop_token_ids": [FIRST_TOKEN_ID]}, "stop", False),
        ({"stop": " tok0"}, "stop", True),
        ({"stop_token_ids": [FIRST_TOKEN_ID], "min_tokens": 1}, "length", True),
    ],
)
async def test_nixl_prefill_whose_token_is_a_stop_token_returns_no_kv_params(
    extra: dict[str, Any], finish: str, has_params: bool
) -> None:
    """NIXL's connector also frees the KV of a request that ended on a stop token: the answer's
    kv_transfer_params is null. A stop string ends it by length first: the KV can be read."""
    prefill, decode = FakeEngine("prefill", "vllm-nixl"), FakeEngine("decode", "vllm-nixl")
    with run_servers(prefill.app, decode.app) as (p_port, d_port):
        async with socket_client() as client:
            p_body = {**BASE, **extra, "kv_transfer_params": {"do_remote_decode": True}}
            p_resp = await client.post(f"http://127.0.0.1:{p_port}/v1/completions", json=p_body)
            params = p_resp.json()["kv_transfer_params"]
            if params is not None:
                d_body = {"model": MODEL, "prompt": "hi", "kv_transfer_params": params}
                d_resp = await client.post(f"http://127.0.0.1:{d_port}/v1/completions", json=d_body)
                assert d_resp.status_code == 200, d_resp.text
    assert p_resp.status_code == 200
    assert p_resp.json()["choices"][0]["finish_reason"] == finish
    assert (params is not None) is has_params


async def _refuses(port: int) -> bool:
    try:
        async with socket_client() as client:
            await client.get(f"http://127.0.0.1:{port}/health")
    except httpx.ConnectError:
        return True
    return False


async def _prefill_then_decode(
    protocol: Any, p_port: int, b_port: int | None, d_port: int, engine_id: str, ref: int
) -> tuple[httpx.Response, httpx.Response, float]:
    """One PD request played by hand as the router would (both legs at once, or NIXL's prefill
    then decode); returns P's and D's answers and how long D took after P answered."""
    async with socket_client() as client:
        p_url = f"http://127.0.0.1:{p_port}/v1/chat/completions"
        d_url = f"http://127.0.0.1:{d_port}/v1/chat/completions"
        if protocol == "vllm-nixl":
            p_body = {**BASE, "messages": CHAT, "kv_transfer_params": {"do_remote_decode": True}}
            p_body.pop("prompt")
            p_resp = await client.post(p_url, json=p_body)
            answered = time.monotonic()
            d_body = {"model": MODEL, "messages": CHAT}
            d_body["kv_transfer_params"] = p_resp.json()["kv_transfer_params"]
            d_resp = await client.post(d_url, json=d_body)
            return p_resp, d_resp, time.monotonic() - answered
        assert b_port is not None
        if protocol == "vllm-mooncake":
            p_body, d_body = (
                mooncake_prefill_body("t"),
                mooncake_decode_body("t", engine_id, b_port),
            )
        else:
            p_body = d_body = sglang_body(b_port, 4242)
        decode_task = asyncio.create_task(client.post(d_url, json=d_body))
        p_resp = await client.post(p_url, json=p_body)
        answered = time.monotonic()
        d_resp = await decode_task
        return p_resp, d_resp, time.monotonic() - answered


@pytest.mark.parametrize("protocol", ["vllm-mooncake", "vllm-nixl", "sglang"])
@pytest.mark.parametrize("knob", ["die_after_answer", "withhold_kv"])
async def test_prefill_answers_but_the_kv_never_comes(protocol: Any, knob: str) -> None:
    """die_after_answer: right after its 200 answer the prefill's HTTP and bootstrap ports refuse
    connections (a killed process) and the KV never comes; withhold_kv: it stays up but never
    hands the KV over. Either way the decode does not fail at once: real vLLM waits its full
    abort timeout (480-540 s) for a dead prefill, retrying the unreachable one; here until
    kv_timeout, then its usual KV error."""
    kv_timeout = 0.6
    prefill = FakeEngine("prefill", protocol, config=FakeConfig(kv_timeout=kv_timeout))
    decode = FakeEngine("decode", protocol, config=FakeConfig(kv_timeout=kv_timeout))
    with serve_engine(prefill) as ports, run_servers(decode.app) as (d_port,):
        b_port = ports[1] if len(ports) > 1 else None
        # A first request as usual: D has read P's bootstrap table, as in steady state.
        warm = await _prefill_then_decode(protocol, ports[0], b_port, d_port, prefill.engine_id, 1)
        assert [r.status_code for r in warm[:2]] == [200, 200]
        setattr(prefill.config, knob, True)
        p_resp, d_resp, waited = await _prefill_then_decode(
            protocol, ports[0], b_port, d_port, prefill.engine_id, 2
        )
        refused = [await _refuses(port) for port in ports]
    assert p_resp.status_code == 200, p_resp.text
    assert refused == [knob == "die_after_answer"] * len(ports)
    assert prefill.dead is (knob == "die_after_answer")
    assert d_resp.status_code == 500, d_resp.text
    assert waited > kv_timeout * 0.8, f"D gave up {waited:.2f}s after P answered: {d_resp.text}"


async def test_health_is_slow_only_under_load_and_can_fail() -> None:
    """Real NIXL engines on a small machine answer /health in > 2 s while busy, at once idle."""
    config = FakeConfig(hang=True, health_delay_under_load=0.5)
    engine = FakeEngine("prefill", "vllm-nixl", config=config)
    with run_servers(engine.app) as (port,):
        url = f"http://127.0.0.1:{port}"
        async with socket_client() as client:

            async def health_time() -> float:
                started = time.monotonic()
                assert (await client.get(url + "/health")).status_code == 200
                return time.monotonic() - started

            idle = await health_time()
            body = {**BASE, "kv_transfer_params": {"do_remote_decode": True}}
            busy_request = asyncio.create_task(client.post(url + "/v1/completions", json=body))
            await engine.wait_for(lambda e: e.inflight == 1)
            busy = await health_time()
            busy_request.cancel()
            await engine.wait_for(lambda e: e.inflight == 0)
            engine.config.health_status = 503
            failing = await client.get(url + "/health")
    assert idle < 0.3 and busy >= 0.5
    assert failing.status_code == 503


async def test_sglang_n_above_one_waits_for_a_kv_that_never_comes() -> None:
    """SGLang 0.5.23 in PD: an n > 1 request's prefix warm-up reuses the room(s) and the decode
    waits forever (here: kv_timeout, then the KV error; the prefill times out waiting for the
    decode). A router must split n > 1 into single-sequence requests, each with its own room."""
    config = FakeConfig(kv_timeout=0.5, sglang_n_hang=True)
    prefill, decode = FakeEngine("prefill", "sglang", config=config), FakeEngine("decode", "sglang")
    decode.config = config
    with serve_engine(prefill) as (p_port, b_port), run_servers(decode.app) as (d_port,):
        async with socket_client() as client:

            async def pair(body: dict[str, Any]) -> list[httpx.Response]:
                return list(
                    await asyncio.gather(
                        client.post(f"http://127.0.0.1:{p_port}/v1/chat/completions", json=body),
                        client.post(f"http://127.0.0.1:{d_port}/v1/chat/completions", json=body),
                    )
                )

            started = time.monotonic()
            hung = await pair(sglang_body(b_port, [11, 12], n=2))
            elapsed = time.monotonic() - started
            single = await pair(sglang_body(b_port, 13))
    assert [r.status_code for r in hung] == [500, 500] and elapsed >= 0.5
    assert "KV not received" in hung[1].json()["error"]["message"]
    assert [r.status_code for r in single] == [200, 200]
