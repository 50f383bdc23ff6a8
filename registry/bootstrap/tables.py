"""The bootstrap tables of every namespace over one store, made on first use."""

from __future__ import annotations

from registry.backends.base import RegistryStore
from registry.bootstrap.sglang import SglangBootstrap
from registry.bootstrap.vllm import VllmBootstrap
from registry.errors import NotFound, RegistryUnavailable
from registry.models import NAMESPACE_RE

__all__ = ["BootstrapTables"]


class BootstrapTables:
    """Resolves a namespace to its SGLang / vLLM table (``sglang_routes``' ``resolve``).

    The routes are built with the app, the store only exists while the app runs: ``bind`` it in
    the lifespan. Until then every lookup is ``RegistryUnavailable`` (answered 503).
    """

    def __init__(self) -> None:
        self._store: RegistryStore | None = None
        self._sglang: dict[str, SglangBootstrap] = {}
        self._vllm: dict[str, VllmBootstrap] = {}

    def bind(self, store: RegistryStore | None) -> None:
        self._store = store
        self._sglang.clear()
        self._vllm.clear()

    def sglang(self, namespace: str) -> SglangBootstrap:
        table = self._sglang.get(namespace)
        if table is None:
            table = self._sglang[namespace] = SglangBootstrap(self._bound(), self._valid(namespace))
        return table

    def vllm(self, namespace: str) -> VllmBootstrap:
        table = self._vllm.get(namespace)
        if table is None:
            table = self._vllm[namespace] = VllmBootstrap(self._bound(), self._valid(namespace))
        return table

    def _bound(self) -> RegistryStore:
        if self._store is None:
            raise RegistryUnavailable("the registry is not running")
        return self._store

    @staticmethod
    def _valid(namespace: str) -> str:
        if not NAMESPACE_RE.fullmatch(namespace):
            raise NotFound(f"Unknown bootstrap namespace: {namespace!r}")
        return namespace
