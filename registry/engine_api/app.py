"""The apps a bootstrap listener serves, and the protection every one of them enforces.

Engines reach a bootstrap server by ``host:port`` only (vLLM's ``bootstrap_server_address``,
SGLang's ``bootstrap_port``) and call it without credentials, so the engine APIs are served only
on listeners of their own (never on a router's client-facing port), each protected by
``BootstrapProtection``: a source allow-list (403 before the body is read,
``source_allow.SourceAllowList``), a body bound (413, ``body_limit.BodyLimit``) and registration
checks (``rank_checks.RegistrationGuard``).

* ``namespace_app``: one namespace on a port of its own: the engines' plain paths (``/route``,
  ``/register_dp_rank``, ``/query_dp_ranks``, ``/register``, ``/query``), the same under
  ``/bootstrap/{namespace}/...`` and ``GET /health``;
* ``shared_app``: namespace ``"default"`` on the plain paths and any namespace under
  ``/bootstrap/{namespace}/...`` (the router's ``--bootstrap-port``), at most
  ``max_namespaces`` of them (429 beyond, ``RankTables.capped``);
* ``protect``: the same protection for an app that serves other things too (the standalone
  registry: only its engine paths are guarded).

The store and the tables belong to the caller; the apps own nothing. Each documents its engine
paths in ``GET /openapi.json`` (behind the allow-list like everything on the listener).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from starlette.exceptions import HTTPException

from registry.engine_api.body_limit import BodyLimit
from registry.engine_api.http_errors import on_http_error
from registry.engine_api.namespaces import single_namespace
from registry.engine_api.rank_checks import OwnerHosts, RegistrationGuard
from registry.engine_api.rank_tables import RankTables
from registry.engine_api.sglang_http import sglang_routes
from registry.engine_api.sglang_table import SglangRankTable
from registry.engine_api.source_allow import Network, SourceAllowList
from registry.engine_api.vllm_http import vllm_routes
from registry.engine_api.vllm_table import VllmRankTable
from registry.settings import RegistrySettings

__all__ = [
    "BootstrapProtection",
    "include_engine_routes",
    "namespace_app",
    "protect",
    "shared_app",
]


@dataclass(frozen=True, slots=True)
class BootstrapProtection:
    """What every bootstrap listener enforces: sources allowed (empty: nobody), the largest
    request body, the registration checks, and how many namespaces engines may create."""

    allow: tuple[Network, ...]
    max_body_bytes: int
    guard: RegistrationGuard
    max_namespaces: int = RegistrySettings.model_fields["max_namespaces"].default

    @classmethod
    def from_settings(
        cls,
        settings: RegistrySettings,
        max_body_bytes: int,
        owner_hosts: OwnerHosts | None = None,
    ) -> BootstrapProtection:
        return cls(
            allow=tuple(settings.bootstrap_allow),
            max_body_bytes=max_body_bytes,
            guard=RegistrationGuard.from_settings(settings, owner_hosts),
            max_namespaces=settings.max_namespaces,
        )


def protect(
    app: FastAPI, protection: BootstrapProtection, applies_to: Callable[[str], bool]
) -> None:
    """Guard ``app``'s paths that ``applies_to`` accepts: allow-list outermost, then the bound."""
    app.add_middleware(BodyLimit, limit=protection.max_body_bytes, applies_to=applies_to)
    app.add_middleware(SourceAllowList, networks=protection.allow, applies_to=applies_to)


async def _health() -> PlainTextResponse:
    return PlainTextResponse("OK")


def _listener_app(title: str, protection: BootstrapProtection) -> FastAPI:
    app = FastAPI(title=title, docs_url=None, redoc_url=None)
    # SGLang decoders poll GET /health as their heartbeat on the prefill: "OK" as the engines
    app.add_api_route("/health", _health, methods=["GET"], include_in_schema=False)
    app.add_exception_handler(HTTPException, on_http_error)
    protect(app, protection, lambda path: True)
    return app


def namespace_app(
    sglang: SglangRankTable | None, vllm: VllmRankTable | None, protection: BootstrapProtection
) -> FastAPI:
    """A small app serving the engines' plain bootstrap paths for one namespace.

    Raises ``ValueError`` when given no table at all.
    """
    either: SglangRankTable | VllmRankTable | None = sglang or vllm
    if either is None:
        raise ValueError("namespace_app needs an SGLang or a vLLM bootstrap table")
    app = _listener_app(f"pd-router bootstrap namespace {either.namespace}", protection)
    if sglang is not None:
        app.include_router(sglang_routes(single_namespace(sglang), protection.guard))
    if vllm is not None:
        app.include_router(vllm_routes(single_namespace(vllm), protection.guard))
    return app


def shared_app(tables: RankTables, protection: BootstrapProtection) -> FastAPI:
    """Every namespace's engine APIs: ``"default"`` plain, the others under ``/bootstrap/``."""
    app = _listener_app("pd-router engine bootstrap", protection)
    include_engine_routes(app, tables, protection)
    return app


def include_engine_routes(
    app: FastAPI, tables: RankTables, protection: BootstrapProtection
) -> None:
    """Both protocols' routes over every namespace of ``tables``, capped and guarded."""
    cap = protection.max_namespaces
    app.include_router(sglang_routes(tables.capped(tables.sglang, cap), protection.guard))
    app.include_router(vllm_routes(tables.capped(tables.vllm, cap), protection.guard))
