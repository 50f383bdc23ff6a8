"""The OpenAPI description of the OpenAI-style error JSON every app here answers with.

``{"error": {"message", "type", "param", "code"}}``: the router's completion routes, the admin
and store APIs and the engine bootstrap listeners all render their refusals this way, so their
schemas share this one description.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ERROR_JSON", "error_doc"]

ERROR_JSON: dict[str, Any] = {
    "application/json": {
        "schema": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["message"],
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {"type": ["string", "null"]},
                        "code": {"type": ["integer", "string"]},  # model_not_found
                    },
                }
            },
        }
    }
}


def error_doc(description: str) -> dict[str, Any]:
    """An OpenAPI response: ``description``, answered as error JSON."""
    return {"description": description, "content": ERROR_JSON}
