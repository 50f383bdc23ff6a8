"""The client's response when the prefill's one token already ended the generation.

A vLLM prefill whose token is a stop token answers ``finish_reason: "stop"`` and frees the KV:
no decode can continue it, and the generation is complete. The client gets that answer: as is
(without the engine-internal ``kv_transfer_params``) for a plain request, or as the one-event
stream a co-located engine would have sent (plus the usage event when asked, then ``[DONE]``).
``/v1/responses`` and ``/v1/messages`` streams are the events their engines send for a
one-token answer (``router.pipeline.conversation_events``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from router.pipeline.conversation_events import message_events, response_events
from router.schemas import Endpoint, ParsedRequest

__all__ = ["prefill_answer_body", "prefill_answer_events"]

_encode = msgspec.json.Encoder().encode


def prefill_answer_body(request: ParsedRequest, answer: dict[str, Any]) -> bytes:
    """The non-streaming answer: the prefill's, without its KV hand-off parameters (and, for
    a response, with the client's own ``max_output_tokens`` and ``store``)."""
    return _encode(client_answer(request, answer))


def client_answer(request: ParsedRequest, answer: dict[str, Any]) -> dict[str, Any]:
    """The prefill's answer as the client's: the prefill leg's own settings taken out."""
    own = {key: value for key, value in answer.items() if key != "kv_transfer_params"}
    if request.endpoint is Endpoint.RESPONSES:
        own["max_output_tokens"] = request.body.get("max_output_tokens")
        own["store"] = request.body.get("store", True)
    return own


def prefill_answer_events(request: ParsedRequest, answer: dict[str, Any]) -> bytes:
    """The streaming answer: one event per choice, the usage event if asked, ``[DONE]``."""
    if request.endpoint is Endpoint.RESPONSES:
        return response_events(client_answer(request, answer))
    if request.endpoint is Endpoint.MESSAGES:
        return message_events(client_answer(request, answer))
    chat = request.endpoint is Endpoint.CHAT
    head = {
        "id": answer.get("id"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": answer.get("created"),
        "model": answer.get("model"),
    }
    events = [
        _event({**head, "choices": [_stream_choice(choice, chat)]})
        for choice in answer.get("choices", [])
    ]
    options = request.body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") and "usage" in answer:
        events.append(_event({**head, "choices": [], "usage": answer["usage"]}))
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)


def _stream_choice(choice: dict[str, Any], chat: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"index": choice.get("index", 0)}
    if chat:
        message = choice.get("message") or {}
        out["delta"] = {"role": message.get("role", "assistant"), "content": message.get("content")}
    else:
        out["text"] = choice.get("text", "")
    out["logprobs"] = choice.get("logprobs")
    out["finish_reason"] = choice.get("finish_reason")
    if "stop_reason" in choice:
        out["stop_reason"] = choice["stop_reason"]
    return out


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + _encode(data) + b"\n\n"
