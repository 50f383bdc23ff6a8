"""The ``Allow`` header of a 405: every method the app serves the request's path with.

Starlette's router answers 405 from the *first* route whose path matches, so its ``Allow`` names
that route's methods only: with ``GET /admin/workers`` and ``POST /admin/workers`` declared as two
routes, a ``PATCH`` is told ``Allow: GET``. ``error_headers`` asks the app's routes instead, one
method at a time, through the public ``BaseRoute.matches`` (FastAPI nests included routers in
routes of its own, so reading ``route.methods`` would miss them); the registry's and the router's
``HTTPException`` handlers pass its answer on.

A ``Mount`` matches its whole prefix whatever the method, so an app with one would be told every
method for the paths under it (neither app mounts one).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.routing import BaseRoute, Match
from starlette.types import Scope

__all__ = ["METHODS", "allowed_methods", "error_headers"]

# the methods asked about: RFC 9110's and PATCH
METHODS = ("CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "TRACE")


def _served(routes: Iterable[BaseRoute], scope: Scope) -> bool:
    return any(route.matches(scope)[0] is Match.FULL for route in routes)


def allowed_methods(routes: Iterable[BaseRoute], scope: Scope) -> list[str]:
    """The ``METHODS`` some route serves ``scope``'s path with (whatever its method), sorted."""
    routes = list(routes)
    return [method for method in METHODS if _served(routes, {**scope, "method": method})]


def error_headers(request: Request, exc: HTTPException) -> Mapping[str, str] | None:
    """``exc``'s headers; for a 405, with an ``Allow`` naming every method the path is served
    with."""
    if exc.status_code != 405:
        return exc.headers
    methods = allowed_methods(request.app.router.routes, request.scope)
    if not methods:
        return exc.headers
    return {**(exc.headers or {}), "Allow": ", ".join(methods)}
