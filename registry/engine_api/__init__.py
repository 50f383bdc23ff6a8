"""The engines' bootstrap APIs, answered by the registry from per-namespace rank tables.

Engines call these HTTP APIs to publish and look up prefill ranks:

* SGLang's ``/route``, ``/register_dp_rank``, ``/query_dp_ranks`` (0.4.x to 0.5.23):
  ``sglang_payloads`` (the payloads of every version), ``sglang_table`` (``SglangRankTable``),
  ``sglang_http`` (``sglang_routes``);
* vLLM Mooncake's ``/register`` and ``/query`` (>= 0.32 semantics): ``vllm_payloads``,
  ``vllm_table`` (``VllmRankTable``), ``vllm_http`` (``vllm_routes``);
* ``layout_changes`` (``LayoutChanges``): which namespaces' rank layouts changed, from a watch;
* ``namespaces``: what a namespace is and how a name resolves to a table; ``rank_tables``
  (``RankTables``): both tables of every namespace over one store;
* ``app``: the listener apps (``namespace_app``: one namespace on a port of its own;
  ``shared_app``: every namespace) and ``BootstrapProtection``, what every listener enforces:
  ``source_allow`` (403 for sources outside ``--bootstrap-allow``), ``body_limit`` (413) and
  ``rank_checks`` (``RegistrationGuard``: reachable, consistent, not moved); ``http_errors``
  renders those refusals as error JSON, ``openapi_doc`` documents what each route answers.

A namespace is one prefill instance. On the shared port the plain paths are namespace
``"default"`` and ``/bootstrap/{namespace}/...`` reaches any other. Engines call these APIs
without credentials: they are served only on bootstrap listeners, never on a router's
client-facing port.
"""

from __future__ import annotations

from registry.engine_api.app import (
    BootstrapProtection,
    include_engine_routes,
    namespace_app,
    protect,
    shared_app,
)
from registry.engine_api.layout_changes import LayoutChanges, LayoutMark
from registry.engine_api.namespaces import DEFAULT_NAMESPACE, is_engine_path
from registry.engine_api.rank_checks import (
    OwnerHosts,
    RankClaim,
    RegistrationGuard,
    RegistrationRefused,
)
from registry.engine_api.rank_tables import RankTables
from registry.engine_api.sglang_http import sglang_routes
from registry.engine_api.sglang_payloads import QueryForm, RankAddress
from registry.engine_api.sglang_table import SglangParallelInfo, SglangRankTable
from registry.engine_api.vllm_http import vllm_routes
from registry.engine_api.vllm_payloads import EngineEntry, RegisterWorkerPayload
from registry.engine_api.vllm_table import VllmRankSnapshot, VllmRankTable
from registry.errors import BadEngineApiRequest

__all__ = [
    "DEFAULT_NAMESPACE",
    "BadEngineApiRequest",
    "BootstrapProtection",
    "EngineEntry",
    "LayoutChanges",
    "LayoutMark",
    "OwnerHosts",
    "QueryForm",
    "RankAddress",
    "RankClaim",
    "RankTables",
    "RegisterWorkerPayload",
    "RegistrationGuard",
    "RegistrationRefused",
    "SglangParallelInfo",
    "SglangRankTable",
    "VllmRankSnapshot",
    "VllmRankTable",
    "include_engine_routes",
    "is_engine_path",
    "namespace_app",
    "protect",
    "shared_app",
    "sglang_routes",
    "vllm_routes",
]
