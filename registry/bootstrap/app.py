"""``namespace_app``: one namespace's bootstrap paths on a port of its own.

Engines reach a bootstrap server by ``host:port`` only (vLLM's ``bootstrap_server_address``,
SGLang's ``bootstrap_port``), so every prefill instance beyond the ``"default"`` namespace of
the shared port gets an extra port serving this app: the engines' plain paths (``/route``,
``/register_dp_rank``, ``/query_dp_ranks``, ``/register``, ``/query``) and ``GET /health``,
all for its one namespace. The store and the tables belong to the caller; the app owns nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from registry.bootstrap.sglang import DEFAULT_NAMESPACE, SglangBootstrap, sglang_routes
from registry.bootstrap.vllm import VllmBootstrap, vllm_routes
from registry.errors import NotFound

__all__ = ["namespace_app"]


class _Named(Protocol):
    @property
    def namespace(self) -> str: ...


N = TypeVar("N", bound=_Named)


def _only(table: N) -> Callable[[str], N]:
    """A resolver serving one table, under ``"default"`` and under its own namespace name."""

    def resolve(name: str) -> N:
        if name in (DEFAULT_NAMESPACE, table.namespace):
            return table
        raise NotFound(f"Unknown bootstrap namespace: {name!r}")

    return resolve


async def _health() -> PlainTextResponse:
    return PlainTextResponse("OK")


def namespace_app(sglang: SglangBootstrap | None, vllm: VllmBootstrap | None) -> FastAPI:
    """A small app serving the engines' plain bootstrap paths for one namespace.

    Raises ``ValueError`` when given no table at all. SGLang decoders poll ``GET /health`` as
    their heartbeat on the prefill; it answers ``"OK"`` as the engines do.
    """
    if sglang is None and vllm is None:
        raise ValueError("namespace_app needs an SGLang or a vLLM bootstrap table")
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.add_api_route("/health", _health, methods=["GET"], include_in_schema=False)
    if sglang is not None:
        app.include_router(sglang_routes(_only(sglang)))
    if vllm is not None:
        app.include_router(vllm_routes(_only(vllm)))
    return app
