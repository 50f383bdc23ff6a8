"""The chat messages inside a Responses or Anthropic Messages body, for routing only.

Cache-aware routing matches a request's prompt text (approximate mode) or its token ids
(precise mode: the chat template applied to ``messages``). ``/v1/responses`` and
``/v1/messages`` carry the same conversation in other shapes; the engines turn both into chat
messages before templating them (vLLM 0.32 ``entrypoints/openai/responses/utils.py``
``construct_input_messages`` and ``entrypoints/anthropic/serving.py``
``_convert_to_chat_completion_request``; SGLang 0.5.23 the same in
``serving_responses.py`` and ``anthropic/serving.py``). This module does the text part of that
conversion, so a multi-turn session routes alike whichever API it speaks. Tool calls, images
and other non-text items add no text (they still reach the engines untouched: the body is
never rewritten from this view).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.schemas import ParsedRequest

__all__ = ["conversation_messages", "messages_of_anthropic", "messages_of_responses", "text_of"]

# the text-carrying content part types: chat ("text"), Responses ("input_text" from the
# client, "output_text" in a replayed assistant turn), Anthropic ("text")
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def conversation_messages(request: ParsedRequest) -> list[dict[str, str]] | None:
    """The chat messages of a Responses or Messages request; None for the other endpoints."""
    path = request.endpoint.value
    if path == "/v1/responses":
        return messages_of_responses(request.body)
    if path == "/v1/messages":
        return messages_of_anthropic(request.body)
    return None


def text_of(content: Any) -> str:
    """A message's text: a string, or its text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and part.get("type") in _TEXT_PARTS
            if isinstance(part.get("text"), str)
        )
    return ""


def messages_of_responses(body: dict[str, Any]) -> list[dict[str, str]]:
    """``instructions`` as the system message, then ``input``: a string (one user message) or
    a list of items, of which those with a role are messages."""
    messages: list[dict[str, str]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        messages.extend(
            {"role": item["role"], "content": text_of(item.get("content"))}
            for item in items
            if isinstance(item, dict) and isinstance(item.get("role"), str)
        )
    return messages


def messages_of_anthropic(body: dict[str, Any]) -> list[dict[str, str]]:
    """``system`` (a string or text blocks) as the system message, then ``messages``."""
    messages: list[dict[str, str]] = []
    system = text_of(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    messages.extend(
        {"role": message["role"], "content": text_of(message.get("content"))}
        for message in body.get("messages", ())
        if isinstance(message, dict) and isinstance(message.get("role"), str)
    )
    return messages
