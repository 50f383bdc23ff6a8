"""SGLang's prefill bootstrap server API over HTTP, from the rank tables
(docs/concepts/protocols.md 5.5, 5.6).

Engines call these paths on ``bootstrap_host:bootstrap_port`` and cannot add a path prefix, so the
plain paths (``/route``, ``/register_dp_rank``, ``/query_dp_ranks``) belong to namespace
``"default"``, and each further prefill instance needs a port of its own (``app.namespace_app``).
The same routes under ``/bootstrap/{namespace}/...`` (plus ``/bootstrap/{namespace}/health``) let
the router and operators reach any namespace on the shared port.

Answers are the engine's, byte for byte where decoders parse them, with these decisions:

* The parallel-info query answers 503 until every dp x cp x tp x pp rank is registered in *every*
  form (the engines before 0.5.10 answer at once, with nulls while empty); decoders of every
  version treat a non-200 answer as "not available yet".
* Unknown ranks are 404 "Bootstrap info not found ..." in every form (0.4.x raised a KeyError,
  a 500); invalid bodies and queries are 400 (the engines raise, a 500).
* The 0.5.10+ parallel info is the registering engine's ``PrefillServerInfo``: decoders build the
  dataclass with ``PrefillServerInfo(**d)`` and fail on unknown keys, so the version-specific
  fields appear only when the prefill sent them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from fastapi.routing import APIRoute
from pydantic import JsonValue

from registry.engine_api.http_errors import error_json
from registry.engine_api.namespaces import NAMESPACE_PREFIX, ROUTE_PREFIXES, Resolver, namespace_of
from registry.engine_api.openapi_doc import (
    SGLANG_ROUTE_BODY,
    json_body,
    openapi_extra,
    responses,
)
from registry.engine_api.rank_checks import RankClaim, RegistrationGuard, RegistrationRefused
from registry.engine_api.sglang_payloads import (
    SERVER_INFO_EXTRAS,
    DpRankQuery,
    DpRankRegistration,
    QueryForm,
    RankRegistration,
    RouteQuery,
    check_room_count,
    parse_route_payload,
    parse_route_query,
    validate_body,
)
from registry.engine_api.sglang_table import SglangParallelInfo, SglangRankTable
from registry.errors import (
    BadEngineApiRequest,
    Conflict,
    NotFound,
    RegistryUnavailable,
    TooManyNamespaces,
)

__all__ = ["answer_route_query", "render_parallel_info", "sglang_routes"]

logger = logging.getLogger(__name__)

_JSON = "application/json; charset=utf-8"  # what aiohttp's json_response sends
_DECODE_SIDE_FIELDS = (
    "target_tp_rank",
    "target_tp_ranks",
    "target_cp_ranks",
    "target_pp_ranks",
    "required_dst_info_num",
    "required_prefill_response_num",
)


def render_parallel_info(
    form: QueryForm, info: SglangParallelInfo, decode_fields: bool = True
) -> dict[str, JsonValue]:
    """The parallel-info answer in the shape the querying engine version expects."""
    if form is QueryForm.V0_4:
        return {"prefill_tp_size": info.tp_size * info.dp_size, "prefill_dp_size": info.dp_size}
    if form is QueryForm.V0_5_1:
        answer: dict[str, JsonValue] = {
            "prefill_attn_tp_size": info.tp_size,
            "prefill_dp_size": info.dp_size,
            "prefill_pp_size": info.pp_size,
        }
        if info.page_size is not None:
            answer["prefill_page_size"] = info.page_size
        return answer
    return _server_info(info, decode_fields)


def _server_info(info: SglangParallelInfo, decode_fields: bool) -> dict[str, JsonValue]:
    answer: dict[str, JsonValue] = {
        "attn_tp_size": info.tp_size,
        "attn_cp_size": info.cp_size,
        "dp_size": info.dp_size,
        "pp_size": info.pp_size,
        "page_size": info.page_size,
        "kv_cache_dtype": info.kv_cache_dtype,
        "follow_bootstrap_room": info.follow_bootstrap_room,
    }
    answer.update({name: info.extras[name] for name in SERVER_INFO_EXTRAS if name in info.extras})
    if decode_fields:
        answer.update(dict.fromkeys(_DECODE_SIDE_FIELDS))
    return answer


def _text(text: str, status: int) -> Response:
    return PlainTextResponse(text, status_code=status)


def _json(content: object, status: int = 200) -> Response:
    # json.dumps' default separators, as aiohttp's json_response writes them
    return Response(json.dumps(content), status_code=status, media_type=_JSON)


def _not_ready(info: SglangParallelInfo | None) -> Response:
    registered = 0 if info is None else info.registered
    return _text(f"Prefill server not fully registered yet ({registered} workers registered).", 503)


class _SglangRoute(APIRoute):
    """Renders registry errors as the engine's plain-text answers, whatever app mounts it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                response: Response = await handler(request)
            except (BadEngineApiRequest, Conflict) as exc:
                return _text(str(exc), 400)
            except NotFound as exc:
                return _text(str(exc), 404)
            except RegistrationRefused as exc:
                return error_json(exc.status, str(exc))
            except TooManyNamespaces as exc:
                return error_json(429, str(exc))
            except RegistryUnavailable as exc:
                logger.warning("sglang bootstrap: store unavailable: %s", exc)
                return _text(f"Bootstrap registry unavailable: {exc}", 503)
            return response

        return guarded


