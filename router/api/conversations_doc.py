"""``POST /v1/responses`` and ``/v1/messages`` as the OpenAPI schema shows them.

Served by the raw ASGI handler (``router.api.openai``) like the completion routes; these
declarations only document them, with the envelope ``router.schemas.parse_request`` checks.
They are never called.
"""

from __future__ import annotations

from typing import NoReturn

from fastapi import APIRouter

from router.api.completions_doc import COMPLETION_RESPONSES, json_body

__all__ = ["router"]

_TEXT_PARTS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"enum": ["text", "input_text"]}, "text": {"type": "string"}},
    },
}
_CONTENT = {"anyOf": [{"type": "string"}, _TEXT_PARTS]}
_ROLE_MESSAGES = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {"role": {"enum": ["user", "assistant"]}, "content": _CONTENT},
    },
}
_RESPONSES_BODY = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "stream": {"type": "boolean"},
        "instructions": {"type": "string"},
        "input": {"anyOf": [{"type": "string", "minLength": 1}, _ROLE_MESSAGES]},
        "max_output_tokens": {"type": "integer", "minimum": 1},
    },
}
_MESSAGES_BODY = {
    "type": "object",
    "required": ["model", "messages", "max_tokens"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "stream": {"type": "boolean"},
        "system": _CONTENT,
        "messages": _ROLE_MESSAGES,
        "max_tokens": {"type": "integer", "minimum": 1},
    },
}

router = APIRouter()


def _never() -> NoReturn:
    raise RuntimeError("served by router.api.openai before FastAPI routing")


@router.post(
    "/v1/responses",
    responses=COMPLETION_RESPONSES,
    response_model=None,
    openapi_extra=json_body(_RESPONSES_BODY),
)
async def responses() -> None:
    """OpenAI Responses, stateless (no `previous_response_id`, no `background`), split across
    a prefill and a decode worker; streams are the engine's `event:`/`data:` SSE."""
    _never()


@router.post(
    "/v1/messages",
    responses=COMPLETION_RESPONSES,
    response_model=None,
    openapi_extra=json_body(_MESSAGES_BODY),
)
async def messages() -> None:
    """Anthropic Messages, split across a prefill and a decode worker; streams are the
    engine's `event:`/`data:` SSE. Errors come in Anthropic's envelope, `{"type": "error",
    "error": {...}}` around the fields shown (a stream cut mid-way: an `event: error`)."""
    _never()
