"""OpenAI Responses (`POST /v1/responses`) and Anthropic Messages (`POST /v1/messages`) for the
fake engine: request shapes, the sampling view of a request, and the answer formats (full JSON
bodies and SSE events), rendered from the same `Completion` as `/v1/completions` and
`/v1/chat/completions` (`testkit/fake_wire.py`), so one prompt generates the same tokens on
every endpoint.

The shapes follow vLLM 0.32 (`vllm/entrypoints/...` in .venv-vllm) and SGLang 0.5.23
(`sglang/srt/entrypoints/...` in .venv-sglang):

* Responses body: `openai/responses/protocol.py` `ResponsesResponse` (every field, nulls
  included: `api_router.py` dumps it with `model_dump(mode="json", by_alias=True)`), built by
  `ResponsesResponse.from_request` (`status` "completed", or "incomplete" with
  `incomplete_details: {"reason": "max_output_tokens"}` when the output ended by length; the
  top-level `kv_transfer_params`, null when the engine has none); `usage` is `ResponseUsage`
  from `serving.py` `responses_full_generator` (the per-turn lists stay empty for a
  `SimpleContext`); the output is the parser-less `_make_response_output_items`: one
  `message` item, its `content` empty when the text is. SGLang's `ResponsesResponse` has no
  `kv_transfer_params`: not sent where the role handler does not echo KV params.
* Responses stream: `api_router.py` `_convert_stream_to_sse_events` writes
  `event: {type}\\ndata: {json}\\n\\n` and no `[DONE]`; `serving.py`
  `responses_stream_generator` numbers the events from 0 (`sequence_number`):
  response.created, response.in_progress (the response "in_progress", output [], usage null),
  then `streaming_events.py` `emit_text_delta_events` (output_item.added, content_part.added,
  one output_text.delta per text piece) and `emit_text_output_done_events`
  (output_text.done, content_part.done, output_item.done), then response.completed with the
  full response. SGLang frames it the same way (`serving_responses.py`).
* Messages body: `anthropic/protocol.py` `AnthropicMessagesResponse` dumped with
  `exclude_none=True` (`anthropic/api_router.py`), as `serving.py` `messages_full_converter`
  builds it: the chat id (vLLM; SGLang mints `msg_{hex}`), one text block (an empty one for an
  empty completion), `stop_reason` from `_to_anthropic_stop_reason` (length: "max_tokens"; a
  stop string: "stop_sequence" + `stop_sequence`; EOS or a stop token id: "end_turn"), `usage`
  from `_build_anthropic_usage` (input_tokens = prompt - cached - created, and
  `cache_read_input_tokens` / `cache_creation_input_tokens` when the engine reports details),
  and `kv_transfer_params` (absent when null).
* Messages stream: `serving.py` `message_stream_converter`, framed by `wrap_data_with_event`
  (`event: {type}\\ndata: {json}\\n\\n`, no `[DONE]`, no `ping`): message_start (usage:
  the prompt, 0 output), content_block_start / content_block_delta (text_delta) /
  content_block_stop only when there is text, message_delta (`stop_reason`, `stop_sequence`,
  usage), message_stop.
* Errors on `/v1/messages`: `translate_error_response`:
  `{"type": "error", "error": {"type": ..., "message": ...}}` with the status.
* Sampling: vLLM's Responses request has `stop`, `stop_token_ids` and `ignore_eos` but no
  `min_tokens` (`to_sampling_params`); its Anthropic request only `stop_sequences` (mapped to
  `stop` by `_build_base_request`): no `ignore_eos`, `min_tokens` nor `stop_token_ids`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from typing import Any, Final

import msgspec

from testkit.fake_base import Shape, bad_request, is_int
from testkit.fake_wire import ERROR_TYPES, Completion

__all__ = [
    "FORMAT_PATHS",
    "MESSAGES_PATH",
    "RESPONSES_PATH",
    "format_events",
    "format_full_body",
    "format_shape",
    "messages_error_body",
    "sampling_view",
]

RESPONSES_PATH: Final = "/v1/responses"
MESSAGES_PATH: Final = "/v1/messages"
FORMAT_PATHS: Final = (RESPONSES_PATH, MESSAGES_PATH)
FAKE_MAX_MODEL_LEN: Final = 8192  # vLLM's default max_output_tokens: max_model_len - prompt
_encode = msgspec.json.encode


# --------------------------------------------------------------------------- requests


def _words(text: str) -> int:
    return max(1, len(text.split()))


def _content_text(content: object) -> str:
    """A message's text: a string, or the `text` of each part/block in a list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = (part.get("text") for part in content if isinstance(part, dict))
        return " ".join(part for part in parts if isinstance(part, str))
    return ""


