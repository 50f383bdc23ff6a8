"""The pass-through routes as the OpenAPI schema shows them.

``POST /tokenize``, ``/detokenize`` (and SGLang's ``/v1/`` forms) and ``/v1/embeddings`` are
served by the raw ASGI handler (``router.api.passthrough``) before FastAPI sees the request;
these declarations only document them, with the statuses the handler answers. Never called.
"""

from __future__ import annotations

from typing import Any, NoReturn

from fastapi import APIRouter

from registry.error_schema import ERROR_JSON, error_doc
from router.api.completions_doc import json_body

__all__ = ["router"]

_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The engine's answer, unchanged (its own format: vLLM or SGLang)",
        "content": {"application/json": {}},
    },
    400: error_doc(
        "The body is not a JSON object, or names no `model` while the workers serve several"
    ),
    401: error_doc("`--api-keys`: no API key, or an unknown one"),
    404: error_doc("No worker serves the `model` named (the message lists those served)"),
    "4XX": error_doc("An engine's 4xx answer, passed through (404: the route is not served)"),
    405: {"description": "Only POST (with an `Allow` header)", "content": ERROR_JSON},
    413: {"description": "Body over --max-body-bytes", "content": ERROR_JSON},
    429: {"description": "Overloaded, with `Retry-After`", "content": ERROR_JSON},
    502: {"description": "The engine failed", "content": ERROR_JSON},
    503: {"description": "No usable worker", "content": ERROR_JSON},
    504: {"description": "The engine timed out", "content": ERROR_JSON},
}


def _body(properties: dict[str, Any]) -> dict[str, Any]:
    return json_body({"type": "object", "properties": properties})


_TOKENIZE = _body({"model": {"type": "string"}, "prompt": {"type": "string"}})
_DETOKENIZE = _body(
    {"model": {"type": "string"}, "tokens": {"type": "array", "items": {"type": "integer"}}}
)
_EMBEDDINGS = _body({"model": {"type": "string"}, "input": {"type": "string"}})

router = APIRouter()


def _never() -> NoReturn:
    raise RuntimeError("served by router.api.passthrough before FastAPI routing")


def _declare(path: str, extra: dict[str, Any], summary: str) -> None:
    async def declared() -> None:
        _never()

    router.add_api_route(
        path,
        declared,
        methods=["POST"],
        responses=_RESPONSES,
        response_model=None,
        openapi_extra=extra,
        summary=summary,
        operation_id=path.strip("/").replace("/", "_"),
    )


_declare("/tokenize", _TOKENIZE, "Tokenize on one worker (no PD)")
_declare("/detokenize", _DETOKENIZE, "Detokenize on one worker (no PD)")
_declare("/v1/tokenize", _TOKENIZE, "SGLang's tokenize, on one worker (no PD)")
_declare("/v1/detokenize", _DETOKENIZE, "SGLang's detokenize, on one worker (no PD)")
_declare("/v1/embeddings", _EMBEDDINGS, "Embeddings from one worker (no PD)")
