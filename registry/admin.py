"""Admin REST API under ``/admin``: list, add, remove and drain workers; the prefill layout.

Mountable in the router (with a live view of health, load and layout) or in the standalone
registry. Auth: ``Authorization: Bearer <admin_token>`` when a token is configured; without one,
only loopback clients may call it. Auth runs before a body is read, and a body is read only up to
``max_body_bytes`` (413 beyond). A worker added here must have a valid http(s) URL whose host is
not a link-local or unspecified address (400 naming why). Worker URLs are shown without their
credentials. A store failure answers 503 (NotFound 404, Conflict 409), rendered as error JSON by
the mounting app's HTTPException handler.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
from fastapi import APIRouter, Depends, HTTPException, Request, Response
from fastapi.routing import APIRoute
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
)
from starlette.requests import ClientDisconnect

from registry.error_schema import error_doc
from registry.errors import Conflict, NotFound, RegistryError
from registry.models import (
    NAMESPACE_PATTERN,
    WorkerRecord,
    admin_address_problem,
    check_worker_url,
    redact_url,
)
from registry.service import RegistryService
from registry.settings import RegistrySettings

__all__ = [
    "ADMIN_RESPONSES",
    "DEFAULT_MAX_BODY_BYTES",
    "LiveView",
    "NewWorker",
    "admin_routes",
    "authorizer",
    "read_bounded_body",
]

# the standalone registry's bound (the router passes its --max-body-bytes): the router's default
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024

# tcp://host:port (host: a name, an IPv4 address or a bracketed IPv6 literal)
_TCP_ENDPOINT = r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):[0-9]{1,5}$"

# worker id -> what this process knows live about it (health, in-flight, layout), or None
LiveView = Callable[[str], dict[str, Any] | None]


class NewWorker(BaseModel):
    """Body of ``POST /admin/workers``."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["prefill", "decode"]
    url: str
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    bootstrap_namespace: str | None = Field(default=None, pattern=NAMESPACE_PATTERN)
    engine: Literal["vllm-mooncake", "vllm-nixl", "sglang"] | None = None
    # set by a worker registering itself: the entry expires unless heartbeated within lease_s
    lease_s: float | None = Field(default=None, ge=1, le=3600)
    # a prefill's KV cache event stream and its replay endpoint (DP rank 0; rank r: port + r)
    kv_events: str | None = Field(default=None, pattern=_TCP_ENDPOINT)
    kv_events_replay: str | None = Field(default=None, pattern=_TCP_ENDPOINT)
    # the model names it serves (at most 64, 1-256 characters each); none: the router reads
    # its /v1/models
    models: tuple[Annotated[str, StringConstraints(min_length=1, max_length=256)], ...] = Field(
        default=(), max_length=64
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        url = check_worker_url(value)
        problem = admin_address_problem(url)
        if problem is not None:
            raise ValueError(f"refused worker URL {redact_url(url)!r}: {problem}")
        return url


_NEW_WORKER_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": NewWorker.model_json_schema()}},
    }
}

# every /admin route (and the standalone registry's /store): auth, and a failing store
ADMIN_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: error_doc("Missing or wrong admin bearer token (a token is configured)"),
    403: error_doc("Not a loopback client, and no admin token is configured"),
    503: error_doc("The registry store is unavailable"),
}
_BODY_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: error_doc("Invalid body"),
    413: error_doc("Body over the size limit"),
}
_UNKNOWN_WORKER: dict[int | str, dict[str, Any]] = {404: error_doc("No such worker")}


async def read_bounded_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it (or its Content-Length) passes
    ``limit`` bytes: a client cannot make this process buffer more.

    A client gone before the end of its body (it closed the connection, or the server's body read
    timeout answered 408 and closed it) ends the request with a 400 that nobody reads, rendered
    like any other refusal, instead of a ``ClientDisconnect`` traceback in the server's log."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"request body of {declared} bytes exceeds the {limit}-byte limit")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise HTTPException(413, f"request body exceeds the {limit}-byte limit")
    except ClientDisconnect as exc:
        raise HTTPException(400, "the client disconnected before the end of its body") from exc
    return bytes(body)


def _new_worker(raw: bytes) -> NewWorker:
    try:
        return NewWorker.model_validate_json(raw)
    except ValidationError as exc:
        reasons = "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or 'body'}: {error['msg']}"
            for error in exc.errors(include_url=False)
        )
        raise HTTPException(400, f"invalid request: {reasons}") from exc


