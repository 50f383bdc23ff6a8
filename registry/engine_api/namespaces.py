"""Engine-API namespaces: the one place that knows what a namespace is and how it resolves.

A namespace is one prefill instance: its SGLang and vLLM rank tables. Names follow
``registry.models.NAMESPACE_PATTERN`` (they are path segments and store key parts). On the shared
port the engines' plain paths are namespace ``"default"`` and ``/bootstrap/{namespace}/...`` reaches
any other; a namespace port (``app.namespace_app``) serves one namespace on the plain paths.

The HTTP routes take a *resolver* (``Resolver[T]``): a callable mapping a namespace name to its
table that raises ``NotFound`` (answered 404) for a name it does not serve.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeAlias, TypeVar

from starlette.requests import Request

from registry.backends.base import RegistryStore
from registry.errors import NotFound, RegistryUnavailable
from registry.models import NAMESPACE_RE

__all__ = [
    "DEFAULT_NAMESPACE",
    "ENGINE_PATHS",
    "NAMESPACE_PREFIX",
    "ROUTE_PREFIXES",
    "NamespaceTables",
    "Resolver",
    "check_namespace",
    "is_engine_path",
    "namespace_of",
    "single_namespace",
    "unknown_namespace",
]

DEFAULT_NAMESPACE = "default"
NAMESPACE_PREFIX = "/bootstrap/{namespace}"
# Every engine path is served twice: plain (namespace "default") and under the namespace prefix.
ROUTE_PREFIXES = ("", NAMESPACE_PREFIX)
# the engines' plain paths (SGLang, vLLM); every /bootstrap/... path is an engine path too
ENGINE_PATHS = frozenset({"/route", "/register_dp_rank", "/query_dp_ranks", "/register", "/query"})

T = TypeVar("T")
Resolver: TypeAlias = Callable[[str], T]


class _Named(Protocol):
    @property
    def namespace(self) -> str: ...


N = TypeVar("N", bound=_Named)


def _valid(namespace: str) -> bool:
    return NAMESPACE_RE.fullmatch(namespace) is not None


def check_namespace(namespace: str) -> str:
    """``namespace`` unchanged when it is a valid name; raises ``ValueError`` otherwise.

    For constructors: an invalid name there is a programming or configuration error.
    """
    if not _valid(namespace):
        raise ValueError(f"invalid bootstrap namespace {namespace!r}: use [A-Za-z0-9_.-], max 128")
    return namespace


def is_engine_path(path: str) -> bool:
    """Whether ``path`` is one of the engine bootstrap APIs (plain or under a namespace)."""
    return path in ENGINE_PATHS or path.startswith("/bootstrap/")


def unknown_namespace(namespace: str) -> NotFound:
    """The error a resolver raises for a name it does not serve (answered 404)."""
    return NotFound(f"Unknown bootstrap namespace: {namespace!r}")


def namespace_of(request: Request) -> str:
    """The namespace a request addresses: its ``{namespace}`` path part, else the default."""
    name: str = request.path_params.get("namespace", DEFAULT_NAMESPACE)
    return name


def single_namespace(table: N) -> Resolver[N]:
    """A resolver serving one table, under ``"default"`` and under its own namespace name."""

    def resolve(name: str) -> N:
        if name in (DEFAULT_NAMESPACE, table.namespace):
            return table
        raise unknown_namespace(name)

    return resolve


class NamespaceTables(Generic[T]):
    """One kind of table for every namespace over one store, each made on first use.

    Calling it is a ``Resolver``: an invalid name is ``NotFound``; while no store is bound every
    lookup is ``RegistryUnavailable`` (answered 503). ``bind`` a store (or None) to start over.
    """

    def __init__(self, make: Callable[[RegistryStore, str], T]) -> None:
        self._make = make
        self._store: RegistryStore | None = None
        self._tables: dict[str, T] = {}

    def bind(self, store: RegistryStore | None) -> None:
        """Serve tables over ``store`` from now on (None: none); forgets the tables made so far."""
        self._store = store
        self._tables.clear()

    def holds(self, namespace: str) -> bool:
        """Whether a table for ``namespace`` was made (and not forgotten)."""
        return namespace in self._tables

    def names(self) -> set[str]:
        """The namespaces with a table."""
        return set(self._tables)

    def __call__(self, namespace: str) -> T:
        table = self._tables.get(namespace)
        if table is None:
            table = self._tables[namespace] = self._make(self._bound(), self._known(namespace))
        return table

    def _bound(self) -> RegistryStore:
        if self._store is None:
            raise RegistryUnavailable("the registry is not running")
        return self._store

    @staticmethod
    def _known(namespace: str) -> str:
        if not _valid(namespace):
            raise unknown_namespace(namespace)
        return namespace
