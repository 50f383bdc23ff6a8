"""``RankTables``: every namespace's SGLang and vLLM rank tables over one store."""

from __future__ import annotations

from registry.backends.base import RegistryStore
from registry.engine_api.namespaces import NamespaceTables
from registry.engine_api.sglang_table import SglangRankTable
from registry.engine_api.vllm_table import VllmRankTable

__all__ = ["RankTables"]


class RankTables:
    """Resolves a namespace to its SGLang / vLLM rank table (the routes' ``resolve``).

    The routes are built with the app, the store only exists while the app runs: ``bind`` it in
    the lifespan. Until then every lookup is ``RegistryUnavailable`` (answered 503); an invalid
    namespace name is ``NotFound`` (404).
    """

    def __init__(self) -> None:
        self._sglang = NamespaceTables(SglangRankTable)
        self._vllm = NamespaceTables(VllmRankTable)

    def bind(self, store: RegistryStore | None) -> None:
        """Serve tables over ``store`` from now on (None: none); forgets the tables made so far."""
        self._sglang.bind(store)
        self._vllm.bind(store)

    def sglang(self, namespace: str) -> SglangRankTable:
        """The namespace's SGLang table, made on first use."""
        return self._sglang(namespace)

    def vllm(self, namespace: str) -> VllmRankTable:
        """The namespace's vLLM table, made on first use."""
        return self._vllm(namespace)
