"""The event stream an engine sends for a whole ``/v1/responses`` or ``/v1/messages`` answer.

Used when the prefill's one token already ended a streamed request (``prefill_answer``): the
client asked for events and gets those a co-located engine would have sent for that answer.
Framing as vLLM 0.32 and SGLang 0.5.23 send it: ``event: <type>`` then ``data: <json>`` per
event, no ``[DONE]`` (vLLM ``entrypoints/openai/responses/api_router.py``
``_convert_stream_to_sse_events``, ``entrypoints/anthropic/serving.py``
``wrap_data_with_event``). The events and their fields follow OpenAI's and Anthropic's
streaming references: Responses ``response.created`` ... ``response.completed`` with a
``sequence_number`` each; Messages ``message_start`` ... ``message_stop``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import msgspec

__all__ = ["message_events", "response_events"]

_encode = msgspec.json.Encoder().encode


class _Events:
    """Encoded events in order; ``numbered``: each carries its ``sequence_number``."""

    def __init__(self, numbered: bool) -> None:
        self._parts: list[bytes] = []
        self._numbers: Iterator[int] | None = itertools.count() if numbered else None

    def add(self, kind: str, **fields: Any) -> None:
        data: dict[str, Any] = {"type": kind}
        if self._numbers is not None:
            data["sequence_number"] = next(self._numbers)
        data.update(fields)
        self._parts.append(b"event: " + kind.encode() + b"\ndata: " + _encode(data) + b"\n\n")

    def joined(self) -> bytes:
        return b"".join(self._parts)


def response_events(response: dict[str, Any]) -> bytes:
    """A Responses stream: created, in progress, each output item with its content parts
    (text as one delta), then completed (or incomplete) with the whole response."""
    events = _Events(numbered=True)
    started = {**response, "status": "in_progress", "output": [], "usage": None}
    started["incomplete_details"] = None
    events.add("response.created", response=started)
    events.add("response.in_progress", response=started)
    for index, item in enumerate(response.get("output") or ()):
        if isinstance(item, dict):
            _output_item(events, index, item)
    done = "response.incomplete" if response.get("status") == "incomplete" else "response.completed"
    events.add(done, response=response)
    return events.joined()


def _output_item(events: _Events, index: int, item: dict[str, Any]) -> None:
    if item.get("type") != "message":
        events.add("response.output_item.added", output_index=index, item=item)
        events.add("response.output_item.done", output_index=index, item=item)
        return
    item_id = item.get("id")
    opened = {**item, "status": "in_progress", "content": []}
    events.add("response.output_item.added", output_index=index, item=opened)
    for part_index, part in enumerate(item.get("content") or ()):
        if not isinstance(part, dict):
            continue
        where = {"item_id": item_id, "output_index": index, "content_index": part_index}
        text = part.get("text")
        events.add("response.content_part.added", **where, part={**part, "text": ""})
        if part.get("type") == "output_text" and isinstance(text, str):
            if text:
                events.add("response.output_text.delta", **where, delta=text, logprobs=[])
            events.add("response.output_text.done", **where, text=text, logprobs=[])
        events.add("response.content_part.done", **where, part=part)
    events.add("response.output_item.done", output_index=index, item=item)


def message_events(message: dict[str, Any]) -> bytes:
    """A Messages stream: message_start (no content yet), each content block (text as one
    delta), message_delta with the stop reason and output tokens, message_stop."""
    events = _Events(numbered=False)
    given = message.get("usage")
    usage: dict[str, Any] = given if isinstance(given, dict) else {}
    start_usage = {**usage, "output_tokens": 0} if usage else usage
    head = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
    events.add("message_start", message={**head, "usage": start_usage})
    for index, block in enumerate(message.get("content") or ()):
        if not isinstance(block, dict):
            continue
        text = block.get("text")
        if block.get("type") == "text" and isinstance(text, str):
            events.add("content_block_start", index=index, content_block={**block, "text": ""})
            if text:
                delta = {"type": "text_delta", "text": text}
                events.add("content_block_delta", index=index, delta=delta)
        else:
            events.add("content_block_start", index=index, content_block=block)
        events.add("content_block_stop", index=index)
    stop = {key: message.get(key) for key in ("stop_reason", "stop_sequence")}
    events.add("message_delta", delta=stop, usage={"output_tokens": usage.get("output_tokens", 0)})
    events.add("message_stop")
    return events.joined()