def _responses_prompt(body: Mapping[str, Any]) -> str:
    items = body.get("input")
    if isinstance(items, str):
        texts = [items]
    elif isinstance(items, list) and items:
        texts = [_content_text(i.get("content")) for i in items if isinstance(i, dict)]
    else:
        raise bad_request("'input' is required and must be a string or a non-empty list")
    instructions = body.get("instructions")
    return " ".join([instructions if isinstance(instructions, str) else "", *texts])


def _messages_prompt(body: Mapping[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' is required and must be a non-empty list")
    texts = [_content_text(m.get("content")) for m in messages if isinstance(m, dict)]
    return " ".join([_content_text(body.get("system")), *texts])


def _limit(body: Mapping[str, Any], key: str, required: bool) -> int | None:
    value = body.get(key)
    if value is None and not required:
        return None
    if not is_int(value) or value < 1:
        raise bad_request(f"'{key}' must be a positive integer, got {value!r}")
    return value


def format_shape(path: str, body: Mapping[str, Any]) -> Shape:
    """Validate a Responses or Messages request (one choice, no `n`); raise a 400."""
    responses = path == RESPONSES_PATH
    prompt = _responses_prompt(body) if responses else _messages_prompt(body)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request(f"'stream' must be a boolean, got {stream!r}")
    limit_key = "max_output_tokens" if responses else "max_tokens"
    return Shape(
        chat=True,
        batch=None,
        n=1,
        stream=bool(stream),
        include_usage=False,
        max_tokens=_limit(body, limit_key, required=not responses),
        prompt_tokens=_words(prompt),
    )


def sampling_view(path: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The request's stop rules as `generate` reads them, limited to what the engine's request
    model has (see the module docstring)."""
    if path == MESSAGES_PATH:
        return {"stop": body.get("stop_sequences") or []}
    keys = ("stop", "stop_token_ids", "ignore_eos")
    return {key: body[key] for key in keys if key in body}


# --------------------------------------------------------------------------- Responses


def _cached(c: Completion) -> tuple[int, int]:
    """(cached, created) prompt tokens as the engine reports them (0 without details)."""
    details = c.prompt_details or {}
    return details.get("cached_tokens", 0), details.get("created_cache_tokens", 0)


def _responses_usage(c: Completion) -> dict[str, Any]:
    cached, created = _cached(c)
    return {
        "input_tokens": c.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": created,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": c.tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": c.prompt_tokens + c.tokens,
    }


def _text_part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def _message_item(item_id: str, content: list[Any], status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
    }


def _response(
    c: Completion, body: Mapping[str, Any], output: list[Any], final: bool
) -> dict[str, Any]:
    """`ResponsesResponse.from_request`: the final one, or the in-progress one of a stream."""
    incomplete = final and c.generation.finish_reason == "length"
    status = ("incomplete" if incomplete else "completed") if final else "in_progress"
    max_output = body.get("max_output_tokens")
    limit = max_output if is_int(max_output) else FAKE_MAX_MODEL_LEN - c.prompt_tokens
    response: dict[str, Any] = {
        "id": f"resp_{c.id}",
        "created_at": c.created,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata"),
        "model": c.model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature") or 1.0,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p") or 1.0,
        "background": body.get("background") or False,
        "max_output_tokens": limit,
        "max_tool_calls": body.get("max_tool_calls"),
        "previous_response_id": body.get("previous_response_id"),
        "prompt": None,
        "reasoning": body.get("reasoning"),
        "service_tier": body.get("service_tier", "auto"),
        "status": status,
        "text": body.get("text"),
        "top_logprobs": None,
        "truncation": body.get("truncation") or "disabled",
        "usage": _responses_usage(c) if final else None,
        "user": body.get("user"),
        "presence_penalty": body.get("presence_penalty") or 0.0,
        "frequency_penalty": body.get("frequency_penalty") or 0.0,
    }
    if c.admission.echo_kv:  # vLLM only (SGLang's ResponsesResponse has no such field)
        response["kv_transfer_params"] = c.admission.kv_transfer_params
        response["ec_transfer_params"] = None
    response["input_messages"] = response["output_messages"] = None
    return response


def _item_id(c: Completion) -> str:
    return f"msg_{uuid.uuid5(uuid.NAMESPACE_OID, c.id).hex}"


def responses_body(c: Completion, body: Mapping[str, Any]) -> dict[str, Any]:
    text = c.generation.text
    content = [_text_part(text, None)] if text else []
    return _response(c, body, [_message_item(_item_id(c), content, "completed")], final=True)


def _responses_events(c: Completion, body: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """The stream's events, without their `sequence_number` (numbered by the caller)."""
    initial = _response(c, body, [], final=False)
    yield {"type": "response.created", "response": initial}
    yield {"type": "response.in_progress", "response": initial}
    text, item_id = c.generation.text, _item_id(c)
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    output: list[Any] = []
    if text:
        yield {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": _message_item(item_id, [], "in_progress"),
        }
        yield {"type": "response.content_part.added", **where, "part": _text_part("", [])}
        for piece in c.generation.texts:
            if piece:
                yield {
                    "type": "response.output_text.delta",
                    **where,
                    "delta": piece,
                    "logprobs": [],
                }
        part = _text_part(text, None)
        output = [_message_item(item_id, [part], "completed")]
        yield {"type": "response.output_text.done", **where, "text": text, "logprobs": []}
        yield {"type": "response.content_part.done", **where, "part": part}
        yield {"type": "response.output_item.done", "output_index": 0, "item": output[0]}
    yield {"type": "response.completed", "response": _response(c, body, output, final=True)}


def _sse(event: dict[str, Any]) -> bytes:
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + _encode(event) + b"\n\n"


def responses_events(c: Completion, body: Mapping[str, Any]) -> Iterator[bytes]:
    for number, event in enumerate(_responses_events(c, body)):
        yield _sse({"type": event.pop("type"), "sequence_number": number, **event})


# --------------------------------------------------------------------------- Messages


def _messages_usage(c: Completion, output: int) -> dict[str, Any]:
    """`_build_anthropic_usage`: the cache fields only when the engine reports details."""
    cached, created = _cached(c)
    usage: dict[str, Any] = {"input_tokens": max(0, c.prompt_tokens - cached - created)}
    usage["output_tokens"] = output
    if c.prompt_details is not None:
        usage["cache_read_input_tokens"] = cached
        usage["cache_creation_input_tokens"] = created
    return usage


def _stop_reason(c: Completion) -> tuple[str, str | None]:
    """`_to_anthropic_stop_reason` for a text answer."""
    if c.generation.finish_reason == "length":
        return "max_tokens", None
    stop = c.generation.stop_reason
    return ("stop_sequence", stop) if isinstance(stop, str) else ("end_turn", None)


def _message_id(c: Completion) -> str:
    return c.object_id if c.admission.echo_kv else f"msg_{c.id}"  # vLLM: the chat id


def messages_body(c: Completion) -> dict[str, Any]:
    reason, sequence = _stop_reason(c)
    body: dict[str, Any] = {
        "id": _message_id(c),
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": c.generation.text}],
        "model": c.model,
        "stop_reason": reason,
        "usage": _messages_usage(c, c.tokens),
    }
    if sequence is not None:
        body["stop_sequence"] = sequence
    if c.admission.echo_kv and c.admission.kv_transfer_params is not None:
        body["kv_transfer_params"] = c.admission.kv_transfer_params
    return body


def _messages_events(c: Completion) -> Iterator[dict[str, Any]]:
    start_usage = {"input_tokens": c.prompt_tokens, "output_tokens": 0}
    message: dict[str, Any] = {
        "id": _message_id(c),
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": c.model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": start_usage,
    }
    yield {"type": "message_start", "message": message}
    pieces = [piece for piece in c.generation.texts if piece]
    if pieces:
        block = {"type": "text", "text": ""}
        yield {"type": "content_block_start", "content_block": block, "index": 0}
        for piece in pieces:
            delta = {"type": "text_delta", "text": piece}
            yield {"type": "content_block_delta", "delta": delta, "index": 0}
        yield {"type": "content_block_stop", "index": 0}
    reason, sequence = _stop_reason(c)
    stop: dict[str, Any] = {"stop_reason": reason, "stop_sequence": sequence}
    yield {"type": "message_delta", "delta": stop, "usage": _messages_usage(c, c.tokens)}
    yield {"type": "message_stop"}


def messages_error_body(status: int, message: str) -> bytes:
    """vLLM's `translate_error_response`: the Anthropic error envelope."""
    fallback = "InternalServerError" if status >= 500 else "BadRequestError"
    error = {"type": ERROR_TYPES.get(status, fallback), "message": message}
    return _encode({"type": "error", "error": error})


# --------------------------------------------------------------------------- dispatch


def format_full_body(path: str, c: Completion, body: Mapping[str, Any]) -> bytes:
    """A non-stream answer on `path` (one of `FORMAT_PATHS`)."""
    return _encode(responses_body(c, body) if path == RESPONSES_PATH else messages_body(c))


def format_events(path: str, c: Completion, body: Mapping[str, Any]) -> Iterator[bytes]:
    """A streamed answer's SSE events on `path` (one of `FORMAT_PATHS`)."""
    if path == RESPONSES_PATH:
        yield from responses_events(c, body)
    else:
        yield from (_sse(event) for event in _messages_events(c))
