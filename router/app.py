"""``create_app``: the FastAPI app for the cold routes behind a raw dispatcher for the hot ones."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from registry.admin import LiveView, admin_routes
from registry.engine_api import RankTables
from registry.http_allow import error_headers
from registry.service import RegistryService
from router.api import completions_doc, conversations_doc, health, passthrough_doc, status
from router.api.deps import get_context
from router.api.explain import explain_routes
from router.api.live_view import live_view
from router.api.openai import HOT_ROUTES, handle_completion
from router.api.passthrough import PASSTHROUGH_ROUTES, handle_passthrough
from router.api.routing_health import diagnosis_routes
from router.context import open_context
from router.errors import InvalidRequest, RouterError, error_body
from router.process_role import ProcessRole
from router.server.lifecycle import RouterLifecycle
from router.settings import RouterSettings
from router.types import Receive, Scope, Send

__all__ = ["PDRouterApp", "create_app"]


class PDRouterApp:
    """ASGI entry: completions go straight to the raw handler, the rest to FastAPI.
    ``lifecycle``: what the server's SIGTERM handler tells (graceful shutdown)."""

    def __init__(self, api: FastAPI, lifecycle: RouterLifecycle) -> None:
        self.api = api
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            endpoint = HOT_ROUTES.get(path)
            if endpoint is not None:
                await handle_completion(scope["state"]["ctx"], endpoint, scope, receive, send)
                return
            if path in PASSTHROUGH_ROUTES:
                await handle_passthrough(scope["state"]["ctx"], path, scope, receive, send)
                return
        await self.api(scope, receive, send)


def _registry_of(request: Request) -> RegistryService:
    return get_context(request).fleet.registry


def _live_view_of(request: Request) -> LiveView:
    return partial(live_view, get_context(request))


def _render(exc: RouterError, headers: Mapping[str, str] | None = None) -> Response:
    return Response(
        error_body(exc), status_code=exc.status, media_type="application/json", headers=headers
    )


def install_error_handlers(api: FastAPI) -> None:
    """Every error leaves the router as an OpenAI-style error JSON."""

    async def on_router_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RouterError)
        headers = {name.decode(): value.decode() for name, value in exc.headers}
        return _render(exc, headers or None)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        error = RouterError(str(exc.detail))
        error.status = exc.status_code
        error.error_type = "invalid_request_error" if exc.status_code < 500 else error.error_type
        if exc.status_code == 503:
            error.error_type = "service_unavailable"
        return _render(error, error_headers(request, exc))  # e.g. 405's Allow

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _render(InvalidRequest(f"invalid request: {exc.errors()}"))

    api.add_exception_handler(RouterError, on_router_error)
    api.add_exception_handler(HTTPException, on_http_error)
    api.add_exception_handler(RequestValidationError, on_validation_error)


def _document_400s(api: FastAPI) -> None:
    """The schema says what the router answers: invalid bodies and parameters get 400 with an
    OpenAI-style error JSON (``install_error_handlers``), not FastAPI's 422."""
    build = api.openapi

    def openapi() -> dict[str, Any]:
        if api.openapi_schema is None:
            schema = build()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    responses = operation.get("responses", {})
                    validated = responses.pop("422", None) is not None
                    if validated or "requestBody" in operation:
                        responses.setdefault("400", completions_doc.ERROR_RESPONSES[400])
            api.openapi_schema = schema
        return api.openapi_schema

    api.openapi = openapi  # type: ignore[method-assign]


def create_app(settings: RouterSettings, role: ProcessRole | None = None) -> PDRouterApp:
    """The router's ASGI app; all state lives in the lifespan-owned context. ``role``: this
    process's place among ``router --workers N``'s (None: a router on its own)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[dict[str, object]]:
        async with open_context(settings, tables, lifecycle, role) as ctx:
            yield {"ctx": ctx}

    lifecycle = RouterLifecycle()
    api = FastAPI(title="pd-router", lifespan=lifespan, docs_url=None, redoc_url=None)
    api.include_router(health.router)
    api.include_router(
        admin_routes(
            settings.registry,
            _registry_of,
            _live_view_of,
            max_body_bytes=settings.server.max_body_bytes,
        )
    )
    api.include_router(explain_routes(settings.registry))
    api.include_router(diagnosis_routes(settings.registry))
    api.include_router(status.router)
    api.include_router(completions_doc.router)
    api.include_router(conversations_doc.router)
    api.include_router(passthrough_doc.router)
    _document_400s(api)
    # The engines' bootstrap APIs are served on listeners of their own, never on this port
    # (router/server/bootstrap_listeners.py, started with the context); the tables back them.
    tables = RankTables()
    install_error_handlers(api)
    return PDRouterApp(api, lifecycle)
