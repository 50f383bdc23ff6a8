"""The standalone registry service: the admin API (and the engine bootstrap APIs) over a store.

The engine bootstrap APIs share the service's port with the admin and store APIs; only the
engine paths (``/route``, ``/register``, ``/query``, ``/register_dp_rank``, ``/query_dp_ranks``,
``/bootstrap/...``) are behind the bootstrap protection (``--bootstrap-allow``, the body bound,
the registration checks, where a namespace named by a prefill record in this registry only
accepts ranks on that prefill's host); ``/admin`` and ``/store`` have their own auth.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Collection

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from registry.admin import DEFAULT_MAX_BODY_BYTES, admin_routes, authorizer
from registry.backends import open_store
from registry.engine_api import (
    BootstrapProtection,
    OwnerHosts,
    RankTables,
    include_engine_routes,
    is_engine_path,
    protect,
)
from registry.engine_api.http_errors import error_json
from registry.http_allow import error_headers
from registry.service import RegistryService
from registry.settings import RegistrySettings
from registry.store_api import store_routes

__all__ = ["create_registry_app"]


def _service_of(request: Request) -> RegistryService:
    service: RegistryService = request.state.service
    return service


def _no_live_view(request: Request) -> None:
    return None  # a standalone registry routes nothing, so it has no live state


def _error(status: int, message: str) -> JSONResponse:
    return error_json(status, message)


def _owner_hosts(services: list[RegistryService]) -> OwnerHosts:
    """Namespace -> the hosts of the prefill records naming it (none while not running)."""

    async def owner_hosts(namespace: str) -> Collection[str]:
        records = await services[0].list_workers() if services else []
        return {
            httpx.URL(r.url).host
            for r in records
            if r.role == "prefill" and r.bootstrap_namespace == namespace
        }

    return owner_hosts


def create_registry_app(
    settings: RegistrySettings, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> FastAPI:
    """A registry process of its own (``registry serve``); routers share its store.
    ``max_body_bytes`` bounds admin and engine API bodies (413 beyond)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[dict[str, object]]:
        store = open_store(settings.url)
        tables.bind(store)
        services.append(RegistryService(store))
        try:
            yield {"service": services[0]}
        finally:
            services.clear()
            tables.bind(None)
            await store.close()

    services: list[RegistryService] = []  # the running service, for the registration checks
    protection = BootstrapProtection.from_settings(settings, max_body_bytes, _owner_hosts(services))
    app = FastAPI(title="pd-router registry", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.include_router(
        admin_routes(settings, _service_of, _no_live_view, max_body_bytes=max_body_bytes)
    )
    app.include_router(
        store_routes(lambda request: _service_of(request).store, max_body_bytes=max_body_bytes),
        dependencies=[Depends(authorizer(settings))],
    )
    tables = RankTables()
    include_engine_routes(app, tables, protection)
    protect(app, protection, is_engine_path)

    @app.get("/health", response_class=PlainTextResponse)
    async def health() -> Response:
        return PlainTextResponse("OK")

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_json(exc.status_code, str(exc.detail), error_headers(request, exc))

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _error(422, f"invalid request: {exc.errors()}")

    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    return app
