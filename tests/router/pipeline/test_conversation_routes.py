"""``/v1/responses`` and Anthropic ``/v1/messages`` through a real router and fake engines of
every protocol: the answer is the decode's (the KV came over from the prefill), streams keep
their ``event:`` framing, a bad or stateful request is a 400, and a Messages prefill whose one
token is EOS (no ``min_tokens`` there) is answered from the prefill at once."""

from __future__ import annotations

import time
from typing import Any

import httpx
import msgspec
import pytest

from testkit.fake_cluster import FakeCluster, FakeClusterFactory
from testkit.fake_engine import FakeConfig
from testkit.polling import wait_until

MODEL = "fake-model"
RESPONSE = {"model": MODEL, "input": "hello there", "max_output_tokens": 5}
MESSAGE = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
ENGINES = ["vllm-mooncake", "vllm-nixl", "sglang"]
CASES = [("/v1/responses", RESPONSE), ("/v1/messages", MESSAGE)]
CASE_IDS = ["responses", "messages"]
CLIENT_TIMEOUT_S = 8.0


def _post(cluster: FakeCluster, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(cluster.router_url + path, json=body, timeout=CLIENT_TIMEOUT_S)


def _events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """(event line, data) pairs; every data line must follow its event line."""
    assert response.headers["content-type"].startswith("text/event-stream")
    pairs = []
    for block in response.text.strip().split("\n\n"):
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block
        pairs.append((head[7:], msgspec.json.decode(data[6:])))
    return pairs


def _text(path: str, answer: dict[str, Any]) -> str:
    if path == "/v1/responses":
        return "".join(p["text"] for item in answer["output"] for p in item["content"])
    return "".join(block["text"] for block in answer["content"])


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("path", "body"), CASES, ids=CASE_IDS)
def test_a_conversation_goes_through_pd_and_answers_as_the_decode(
    make_cluster: FakeClusterFactory, engine: str, path: str, body: dict[str, Any]
) -> None:
    cluster = make_cluster(engine)
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    whole = _post(cluster, path, body)
    assert whole.status_code == 200, whole.text
    answer = whole.json()
    assert "kv_transfer_params" not in answer or answer["kv_transfer_params"] is None
    assert _text(path, answer) == " tok0 tok1 tok2 tok3 tok4"
    # both legs ran on this endpoint: the prefill its one-token leg, the decode the client's
    assert [r.path for r in prefill.records] == [path] and [r.path for r in decode.records] == [
        path
    ]
    streamed = _post(cluster, path, {**body, "stream": True})
    assert streamed.status_code == 200, streamed.text
    events = _events(streamed)
    assert all(name == data["type"] for name, data in events)
    deltas: list[str] = [
        data["delta"] if path == "/v1/responses" else data["delta"]["text"]
        for name, data in events
        if name in ("response.output_text.delta", "content_block_delta")
    ]
    assert "".join(deltas) == " tok0 tok1 tok2 tok3 tok4"
    last = "response.incomplete" if path == "/v1/responses" else "message_stop"
    assert events[-1][0] in (last, "response.completed")
    cluster.wait_idle()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/responses", {**RESPONSE, "previous_response_id": "resp_1"}, "previous_response_id"),
        ("/v1/responses", {**RESPONSE, "background": True}, "background"),
        ("/v1/responses", {"model": MODEL}, "input"),
        ("/v1/messages", {k: v for k, v in MESSAGE.items() if k != "max_tokens"}, "max_tokens"),
    ],
)
def test_a_stateful_or_incomplete_conversation_is_a_400_and_reaches_no_engine(
    make_cluster: FakeClusterFactory, path: str, body: dict[str, Any], param: str
) -> None:
    cluster = make_cluster("vllm-mooncake")
    response = _post(cluster, path, body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    # on /v1/messages in Anthropic's envelope, as the engine's own errors there
    assert ("type" in response.json()) == (path == "/v1/messages")
    assert cluster.prefills[0].records == [] and cluster.decodes[0].records == []


@pytest.mark.parametrize("engine", ["vllm-mooncake", "sglang"])
def test_a_messages_stream_cut_by_its_decode_ends_with_anthropics_error_event(
    make_cluster: FakeClusterFactory, engine: str
) -> None:
    """Anthropic's clients raise on an ``event: error`` and skip an event without a name: a
    decode that dies mid-stream ends the client's stream with one, in Anthropic's envelope."""
    cluster = make_cluster(engine)
    cluster.decodes[0].config.fail_after_events = 2
    response = _post(cluster, "/v1/messages", {**MESSAGE, "stream": True})
    assert response.status_code == 200
    event, data = _events(response)[-1]
    assert event == "error" and data["type"] == "error"
    assert "decode worker" in data["error"]["message"]
    wait_until(lambda: all(r.done for r in cluster.decodes[0].records), 10, "the decode idle")


@pytest.mark.parametrize("engine", ["vllm-mooncake", "vllm-nixl"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_messages_prefill_ending_on_eos_is_answered_from_the_prefill(
    make_cluster: FakeClusterFactory, engine: str, stream: bool
) -> None:
    """vLLM's Messages request has no ``min_tokens``: a prefill whose one token is EOS answers
    ``stop_reason: "end_turn"`` and frees the KV, so no decode could continue. The router
    answers with the prefill's message (a stream of its events) instead of waiting for a KV
    that never comes."""
    cluster = make_cluster(engine, config=lambda: FakeConfig(kv_timeout=60.0))
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    prefill.config.first_token_eos = True
    started = time.monotonic()
    response = _post(cluster, "/v1/messages", {**MESSAGE, "stream": stream})
    assert time.monotonic() - started < 2.0
    assert response.status_code == 200, response.text
    if stream:
        events = _events(response)
        assert [name for name, _ in events][0] == "message_start"
        assert [name for name, _ in events][-2:] == ["message_delta", "message_stop"]
        assert events[-2][1]["delta"]["stop_reason"] == "end_turn"
    else:
        answer = response.json()
        assert answer["stop_reason"] == "end_turn" and "kv_transfer_params" not in answer
    if engine == "vllm-mooncake":  # the concurrent decode leg is cancelled
        wait_until(
            lambda: bool(decode.records) and all(r.done for r in decode.records),
            3,
            "the decode leg to be cancelled",
        )
    else:
        assert decode.records == []
    cluster.wait_idle()
