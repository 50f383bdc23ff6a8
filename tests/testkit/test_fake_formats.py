"""The fake engines on OpenAI Responses (/v1/responses) and Anthropic Messages (/v1/messages):
wire shapes, the vLLM prefill-leg checks, and the KV hand-over of each PD protocol."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import msgspec
import pytest

from testkit.fake_cluster import serve_engine
from testkit.fake_engine import FakeConfig, FakeEngine
from testkit.servers import run_servers

MODEL = "fake-model"
RESPONSES, MESSAGES = "/v1/responses", "/v1/messages"
ENDPOINTS = (RESPONSES, MESSAGES)
CLIENT_BODIES: dict[str, dict[str, Any]] = {
    RESPONSES: {
        "model": MODEL,
        "instructions": "be brief",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hello there"}]}],
        "max_output_tokens": 4,
    },
    MESSAGES: {
        "model": MODEL,
        "system": [{"type": "text", "text": "be brief"}],
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4,
    },
}


def prefill_leg(path: str, kv: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The router's vLLM prefill leg of the client's body."""
    body = {**CLIENT_BODIES[path], "stream": False, "kv_transfer_params": kv}
    if path == RESPONSES:
        return {**body, "max_output_tokens": 1, "ignore_eos": True, "store": False, **extra}
    return {**body, "max_tokens": 1, **extra}


