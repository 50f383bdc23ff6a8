"""Admin REST API under ``/admin``: list, add, remove and drain workers; the prefill layout.

Mountable in the router (with a live view of health, load and layout) or in the standalone
registry. Auth: ``Authorization: Bearer <admin_token>`` when a token is configured; without one,
only loopback clients may call it.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Callable
from typing import Any, Literal

import msgspec
from fastapi import APIRouter, Depends, HTTPException, Request, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from registry.errors import NotFound
from registry.models import NAMESPACE_PATTERN, WorkerRecord
from registry.service import RegistryService
from registry.settings import RegistrySettings

__all__ = ["LiveView", "NewWorker", "admin_routes", "authorizer"]

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

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")) or len(value) <= len("https://"):
            raise ValueError("must be an http(s):// URL of the worker")
        return value.rstrip("/")


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
    live = view(record.id) if view is not None else None
    info["live"] = live  # None: this process does not route to it (standalone registry)
    return info


def admin_routes(
    settings: RegistrySettings,
    service_of: Callable[[Request], RegistryService],
    view_of: Callable[[Request], LiveView | None],
) -> APIRouter:
    """The ``/admin`` routes. ``service_of`` / ``view_of`` read the mounting app's lifespan
    context: the registry service, and (in a router) its live view of each worker."""
    router = APIRouter(prefix="/admin", dependencies=[Depends(authorizer(settings))])
    # Depends() as defaults: these names are local, so string annotations could not resolve them.
    service_dep, view_dep = Depends(service_of), Depends(view_of)

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

    @router.post("/workers", status_code=201)
    async def add_worker(
        body: NewWorker, service: RegistryService = service_dep, view: LiveView | None = view_dep
    ) -> dict[str, Any]:
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
        )
        return _describe(record, view)

    @router.delete("/workers/{worker_id}", status_code=204)
    async def remove_worker(
        record: WorkerRecord = record_dep, service: RegistryService = service_dep
    ) -> Response:
        try:
            await service.remove_worker(record.id)
        except NotFound as exc:
            raise HTTPException(404, str(exc)) from exc
        return Response(status_code=204)

    @router.post("/workers/{worker_id}/drain", status_code=202)
    async def drain_worker(
        record: WorkerRecord = record_dep,
        service: RegistryService = service_dep,
        view: LiveView | None = view_dep,
    ) -> dict[str, Any]:
        return _describe(await service.drain(record.id), view)

    @router.post("/workers/{worker_id}/heartbeat")
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

    return router


def _layout_of(record: WorkerRecord, view: LiveView | None) -> dict[str, Any]:
    live = (view(record.id) if view is not None else None) or {}
    return {
        "id": record.id,
        "url": record.url,
        "bootstrap_port": record.bootstrap_port,
        "epoch": record.epoch,
        "dp_size": live.get("dp_size"),
        "ranks": live.get("ranks", []),
    }
