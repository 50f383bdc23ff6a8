"""The completion routes as the OpenAPI schema shows them.

``POST /v1/completions`` and ``/v1/chat/completions`` are served by the raw ASGI handler
(``router.api.openai``) before FastAPI sees the request; these declarations only document them,
with the statuses the handler actually answers. They are never called.
"""

from __future__ import annotations

from typing import Any, NoReturn

from fastapi import APIRouter

from registry.error_schema import ERROR_JSON, error_doc

__all__ = ["COMPLETION_RESPONSES", "ERROR_RESPONSES", "error_response", "json_body", "router"]


error_response = error_doc  # an OpenAPI response of OpenAI-style error JSON


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: error_response("Invalid request (OpenAI-style error JSON)"),
}
COMPLETION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The decode's answer: JSON, or an SSE stream when `stream` is true (a "
        'failure after the stream started arrives as a final `data: {"error": ...}` event)',
        "content": {"application/json": {}, "text/event-stream": {}},
    },
    **ERROR_RESPONSES,
    401: {
        "description": "`--api-keys`: no API key, or an unknown one (`WWW-Authenticate`)",
        "content": ERROR_JSON,
    },
    405: {"description": "Only POST (with an `Allow` header)", "content": ERROR_JSON},
    413: {"description": "Body over --max-body-bytes", "content": ERROR_JSON},
    429: {
        "description": "Overloaded, with `Retry-After`: the router's admission queue is full or "
        "the wait timed out, every worker is at its in-flight cap, or every engine tried was full",
        "content": ERROR_JSON,
    },
    "4XX": error_response("An engine's 4xx answer, passed through (404: an unknown model)"),
    502: {"description": "An engine failed", "content": ERROR_JSON},
    503: {
        "description": "No healthy worker, every engine tried was full, or shutting down",
        "content": ERROR_JSON,
    },
    504: {"description": "An engine or the KV cache timed out", "content": ERROR_JSON},
}

# The envelope ``router.schemas.parse_request`` checks (the limits are the defaults of
# ``RequestLimits``; n x prompts is also bounded, a 400); any other field goes to the engines.
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_COMMON = {
    "model": {"type": "string", "minLength": 1},
    "stream": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 1, "maximum": 128},
    "max_tokens": {"type": "integer", "minimum": 1},
}
_COMPLETION_BODY = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        **_COMMON,
        "prompt": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 256},
                _TOKEN_IDS,
                {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": 256},
            ]
        },
    },
}
_CHAT_BODY = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        **_COMMON,
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"enum": ["system", "user", "assistant"]},
                    "content": {"type": "string"},
                },
            },
        },
    },
}


def json_body(schema: dict[str, Any]) -> dict[str, Any]:
    """``openapi_extra`` for a required JSON request body of ``schema``."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


router = APIRouter()


def _never() -> NoReturn:
    raise RuntimeError("served by router.api.openai before FastAPI routing")


@router.post(
    "/v1/completions",
    responses=COMPLETION_RESPONSES,
    response_model=None,
    openapi_extra=json_body(_COMPLETION_BODY),
)
async def completions() -> None:
    """OpenAI completions, split across a prefill and a decode worker."""
    _never()


@router.post(
    "/v1/chat/completions",
    responses=COMPLETION_RESPONSES,
    response_model=None,
    openapi_extra=json_body(_CHAT_BODY),
)
async def chat_completions() -> None:
    """OpenAI chat completions, split across a prefill and a decode worker."""
    _never()
