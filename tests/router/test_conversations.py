"""``/v1/responses`` and ``/v1/messages``: the envelope, the PD legs each protocol sends, the
prefill answers that end the generation, the streams made of a whole answer, the usage read
back and the text cache-aware routing matches (docs/concepts/protocols.md section 13)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.adapters import SglangAdapter, VllmMooncakeAdapter, VllmNixlAdapter
from router.adapters.vllm_common import finished_without_kv
from router.errors import InvalidRequest
from router.pipeline.conversation_events import message_events, response_events
from router.pipeline.decode_usage import prompt_usage, prompt_usage_in_sse
from router.pipeline.prefill_answer import prefill_answer_body, prefill_answer_events
from router.scheduling.features import request_text
from router.schemas import Endpoint, ParsedRequest, parse_request
from router.workers import Role, Worker

RESPONSE = {"model": "m", "input": "Say hi", "max_output_tokens": 20, "stream": True}
MESSAGE = {"model": "m", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 20}


def _req(endpoint: Endpoint, body: dict[str, Any]) -> ParsedRequest:
    return parse_request(endpoint, msgspec.json.encode(body))


def _prefill() -> Worker:
    worker = Worker(Role.PREFILL, "http://10.0.0.5:8100", 8998)
    worker.set_layout(1, ("eng_dp0",))
    return worker


DECODE = Worker(Role.DECODE, "http://10.0.0.6:8200")


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        (Endpoint.RESPONSES, {"model": "m"}, "input"),
        (Endpoint.RESPONSES, {"model": "m", "input": ""}, "input"),
        (Endpoint.RESPONSES, {"model": "m", "input": []}, "input"),
        (
            Endpoint.RESPONSES,
            {**RESPONSE, "previous_response_id": "resp_1"},
            "previous_response_id",
        ),
        (Endpoint.RESPONSES, {**RESPONSE, "background": True}, "background"),
        (Endpoint.MESSAGES, {"model": "m", "messages": [], "max_tokens": 5}, "messages"),
        (Endpoint.MESSAGES, {k: v for k, v in MESSAGE.items() if k != "max_tokens"}, "max_tokens"),
        (Endpoint.MESSAGES, {**MESSAGE, "max_tokens": 0}, "max_tokens"),
    ],
)
def test_a_conversation_without_what_it_needs_is_a_400_naming_the_field(
    endpoint: Endpoint, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        _req(endpoint, body)
    assert caught.value.param == param


def test_a_conversation_is_one_sequence_whatever_n_says() -> None:
    request = _req(Endpoint.MESSAGES, {**MESSAGE, "n": 7, "stream": True})
    assert (request.n, request.batch, request.sample_count, request.stream) == (1, None, 1, True)


def test_vllm_responses_prefill_is_one_token_without_eos_stop_or_store() -> None:
    adapter = VllmMooncakeAdapter(new_transfer_id=lambda: "xfer-1")
    request = _req(Endpoint.RESPONSES, {**RESPONSE, "store": True})
    plan = adapter.plan(request, _prefill(), 0, DECODE)
    p = plan.prefill_body
    assert p["max_output_tokens"] == 1 and p["ignore_eos"] is True and p["store"] is False
    assert p["stream"] is False
    # the Responses request has no max_tokens / min_tokens fields: vLLM would ignore them
    assert "max_tokens" not in p and "min_tokens" not in p
    assert p["kv_transfer_params"]["transfer_id"] == "xfer-1"
    d = plan.decode_body
    assert d is not None and d["max_output_tokens"] == 20 and d["stream"] is True
    assert d["store"] is True and "ignore_eos" not in d
    assert d["kv_transfer_params"]["do_remote_prefill"] is True


def test_vllm_messages_prefill_caps_max_tokens_and_adds_no_min_tokens() -> None:
    request = _req(Endpoint.MESSAGES, {**MESSAGE, "stream": True})
    plan = VllmNixlAdapter().plan(request, _prefill(), 0, DECODE)
    p = plan.prefill_body
    assert p["max_tokens"] == 1 and p["stream"] is False and "min_tokens" not in p
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    answer = {"type": "message", "stop_reason": "max_tokens", "kv_transfer_params": {"a": 1}}
    decode = VllmNixlAdapter().decode_after_prefill(request, answer)
    assert decode["kv_transfer_params"] == {"a": 1} and decode["max_tokens"] == 20


def test_sglang_sends_both_conversation_legs_the_same_bootstrap_room() -> None:
    request = _req(Endpoint.RESPONSES, RESPONSE)
    plan = SglangAdapter().plan(request, _prefill(), 0, DECODE)
    assert plan.decode_body is not None
    for body in (plan.prefill_body, plan.decode_body):
        assert body["bootstrap_host"] == "10.0.0.5" and body["bootstrap_port"] == 8998
    assert plan.prefill_body["bootstrap_room"] == plan.decode_body["bootstrap_room"]


@pytest.mark.parametrize(
    ("answer", "ended"),
    [
        ({"object": "response", "status": "completed"}, True),
        ({"object": "response", "status": "incomplete"}, False),
        ({"type": "message", "stop_reason": "end_turn"}, True),
        ({"type": "message", "stop_reason": "max_tokens"}, False),
        # a stop string is matched after the token: the engine kept the KV
        ({"type": "message", "stop_reason": "stop_sequence"}, False),
    ],
)
def test_a_conversation_prefill_that_ended_the_generation_is_recognised(
    answer: dict[str, Any], ended: bool
) -> None:
    assert finished_without_kv(answer) is ended


def _response(text: str) -> dict[str, Any]:
    item = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }
    usage = {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 1}
    return {
        "id": "resp_1",
        "object": "response",
        "status": "completed",
        "output": [item],
        "usage": usage,
        "max_output_tokens": 1,
        "store": False,
        "kv_transfer_params": {"transfer_id": "x"},
    }


def _events(stream: bytes) -> list[tuple[str, dict[str, Any]]]:
    parsed = []
    for block in stream.split(b"\n\n"):
        if block:
            head, data = block.split(b"\n")
            assert head.startswith(b"event: ") and data.startswith(b"data: ")
            event = msgspec.json.decode(data[6:])
            assert event["type"] == head[7:].decode()
            parsed.append((event["type"], event))
    return parsed


def test_a_prefill_completed_response_reaches_the_client_as_its_own_answer() -> None:
    request = _req(Endpoint.RESPONSES, {**RESPONSE, "stream": False})
    body = msgspec.json.decode(prefill_answer_body(request, _response(".")))
    assert "kv_transfer_params" not in body
    assert body["max_output_tokens"] == 20 and body["store"] is True


def test_a_prefill_completed_response_streams_as_the_engine_would() -> None:
    request = _req(Endpoint.RESPONSES, RESPONSE)
    events = _events(prefill_answer_events(request, _response("Hi")))
    kinds = [kind for kind, _ in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event["sequence_number"] for _, event in events] == list(range(len(events)))
    assert events[4][1]["delta"] == "Hi" and events[0][1]["response"]["output"] == []
    final = events[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hi"
    assert "kv_transfer_params" not in final and final["max_output_tokens"] == 20
    # the last event carries the usage, as the decode's own stream would
    usage = prompt_usage_in_sse(response_events(final))
    assert usage is not None and (usage.prompt_tokens, usage.cached_tokens) == (9, 4)


def test_a_prefill_completed_message_streams_as_the_engine_would() -> None:
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "Hi"}],
        "model": "m",
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 9, "output_tokens": 1},
    }
    events = _events(message_events(message))
    assert [kind for kind, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": 9, "output_tokens": 0}
    assert events[2][1]["delta"] == {"type": "text_delta", "text": "Hi"}
    assert events[4][1]["delta"]["stop_reason"] == "end_turn"
    assert events[4][1]["usage"] == {"output_tokens": 1}


def test_conversation_usage_gives_the_prompt_and_its_cached_and_computed_tokens() -> None:
    response = {
        "object": "response",
        "usage": {
            "input_tokens": 100,
            "input_tokens_details": {"cached_tokens": 96, "cache_write_tokens": 4},
            "output_tokens": 3,
        },
    }
    usage = prompt_usage(msgspec.json.encode(response))
    assert usage is not None
    assert (usage.prompt_tokens, usage.cached_tokens, usage.created_cache_tokens) == (100, 96, 4)
    # Anthropic's input_tokens excludes the cache reads and writes
    message = {
        "type": "message",
        "usage": {
            "input_tokens": 0,
            "cache_read_input_tokens": 2,
            "cache_creation_input_tokens": 98,
            "output_tokens": 3,
        },
    }
    usage = prompt_usage(msgspec.json.encode(message))
    assert usage is not None
    assert (usage.prompt_tokens, usage.cached_tokens, usage.created_cache_tokens) == (100, 2, 98)
    assert usage.recomputed(0.5, trust_cached=False)


def test_cache_aware_matches_a_conversation_by_the_same_text_as_its_chat_form() -> None:
    chat = _req(
        Endpoint.CHAT,
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say hi"},
            ],
        },
    )
    responses = _req(
        Endpoint.RESPONSES,
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Say hi"}]}],
        },
    )
    messages = _req(
        Endpoint.MESSAGES,
        {**MESSAGE, "system": [{"type": "text", "text": "Be brief."}]},
    )
    assert request_text(chat) == request_text(responses) == request_text(messages)
    assert request_text(chat) == "system: Be brief.\nuser: Say hi\n"
