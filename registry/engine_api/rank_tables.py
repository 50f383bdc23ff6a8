"""``RankTables``: every namespace's SGLang and vLLM rank tables over one store.

Engines create namespaces by naming them (``/bootstrap/{namespace}/...``), so the routes resolve
through ``capped``: a namespace beyond ``max_namespaces`` (counting both protocols' tables held
in this process) is ``TooManyNamespaces`` (answered 429); those already held keep working.
"""

from __future__ import annotations

from typing import TypeVar

from registry.backends.base import RegistryStore
from registry.engine_api.namespaces import NamespaceTables, Resolver
from registry.engine_api.sglang_table import SglangRankTable
from registry.engine_api.vllm_table import VllmRankTable
from registry.errors import TooManyNamespaces

__all__ = ["RankTables"]


T = TypeVar("T")


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

    def holds(self, namespace: str) -> bool:
        """Whether this process made a table for ``namespace`` (either protocol)."""
        return self._sglang.holds(namespace) or self._vllm.holds(namespace)

    def count(self) -> int:
        """How many namespaces this process holds tables for."""
        return len(self._sglang.names() | self._vllm.names())

    def capped(self, resolve: Resolver[T], max_namespaces: int) -> Resolver[T]:
        """``resolve`` (``self.sglang`` or ``self.vllm``), refusing a namespace beyond
        ``max_namespaces`` with ``TooManyNamespaces``."""

        def within(namespace: str) -> T:
            if not self.holds(namespace) and self.count() >= max_namespaces:
                raise TooManyNamespaces(
                    f"too many bootstrap namespaces: this registry holds {max_namespaces} "
                    f"(--max-bootstrap-namespaces); namespace {namespace!r} is refused"
                )
            return resolve(namespace)

        return within
