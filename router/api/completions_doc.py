"""The completion routes as the OpenAPI schema shows them.

``POST /v1/completions`` and ``/v1/chat/completions`` are served by the raw ASGI handler
(``router.api.openai``) before FastAPI sees the request; these declarations only document them,
with the statuses the handler actually answers. They are never called.
"""

from __future__ import annotations

from typing import Any, NoReturn

from fastapi import APIRouter, Body

__all__ = ["ERROR_RESPONSES", "router"]

_ERROR = {
    "application/json": {
        "schema": {
            "type": "object",
            "properties": {
                "error": {
                    "type": "object",
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {"type": ["string", "null"]},
                        "code": {"type": "integer"},
                    },
                }
            },
        }
    }
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "Invalid request (OpenAI-style error JSON)", "content": _ERROR},
}
_COMPLETION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The decode's answer: JSON, or an SSE stream when `stream` is true (a "
        'failure after the stream started arrives as a final `data: {"error": ...}` event)',
        "content": {"application/json": {}, "text/event-stream": {}},
    },
    **ERROR_RESPONSES,
    405: {"description": "Only POST (with an `Allow` header)", "content": _ERROR},
    413: {"description": "Body over --max-body-bytes", "content": _ERROR},
    429: {"description": "Every engine tried was full (their 429)", "content": _ERROR},
    502: {"description": "An engine failed", "content": _ERROR},
    503: {
        "description": "No healthy worker, every engine tried was full, or shutting down",
        "content": _ERROR,
    },
    504: {"description": "An engine or the KV cache timed out", "content": _ERROR},
}

router = APIRouter()


def _never() -> NoReturn:
    raise RuntimeError("served by router.api.openai before FastAPI routing")


@router.post("/v1/completions", responses=_COMPLETION_RESPONSES, response_model=None)
async def completions(body: dict[str, Any] = Body(...)) -> None:  # noqa: B008
    """OpenAI completions, split across a prefill and a decode worker."""
    _never()


@router.post("/v1/chat/completions", responses=_COMPLETION_RESPONSES, response_model=None)
async def chat_completions(body: dict[str, Any] = Body(...)) -> None:  # noqa: B008
    """OpenAI chat completions, split across a prefill and a decode worker."""
    _never()
