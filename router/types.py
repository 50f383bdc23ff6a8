"""ASGI callable types used at the router's raw hot path."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["CLIENT_GONE", "WHOLE_RESPONSE", "ASGIApp", "Message", "Receive", "Scope", "Send"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# The scope key of a future the router's server resolves when the client leaves (an extension
# of ours: router.server.lean_cycle); without it a request watches ``receive()`` in a task.
CLIENT_GONE = "pdr.client_gone"

# An ASGI extension of the router's server (``scope["extensions"]``): the app may send one
# message ``{"type": WHOLE_RESPONSE, "status", "headers" (lower-case names, no content-length),
# "body"}`` instead of ``http.response.start`` + ``http.response.body``; the server writes it in
# one go, with its content-length (router.server.lean_cycle).
WHOLE_RESPONSE = "pdr.response.whole"