_THREAD_PARSE_BYTES = 256 * 1024  # larger bodies are parsed off the event loop


def _parse_json(body: bytes) -> object:
    try:
        return json.loads(body)
    except ValueError as exc:
        raise BadEngineApiRequest("Invalid request body: not JSON") from exc
    except RecursionError as exc:
        raise BadEngineApiRequest("Invalid request body: JSON nested too deeply") from exc


async def _json_body(request: Request) -> object:
    body = await request.body()  # bounded by the hosting app (body_limit.BodyLimit)
    if len(body) > _THREAD_PARSE_BYTES:
        return await asyncio.to_thread(_parse_json, body)
    return _parse_json(body)


async def _claim(
    table: SglangRankTable, registration: RankRegistration, source: str | None
) -> RankClaim:
    dp, cp, tp, pp = registration.coords
    previous = await table.rank_address(dp, tp, pp, cp)
    address = registration.address
    return RankClaim(
        namespace=table.namespace,
        rank=f"dp_rank={dp} cp_rank={cp} tp_rank={tp} pp_rank={pp}",
        host=address.rank_ip,
        port=address.rank_port,
        previous=None if previous is None else (previous.rank_ip, previous.rank_port),
        source=source,
    )


async def _check_dp_rank(table: SglangRankTable, dp_rank: int) -> None:
    dp_size = await table.dp_size()
    if dp_size is not None and dp_rank >= dp_size:
        raise BadEngineApiRequest(
            f"Invalid register_dp_rank body: dp_rank={dp_rank} >= the prefill's dp_size={dp_size}"
        )


async def answer_route_query(table: SglangRankTable, query: RouteQuery) -> Response:
    """``GET /route``: parallel info (503 until complete) or one rank (404 when unknown)."""
    if query.info or query.form is QueryForm.V0_5_10:
        info = await table.parallel_info()
        if info is None or not info.complete:
            return _not_ready(info)
        if query.info:
            return _json(render_parallel_info(query.form, info, table.server_info_decode_fields))
    address = await table.rank_address(query.dp, query.tp, query.pp, query.cp)
    if address is None:
        return _text(
            f"Bootstrap info not found for dp_rank={query.dp} cp_rank={query.cp} "
            f"tp_rank={query.tp} pp_rank={query.pp}",
            404,
        )
    return _json({"rank_ip": address.rank_ip, "rank_port": address.rank_port})


