"""The error JSON the bootstrap listeners answer for their own refusals.

The engines' protocol errors keep the engines' own shapes (SGLang's plain text, vLLM's
``{"detail": ...}``); what the listeners add on top (403 source not allowed, 409 refused
registration, 413 body too large, 400 unreachable rank) is the project's OpenAI-style error JSON
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

__all__ = ["error_json", "on_http_error"]


def error_json(status: int, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """``{"error": {...}}`` with ``status``; ``code`` is the status."""
    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


async def on_http_error(request: Request, exc: Exception) -> Response:
    """An app's ``HTTPException`` handler (404, 405, 413, ...) rendering ``error_json``."""
    assert isinstance(exc, HTTPException)
    return error_json(exc.status_code, str(exc.detail), exc.headers)