class _AdminRoute(APIRoute):
    """Registry errors leave the admin API as HTTP errors (JSON), never as a 500 traceback."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except NotFound as exc:
                raise HTTPException(404, str(exc)) from exc
            except Conflict as exc:
                raise HTTPException(409, str(exc)) from exc
            except RegistryError as exc:  # RegistryUnavailable, a misconfigured store
                raise HTTPException(503, f"registry store unavailable: {exc}") from exc

        return guarded


def _is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def authorizer(settings: RegistrySettings) -> Callable[[Request], None]:
    """The admin API's auth, as a dependency (also guards the standalone registry's /store)."""

    def authorize(request: Request) -> None:
        token = settings.admin_token
        if token is None:
            if not _is_loopback(request.client.host if request.client else None):
                raise HTTPException(
                    403,
                    "the admin API only accepts loopback clients when no admin token is configured",
                )
            return
        given = request.headers.get("authorization", "")
        expected = f"Bearer {token.get_secret_value()}"
        if not secrets.compare_digest(given.encode(), expected.encode()):
            raise HTTPException(401, "missing or wrong admin bearer token")

    return authorize


def _describe(record: WorkerRecord, view: LiveView | None) -> dict[str, Any]:
    info: dict[str, Any] = msgspec.to_builtins(record)
    info["url"] = redact_url(record.url)
    live = view(record.id) if view is not None else None
    info["live"] = live  # None: this process does not route to it (standalone registry)
    return info


def admin_routes(
    settings: RegistrySettings,
    service_of: Callable[[Request], RegistryService],
    view_of: Callable[[Request], LiveView | None],
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> APIRouter:
    """The ``/admin`` routes. ``service_of`` / ``view_of`` read the mounting app's lifespan
    context: the registry service, and (in a router) its live view of each worker.

    Auth is a router-level dependency and no route declares a body parameter, so FastAPI runs
    auth before anything reads the body; bodies are then read with ``read_bounded_body``."""
    router = APIRouter(
        prefix="/admin",
        dependencies=[Depends(authorizer(settings))],
        route_class=_AdminRoute,
        responses=ADMIN_RESPONSES,
    )
    deps = _Deps(Depends(service_of), Depends(view_of))
    _worker_routes(router, deps, max_body_bytes)
    _lease_and_layout_routes(router, deps)
    return router


class _Deps(NamedTuple):
    """The admin routes' dependencies (``Depends`` objects used as parameter defaults: the
    routes are local functions, so string annotations could not resolve them)."""

    service: Any
    view: Any


def _worker_routes(router: APIRouter, deps: _Deps, max_body_bytes: int) -> None:
    """List, add, remove and drain workers."""
    service_dep, view_dep = deps

    async def get_record(worker_id: str, service: RegistryService = service_dep) -> WorkerRecord:
        record = await service.get_worker(worker_id)
        if record is None:
            raise HTTPException(404, f"no worker with id {worker_id!r}")
        return record

    record_dep = Depends(get_record)

    @router.get("/workers")
    async def list_workers(
        service: RegistryService = service_dep, view: LiveView | None = view_dep
    ) -> dict[str, Any]:
        return {"workers": [_describe(r, view) for r in await service.list_workers()]}

    @router.post(
        "/workers", status_code=201, openapi_extra=_NEW_WORKER_BODY, responses=_BODY_RESPONSES
    )
    async def add_worker(
        request: Request, service: RegistryService = service_dep, view: LiveView | None = view_dep
    ) -> dict[str, Any]:
        """Add (or re-register) a worker; the body is a ``NewWorker``."""
        body = _new_worker(await read_bounded_body(request, max_body_bytes))
        record = await service.add_worker(
            body.role,
            body.url,
            bootstrap_port=body.bootstrap_port,
            bootstrap_namespace=body.bootstrap_namespace,
            engine=body.engine,
            source="admin" if body.lease_s is None else "engine",
            ttl=body.lease_s,
            kv_events=body.kv_events,
            kv_events_replay=body.kv_events_replay,
            models=body.models,
        )
        return _describe(record, view)

    @router.delete("/workers/{worker_id}", status_code=204, responses=_UNKNOWN_WORKER)
    async def remove_worker(
        record: WorkerRecord = record_dep, service: RegistryService = service_dep
    ) -> Response:
        await service.remove_worker(record.id)  # NotFound (removed meanwhile): 404
        return Response(status_code=204)

    @router.post("/workers/{worker_id}/drain", status_code=202, responses=_UNKNOWN_WORKER)
    async def drain_worker(
        record: WorkerRecord = record_dep,
        service: RegistryService = service_dep,
        view: LiveView | None = view_dep,
    ) -> dict[str, Any]:
        return _describe(await service.drain(record.id), view)


def _lease_and_layout_routes(router: APIRouter, deps: _Deps) -> None:
    """A self-registered worker's heartbeat, and the prefills' DP layouts."""
    service_dep, view_dep = deps

    @router.post("/workers/{worker_id}/heartbeat", responses=_UNKNOWN_WORKER)
    async def heartbeat(worker_id: str, service: RegistryService = service_dep) -> dict[str, Any]:
        """Renew a self-registered worker's lease; 404 once it expired (register again)."""
        if not await service.heartbeat(worker_id):
            raise HTTPException(404, f"no live lease for worker {worker_id!r}")
        return {"id": worker_id, "alive": True}

    @router.get("/layout")
    async def layout(
        service: RegistryService = service_dep, view: LiveView | None = view_dep
    ) -> dict[str, Any]:
        prefills = [r for r in await service.list_workers() if r.role == "prefill"]
        return {"prefill": [_layout_of(r, view) for r in prefills]}


def _layout_of(record: WorkerRecord, view: LiveView | None) -> dict[str, Any]:
    live = (view(record.id) if view is not None else None) or {}
    return {
        "id": record.id,
        "url": redact_url(record.url),
        "bootstrap_port": record.bootstrap_port,
        "epoch": record.epoch,
        "dp_size": live.get("dp_size"),
        "ranks": live.get("ranks", []),
    }