def sglang_routes(
    resolve: Resolver[SglangRankTable], guard: RegistrationGuard | None = None
) -> APIRouter:
    """The SGLang bootstrap paths: plain (namespace ``"default"``) and ``/bootstrap/{namespace}``.

    ``resolve`` maps a namespace name to its table and raises ``NotFound`` for an unknown one
    (answered 404). Plain ``/health`` is left to the hosting app (``app.namespace_app``). With
    a ``guard`` every rank registration is checked first (``rank_checks``) and a
    ``register_dp_rank`` naming a DP rank beyond the registered ``dp_size`` is 400; without one
    (the bare protocol, for tests and benchmarks) nothing is.
    """

    handlers = _BootstrapHandlers(resolve, guard)
    router = APIRouter(route_class=_SglangRoute, tags=["engine bootstrap (SGLang)"])
    for prefix in ROUTE_PREFIXES:
        add = _adder(router, prefix)
        add("/route", handlers.put_route, "PUT", doc=_PUT_ROUTE_DOC, body=SGLANG_ROUTE_BODY)
        add("/route", handlers.get_route, "GET", doc=_GET_ROUTE_DOC)
        add("/route", _other_route, "POST", "DELETE", "PATCH", "OPTIONS")
        add(
            "/register_dp_rank",
            handlers.register_dp_rank,
            "POST",
            doc=_DP_RANK_DOC,
            body=_DP_RANK_BODY,
        )
        add("/query_dp_ranks", handlers.query_dp_ranks, "POST", doc=_ROOMS_DOC, body=_ROOMS_BODY)
    _adder(router, NAMESPACE_PREFIX)("/health", handlers.health, "GET", doc=_HEALTH_DOC)
    return router


class _BootstrapHandlers:
    """The SGLang bootstrap endpoints over the tables ``resolve`` finds, checked by ``guard``."""

    def __init__(self, resolve: Resolver[SglangRankTable], guard: RegistrationGuard | None) -> None:
        self._resolve = resolve
        self._guard = guard

    def table_of(self, request: Request) -> SglangRankTable:
        return self._resolve(namespace_of(request))

    async def put_route(self, request: Request) -> Response:
        table = self.table_of(request)
        registration = parse_route_payload(await _json_body(request))
        replace = False
        if self._guard is not None and registration is not None:
            authorization = request.headers.get("authorization", "")
            source = request.client.host if request.client else None
            claim = await _claim(table, registration, source)
            replace = await self._guard.admit(claim, authorization)
        await table.register_rank(registration, replace=replace)
        return _text("OK", 200)

    async def get_route(self, request: Request) -> Response:
        query = parse_route_query(request.query_params)
        return await answer_route_query(self.table_of(request), query)

    async def register_dp_rank(self, request: Request) -> Response:
        table = self.table_of(request)
        body = validate_body(DpRankRegistration, await _json_body(request), "register_dp_rank body")
        if self._guard is not None:
            await _check_dp_rank(table, body.dp_rank)
        await table.register_dp_rank(body.bootstrap_room, body.dp_rank)
        return _text("OK", 200)

    async def query_dp_ranks(self, request: Request) -> Response:
        table = self.table_of(request)
        data = await _json_body(request)
        check_room_count(data)
        body = validate_body(DpRankQuery, data, "query_dp_ranks body")
        return _json(await table.query_dp_ranks(body.bootstrap_rooms))

    async def health(self, request: Request) -> Response:
        self.table_of(request)  # 404 for an unknown namespace
        return _text("OK", 200)


async def _other_route() -> Response:
    # the engine's answer, its odd JSON content type included
    return Response("Method not allowed", 405, {"Allow": "GET, PUT"}, media_type=_JSON)


_PUT_ROUTE_DOC = responses(200, 400, 404, 409, 413, 429, 503, ok_text=True, engine_text=True)
_GET_ROUTE_DOC = responses(200, 400, 404, 429, 503, engine_text=True)
_DP_RANK_DOC = responses(200, 400, 404, 413, 429, 503, ok_text=True, engine_text=True)
_ROOMS_DOC = responses(200, 400, 404, 413, 429, 503, engine_text=True)
_HEALTH_DOC = responses(200, 404, 429, ok_text=True, engine_text=True)
_DP_RANK_BODY = json_body(DpRankRegistration)
_ROOMS_BODY = json_body(DpRankQuery)


def _adder(router: APIRouter, prefix: str) -> Callable[..., None]:
    """``add(path, endpoint, *methods, doc=statuses, body=...)``; undocumented routes (no
    ``doc``) stay out of the schema."""

    def add(
        path: str,
        endpoint: Callable[..., Any],
        *methods: str,
        doc: dict[int | str, dict[str, Any]] | None = None,
        body: dict[str, Any] | None = None,
    ) -> None:
        router.add_api_route(
            prefix + path,
            endpoint,
            methods=list(methods),
            include_in_schema=bool(doc),
            responses=doc,
            openapi_extra=openapi_extra(prefix + path, body),
        )

    return add
