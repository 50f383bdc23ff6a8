"""The engines' own bootstrap APIs, answered by the registry from its store.

* ``sglang``: SGLang's ``/route``, ``/register_dp_rank``, ``/query_dp_ranks`` (0.4.x to 0.5.23);
* ``vllm``: vLLM Mooncake's ``/register`` and ``/query`` (>= 0.32 semantics);
* ``app``: ``namespace_app``, one namespace on a port of its own.

A namespace is one prefill instance. On the shared port the plain paths are namespace
``"default"`` and ``/bootstrap/{namespace}/...`` reaches any other.
"""

from __future__ import annotations

from registry.bootstrap.app import namespace_app
from registry.bootstrap.sglang import (
    DEFAULT_NAMESPACE,
    BadBootstrapRequest,
    QueryForm,
    RankAddress,
    SglangBootstrap,
    SglangParallelInfo,
    sglang_routes,
)
from registry.bootstrap.vllm import (
    EngineEntry,
    RegisterWorkerPayload,
    VllmBootstrap,
    VllmLayout,
    vllm_routes,
)

__all__ = [
    "DEFAULT_NAMESPACE",
    "BadBootstrapRequest",
    "EngineEntry",
    "QueryForm",
    "RankAddress",
    "RegisterWorkerPayload",
    "SglangBootstrap",
    "SglangParallelInfo",
    "VllmBootstrap",
    "VllmLayout",
    "namespace_app",
    "sglang_routes",
    "vllm_routes",
]