def decode_leg(path: str, stream: bool, **extra: Any) -> dict[str, Any]:
    return {**CLIENT_BODIES[path], "stream": stream, **extra}


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE event; every event has both lines."""
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        events.append((name.removeprefix("event: "), msgspec.json.decode(data[6:])))
    return events


def answer_of(path: str, response: httpx.Response, stream: bool) -> dict[str, Any]:
    """The whole answer: the body, or (streamed) the answer the events add up to."""
    assert response.status_code == 200, response.text
    if not stream:
        return dict(response.json())
    events = sse_events(response.text)
    assert "[DONE]" not in response.text
    assert all(name == data["type"] for name, data in events)
    if path == RESPONSES:
        assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
        final = events[-1][1]["response"]
        deltas = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
        assert final["output"][0]["content"][0]["text"] == deltas
        return dict(final)
    start, delta = events[0][1]["message"], events[-2][1]
    assert [events[0][0], events[-1][0]] == ["message_start", "message_stop"]
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    content = [{"type": "text", "text": text}]
    return {**start, "content": content, **delta["delta"], "usage": delta["usage"]}


def text_and_usage(path: str, answer: dict[str, Any]) -> tuple[str, int, int]:
    """(generated text, prompt tokens, output tokens) of an answer on `path`."""
    usage = answer["usage"]
    if path == RESPONSES:
        parts = answer["output"][0]["content"]
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        return "".join(p["text"] for p in parts), usage["input_tokens"], usage["output_tokens"]
    return answer["content"][0]["text"], usage["input_tokens"], usage["output_tokens"]


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=10.0, trust_env=False)


# --------------------------------------------------------------------------- plain requests


@pytest.mark.parametrize("stream", [False, True])
async def test_plain_requests_generate_what_chat_does(stream: bool) -> None:
    engine = FakeEngine("decode", "vllm-nixl")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "be brief hello there"}]}
    with run_servers(engine.app) as (port,):
        async with client() as http:
            url = f"http://127.0.0.1:{port}"
            chat_resp = (await http.post(f"{url}/v1/chat/completions", json=chat)).json()
            answers = {
                path: answer_of(
                    path, await http.post(url + path, json=decode_leg(path, stream)), stream
                )
                for path in ENDPOINTS
            }
    responses, messages = answers[RESPONSES], answers[MESSAGES]
    chat_text = chat_resp["choices"][0]["message"]["content"]
    expected = (chat_text.split(" tok4")[0], chat_resp["usage"]["prompt_tokens"], 4)
    assert text_and_usage(RESPONSES, responses) == expected
    assert text_and_usage(MESSAGES, messages) == expected
    assert responses["status"] == "incomplete" and responses["object"] == "response"
    assert responses["incomplete_details"] == {"reason": "max_output_tokens"}
    assert responses["instructions"] == "be brief" and responses["id"].startswith("resp_")
    assert responses["output"][0]["id"].startswith("msg_")
    assert responses["kv_transfer_params"] is None  # vLLM sends the field, null
    assert (messages["type"], messages["role"]) == ("message", "assistant")
    assert messages["stop_reason"] == "max_tokens"
    assert "kv_transfer_params" not in messages or stream  # exclude_none on the body


async def test_responses_stream_event_sequence_and_errors() -> None:
    engine = FakeEngine("decode", "sglang", config=FakeConfig(tokens=2))
    body = {**CLIENT_BODIES[RESPONSES], "max_output_tokens": None, "stream": True}
    with run_servers(engine.app) as (port,):
        async with client() as http:
            url = f"http://127.0.0.1:{port}"
            streamed = await http.post(url + RESPONSES, json=body)
            no_input = await http.post(url + RESPONSES, json={"model": MODEL})
            no_max = await http.post(
                url + MESSAGES, json={**CLIENT_BODIES[MESSAGES], "max_tokens": None}
            )
    names = [name for name, _ in sse_events(streamed.text)]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = sse_events(streamed.text)[-1][1]["response"]
    assert final["status"] == "completed" and final["usage"]["output_tokens"] == 2
    assert "kv_transfer_params" not in final  # SGLang's response has no such field
    assert no_input.status_code == 400 and "input" in no_input.json()["error"]["message"]
    assert no_max.status_code == 400
    assert no_max.json()["type"] == "error" and no_max.json()["error"]["type"] == "BadRequestError"


# --------------------------------------------------------------------------- prefill checks


@pytest.mark.parametrize(
    ("path", "extra", "message"),
    [
        (RESPONSES, {"max_output_tokens": 16}, "max_output_tokens=1"),
        (RESPONSES, {"ignore_eos": None}, "ignore_eos=true"),
        (RESPONSES, {"store": True}, "store=false"),
        (RESPONSES, {"stream_options": {"include_usage": True}}, "stream_options"),
        (MESSAGES, {"max_tokens": 16}, "max_tokens=1"),
        (MESSAGES, {"stream": True}, "stream=false"),
    ],
)
async def test_vllm_prefill_rejects_a_wrong_leg(
    path: str, extra: dict[str, Any], message: str
) -> None:
    engine = FakeEngine("prefill", "vllm-nixl")
    body = prefill_leg(path, {"do_remote_decode": True}, **extra)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=engine.app), base_url="http://fake"
    ) as http:
        response = await http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "BadRequestError"
    assert (response.json().get("type") == "error") is (path == MESSAGES)


# --------------------------------------------------------------------------- PD pairs


async def _mooncake_pair(
    prefill: FakeEngine, decode: FakeEngine, path: str, stream: bool, transfer_id: str
) -> tuple[httpx.Response, httpx.Response]:
    """The decode leg first (it waits for the KV), then the prefill leg on DP rank 1."""
    with serve_engine(prefill) as (p_port, b_port), run_servers(decode.app) as (d_port,):
        kv = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "remote_engine_id": prefill.engine_ids[1],
            "remote_bootstrap_addr": f"http://127.0.0.1:{b_port}",
        }
        async with client() as http:
            d_body = decode_leg(path, stream, kv_transfer_params=kv)
            d_task = asyncio.create_task(http.post(f"http://127.0.0.1:{d_port}{path}", json=d_body))
            await decode.wait_for(lambda e: e.inflight == 1)
            p_kv = {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "transfer_id": transfer_id,
            }
            p_resp = await http.post(
                f"http://127.0.0.1:{p_port}{path}",
                json=prefill_leg(path, p_kv),
                headers={"X-data-parallel-rank": "1"},
            )
            return p_resp, await d_task


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ENDPOINTS)
async def test_mooncake_pair_hands_over_the_kv(path: str, stream: bool) -> None:
    prefill = FakeEngine("prefill", "vllm-mooncake", dp_size=2)
    decode = FakeEngine("decode", "vllm-mooncake")
    p_resp, d_resp = await _mooncake_pair(prefill, decode, path, stream, f"t-{path}-{stream}")
    p_answer = answer_of(path, p_resp, False)
    assert text_and_usage(path, p_answer)[1:] == (4, 1)  # instructions/system + input
    assert prefill.records[0].dp_ranks == [1]
    if path == RESPONSES:
        assert p_answer["kv_transfer_params"] is None and p_answer["status"] == "incomplete"
    else:
        assert "kv_transfer_params" not in p_answer and p_answer["stop_reason"] == "max_tokens"
    d_text, _, d_tokens = text_and_usage(path, answer_of(path, d_resp, stream))
    assert (d_text, d_tokens) == (" tok0 tok1 tok2 tok3", 4)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ENDPOINTS)
async def test_nixl_prefill_params_go_to_the_decode_verbatim(path: str, stream: bool) -> None:
    prefill, decode = FakeEngine("prefill", "vllm-nixl"), FakeEngine("decode", "vllm-nixl")
    with run_servers(prefill.app, decode.app) as (p_port, d_port):
        async with client() as http:
            p_resp = await http.post(
                f"http://127.0.0.1:{p_port}{path}",
                json=prefill_leg(path, {"do_remote_decode": True}),
            )
            params = p_resp.json()["kv_transfer_params"]
            d_url, d_body = (
                f"http://127.0.0.1:{d_port}{path}",
                decode_leg(path, stream, kv_transfer_params=params),
            )
            d_resp = await http.post(d_url, json=d_body)
            again = await http.post(d_url, json=d_body)  # the KV was read already
    assert params["remote_port"] == p_port and params["remote_engine_id"] == prefill.engine_id
    assert params["remote_num_tokens"] == 4 and params["do_remote_prefill"] is True
    assert text_and_usage(path, answer_of(path, d_resp, stream))[2] == 4
    assert decode.records[0].body["kv_transfer_params"] == params
    assert again.status_code == 500 and "404" in again.text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ENDPOINTS)
async def test_sglang_pair_meets_in_the_bootstrap_room(path: str, stream: bool) -> None:
    prefill = FakeEngine("prefill", "sglang", dp_size=2)
    decode = FakeEngine("decode", "sglang")
    with serve_engine(prefill) as (p_port, b_port), run_servers(decode.app) as (d_port,):
        boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": b_port, "bootstrap_room": 7}
        async with client() as http:
            p_resp, d_resp = await asyncio.gather(
                http.post(f"http://127.0.0.1:{p_port}{path}", json=decode_leg(path, False, **boot)),
                http.post(
                    f"http://127.0.0.1:{d_port}{path}",
                    json=decode_leg(path, stream, **boot, disagg_prefill_dp_rank=1),
                ),
            )
    assert text_and_usage(path, answer_of(path, p_resp, False))[2] == 1
    d_answer = answer_of(path, d_resp, stream)
    assert text_and_usage(path, d_answer)[2] == 4 and prefill.records[0].dp_ranks == [1]
    assert "kv_transfer_params" not in d_answer
    if path == MESSAGES:
        assert d_answer["id"].startswith("msg_")


# --------------------------------------------------------------------------- stop token on P


async def test_messages_prefill_whose_token_is_eos_keeps_no_kv() -> None:
    """vLLM's Anthropic request has neither ignore_eos nor min_tokens: an EOS first token ends
    the prefill with end_turn and frees the KV, and the decode waits for it in vain."""
    prefill = FakeEngine(
        "prefill", "vllm-mooncake", dp_size=2, config=FakeConfig(first_token_eos=True)
    )
    decode = FakeEngine("decode", "vllm-mooncake", config=FakeConfig(kv_timeout=0.5))
    p_resp, d_resp = await _mooncake_pair(prefill, decode, MESSAGES, False, "eos")
    answer = p_resp.json()
    assert answer["stop_reason"] == "end_turn" and "stop_sequence" not in answer
    assert answer["content"] == [{"type": "text", "text": ""}]
    assert answer["usage"]["output_tokens"] == 1
    assert d_resp.status_code == 500 and "timed out" in d_resp.json()["error"]["message"]
    assert d_resp.json()["type"] == "error"


async def test_responses_prefill_with_ignore_eos_keeps_its_kv() -> None:
    """The Responses prefill leg sets ignore_eos: an EOS first token cannot stop it."""
    config = FakeConfig(first_token_eos=True)
    prefill, decode = (
        FakeEngine("prefill", "vllm-nixl", config=config),
        FakeEngine("decode", "vllm-nixl"),
    )
    with run_servers(prefill.app, decode.app) as (p_port, d_port):
        async with client() as http:
            leg = prefill_leg(RESPONSES, {"do_remote_decode": True})
            p_resp = await http.post(f"http://127.0.0.1:{p_port}{RESPONSES}", json=leg)
            without = {**leg, "input": "other"}
            without.pop("ignore_eos")
            rejected = await http.post(f"http://127.0.0.1:{p_port}{RESPONSES}", json=without)
            params = p_resp.json()["kv_transfer_params"]
            d_body = decode_leg(RESPONSES, False, kv_transfer_params=params)
            d_resp = await http.post(f"http://127.0.0.1:{d_port}{RESPONSES}", json=d_body)
    assert p_resp.json()["status"] == "incomplete" and params is not None
    assert p_resp.json()["output"][0]["content"][0]["text"] == " tok0"
    assert rejected.status_code == 400
    assert d_resp.status_code == 200, d_resp.text
