"""The standalone registry service: the admin API (and the engine bootstrap APIs) over a store."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from registry.admin import admin_routes, authorizer
from registry.backends import open_store
from registry.engine_api import RankTables, sglang_routes, vllm_routes
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
    kind = "invalid_request_error" if status < 500 else "internal_server_error"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status_code=status,
    )


def create_registry_app(settings: RegistrySettings) -> FastAPI:
    """A registry process of its own (``registry serve``); routers share its store."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[dict[str, object]]:
        store = open_store(settings.url)
        tables.bind(store)
        try:
            yield {"service": RegistryService(store)}
        finally:
            tables.bind(None)
            await store.close()

    app = FastAPI(title="pd-router registry", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.include_router(admin_routes(settings, _service_of, _no_live_view))
    app.include_router(
        store_routes(lambda request: _service_of(request).store),
        dependencies=[Depends(authorizer(settings))],
    )
    tables = RankTables()
    app.include_router(sglang_routes(tables.sglang))
    app.include_router(vllm_routes(tables.vllm))

    @app.get("/health")
    async def health() -> Response:
        return Response("OK")

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _error(exc.status_code, str(exc.detail))

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _error(422, f"invalid request: {exc.errors()}")

    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    return app
