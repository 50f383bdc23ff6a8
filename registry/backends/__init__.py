"""Store backends, chosen by URL scheme: ``open_store("memory://")``, ``open_store("etcd://h:2379")``.

| URL | store |
|---|---|
| ``memory://`` | ``MemoryStore``: in this process only (tests, a single router) |
| ``etcd://host[:port][/prefix]`` | ``EtcdStore`` (aetcd); port 2379, prefix ``/pdr`` by default |
| ``http(s)://host:port[/path]`` | ``HttpStore``: the store of a ``registry serve`` process |

``open_store`` does no I/O (etcd and http stores connect on their first call). It raises
``ConfigurationError`` for an unknown scheme, a malformed URL, or a missing optional dependency.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from urllib.parse import urlsplit

from registry.backends.base import RegistryStore, WatchEvent
from registry.backends.etcd import EtcdStore
from registry.backends.http import HttpStore, parse_http_url
from registry.backends.memory import MemoryStore
from registry.errors import ConfigurationError

__all__ = ["EtcdStore", "HttpStore", "MemoryStore", "RegistryStore", "WatchEvent", "open_store"]

SUPPORTED_URLS = "memory://, etcd://host[:port][/prefix], http(s)://host:port"


def _open_memory(url: str) -> MemoryStore:
    parts = urlsplit(url)
    if parts.netloc or parts.path or parts.query or parts.fragment:
        raise ConfigurationError("memory:// takes no host, path or options")
    return MemoryStore()


_OPENERS: Mapping[str, Callable[[str], RegistryStore]] = MappingProxyType(
    {
        "memory": _open_memory,
        "etcd": EtcdStore.from_url,
        "http": HttpStore.from_url,
        "https": HttpStore.from_url,
    }
)


def open_store(url: str, *, token: str | None = None) -> RegistryStore:
    """A new, unconnected store for ``url``; raises ``ConfigurationError`` (see the module doc).
    ``token``: the bearer token of an http(s) store (``registry serve --admin-token``)."""
    scheme = urlsplit(url).scheme if "://" in url else ""
    if token is not None and scheme in ("http", "https"):
        return HttpStore(parse_http_url(url), token=token)
    opener = _OPENERS.get(scheme)
    if opener is None:
        # Name only the scheme: the rest of a store URL could hold something secret.
        raise ConfigurationError(
            f"unsupported registry store URL scheme {scheme!r}; expected one of {SUPPORTED_URLS}"
        )
    return opener(url)
