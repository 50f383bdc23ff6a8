"""vLLM MooncakeConnector's bootstrap server API over HTTP (``POST /register``, ``GET /query``).

vLLM >= 0.32 can point its prefill workers at an external bootstrap server
(``kv_connector_extra_config.bootstrap_server_address="host:port"``); the registry answers for it
with vLLM 0.32's exact answers (docs/concepts/protocols.md 3.2): 422 on a schema error,
``{"status":"ok"}``, and
``{"detail": ...}`` 400s for refused registrations. Older vLLM runs its own server; the router
then only reads ``/query`` from it.

Paths (docs/concepts/protocols.md 3.6). vLLM builds the registration URL from ``host:port`` alone,
so two
prefill instances registering ``dp_rank=0`` at one address would collide ("Engine ID mismatch"
and a crashed worker). Hence:

* the plain paths ``/register`` and ``/query`` belong to namespace ``"default"``;
* every further prefill instance gets a port of its own serving its namespace on the plain
  paths (``app.namespace_app``): that port is its ``bootstrap_server_address``;
* ``/bootstrap/{namespace}/register|query`` reach any namespace on the shared port. Decoders use
  ``remote_bootstrap_addr`` verbatim as a URL prefix, so the router may hand them
  ``http://<router>/bootstrap/<namespace>``; prefill workers cannot use a path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from registry.engine_api.http_errors import error_json
from registry.engine_api.namespaces import ROUTE_PREFIXES, Resolver, namespace_of
from registry.engine_api.openapi_doc import openapi_extra, responses
from registry.engine_api.rank_checks import (
    RankClaim,
    RegistrationGuard,
    RegistrationRefused,
    parse_tcp_address,
)
from registry.engine_api.vllm_payloads import RegisterWorkerPayload
from registry.engine_api.vllm_table import VllmRankTable
from registry.errors import Conflict, NotFound, RegistryUnavailable, TooManyNamespaces

__all__ = ["vllm_routes"]

logger = logging.getLogger(__name__)


def _detail(message: str, status: int) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)


class _VllmRoute(APIRoute):
    """Renders errors as vLLM's FastAPI server does, whatever handlers the hosting app has."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                response: Response = await handler(request)
            except RequestValidationError as exc:
                return await request_validation_exception_handler(request, exc)
            except Conflict as exc:
                return _detail(str(exc), 400)
            except NotFound as exc:
                return _detail(str(exc), 404)
            except RegistrationRefused as exc:
                return error_json(exc.status, str(exc))
            except TooManyNamespaces as exc:
                return error_json(429, str(exc))
            except RegistryUnavailable as exc:
                logger.warning("vllm bootstrap: store unavailable: %s", exc)
                return _detail(f"Bootstrap registry unavailable: {exc}", 503)
            return response

        return guarded


async def _claim(
    table: VllmRankTable, payload: RegisterWorkerPayload, source: str | None
) -> RankClaim:
    host, port = parse_tcp_address(payload.addr)
    previous = await table.address_of(payload.dp_rank, payload.tp_rank, payload.pp_rank)
    before = None
    if previous is not None:
        try:
            before = parse_tcp_address(previous)
        except RegistrationRefused:
            before = (previous, 0)  # stored by an unchecked writer: never equal, never alive
    return RankClaim(
        namespace=table.namespace,
        rank=f"dp_rank={payload.dp_rank} tp_rank={payload.tp_rank} pp_rank={payload.pp_rank}",
        host=host,
        port=port,
        previous=before,
        source=source,
    )


def vllm_routes(
    resolve: Resolver[VllmRankTable], guard: RegistrationGuard | None = None
) -> APIRouter:
    """``/register`` and ``/query`` (namespace ``"default"``) and ``/bootstrap/{namespace}/...``.

    ``resolve`` maps a namespace name to its table and raises ``NotFound`` for an unknown one
    (answered 404). With a ``guard`` every registration is checked first (``rank_checks``;
    ``addr`` must then be ``tcp://host:port``); without one (the bare protocol) nothing is.
    """

    def table_of(request: Request) -> VllmRankTable:
        return resolve(namespace_of(request))

    async def register(payload: RegisterWorkerPayload, request: Request) -> JSONResponse:
        table = table_of(request)
        replace = False
        if guard is not None:
            authorization = request.headers.get("authorization", "")
            source = request.client.host if request.client else None
            replace = await guard.admit(await _claim(table, payload, source), authorization)
        await table.register(payload, replace=replace)
        return JSONResponse({"status": "ok"})

    async def query(request: Request) -> JSONResponse:
        return JSONResponse(await table_of(request).query())

    router = APIRouter(route_class=_VllmRoute, tags=["engine bootstrap (vLLM)"])
    for prefix in ROUTE_PREFIXES:
        router.add_api_route(
            prefix + "/register",
            register,
            methods=["POST"],
            responses=responses(200, 400, 404, 409, 413, 422, 429, 503),
            openapi_extra=openapi_extra(prefix),
        )
        router.add_api_route(
            prefix + "/query",
            query,
            methods=["GET"],
            responses=responses(200, 404, 429, 503),
            openapi_extra=openapi_extra(prefix),
        )
    return router
