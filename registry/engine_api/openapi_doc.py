"""What the engine bootstrap routes answer, for the OpenAPI schema of the apps serving them.

Each route lists the statuses it really answers: the engines' own (SGLang's plain text, vLLM's
``{"detail": ...}`` and FastAPI 422) and the listeners' refusals as error JSON (403 source not
allowed, 413 body over ``--max-body-bytes``, 409 refused registration, 429 a namespace beyond the
cap).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from registry.error_schema import ERROR_JSON

__all__ = ["SGLANG_ROUTE_BODY", "json_body", "openapi_extra", "responses"]

_DESCRIBED: dict[int, str] = {
    200: "OK",
    400: "invalid body or query (the engine's answer), or a refused rank address: unreachable "
    "or not tcp://host:port (error JSON)",
    403: "the source address is outside --bootstrap-allow (error JSON)",
    404: "unknown namespace, or (GET /route) unknown rank",
    409: "registration refused: rank host or registering source differs from the namespace's "
    "prefill worker, or a move of a live rank without the admin token (error JSON)",
    413: "request body over --max-body-bytes (error JSON)",
    422: "vLLM's own schema error for an invalid body",
    429: "a new namespace beyond --max-bootstrap-namespaces (error JSON)",
    503: "the registry store is unavailable, or (parallel info) not every rank registered yet",
}

_TEXT = {"text/plain": {"schema": {"type": "string"}}}
_JSON: dict[str, Any] = {"application/json": {"schema": {}}}  # the engines' own JSON answers
_JSON_ERRORS = frozenset({403, 409, 413, 429})

# SGLang's PUT /route body is read by hand (every engine version's payload is accepted)
SGLANG_ROUTE_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "description": "an SGLang 0.4.x or 0.5.x prefill rank registration",
                }
            }
        },
    }
}


def responses(
    *statuses: int, ok_text: bool = False, engine_text: bool = False
) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` argument of a route answering ``statuses`` (403 is always added).

    ``ok_text``: 200 is plain text (SGLang's "OK"), else JSON. ``engine_text``: the engine's
    own 400/404/503 are plain text (SGLang), else JSON (vLLM's ``{"detail": ...}``). The
    listeners' refusals (403, 409, 413, a refused address's 400) are error JSON either way.
    """
    out: dict[int | str, dict[str, Any]] = {}
    for status in sorted({*statuses, 403}):
        if status in _JSON_ERRORS:
            content: dict[str, Any] = ERROR_JSON
        elif status == 200:
            content = _TEXT if ok_text else _JSON
        elif status == 400 and engine_text:
            content = {**_TEXT, **ERROR_JSON}
        else:
            content = _TEXT if engine_text else _JSON
        out[status] = {"description": _DESCRIBED[status], "content": content}
    return out


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting a body the route reads by hand as a ``model``."""
    schema = model.model_json_schema()
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


_NAMESPACE_PARAM = {
    "name": "namespace",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,128}$"},
    "description": "the bootstrap namespace (one prefill instance)",
}


def openapi_extra(path: str, body: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """A route's ``openapi_extra``: its hand-read ``body`` and the ``{namespace}`` path part
    (the endpoints read it from the request, so FastAPI does not declare it)."""
    extra = dict(body or {})
    if "{namespace}" in path:
        extra["parameters"] = [_NAMESPACE_PARAM]
    return extra or None
