"""``namespace_app``: one namespace's engine APIs on a port of its own.

Engines reach a bootstrap server by ``host:port`` only (vLLM's ``bootstrap_server_address``,
SGLang's ``bootstrap_port``), so every prefill instance beyond the ``"default"`` namespace of
the shared port gets an extra port serving this app: the engines' plain paths (``/route``,
``/register_dp_rank``, ``/query_dp_ranks``, ``/register``, ``/query``) and ``GET /health``,
all for its one namespace. The store and the tables belong to the caller; the app owns nothing.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from registry.engine_api.namespaces import single_namespace
from registry.engine_api.sglang_http import sglang_routes
from registry.engine_api.sglang_table import SglangRankTable
from registry.engine_api.vllm_http import vllm_routes
from registry.engine_api.vllm_table import VllmRankTable

__all__ = ["namespace_app"]


async def _health() -> PlainTextResponse:
    return PlainTextResponse("OK")


def namespace_app(sglang: SglangRankTable | None, vllm: VllmRankTable | None) -> FastAPI:
    """A small app serving the engines' plain bootstrap paths for one namespace.

    Raises ``ValueError`` when given no table at all. SGLang decoders poll ``GET /health`` as
    their heartbeat on the prefill; it answers ``"OK"`` as the engines do.
    """
    if sglang is None and vllm is None:
        raise ValueError("namespace_app needs an SGLang or a vLLM bootstrap table")
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.add_api_route("/health", _health, methods=["GET"], include_in_schema=False)
    if sglang is not None:
        app.include_router(sglang_routes(single_namespace(sglang)))
    if vllm is not None:
        app.include_router(vllm_routes(single_namespace(vllm)))
    return app
