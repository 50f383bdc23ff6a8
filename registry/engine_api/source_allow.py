"""``SourceAllowList``: only connections from allowed source networks reach the bootstrap APIs.

Engines call the bootstrap APIs without credentials, so where they are served and to whom is the
protection: a connection whose peer address is outside every allowed network gets 403 (error
JSON) before anything reads its body. The first refusal of a source is a warning, repeats within
``_WARN_EVERY_S`` are debug lines (a scanner cannot flood the log).
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable, Sequence
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import Any

from registry.engine_api.http_errors import error_json

__all__ = ["Network", "SourceAllowList", "source_allowed"]

logger = logging.getLogger(__name__)

Network = IPv4Network | IPv6Network
ASGIApp = Callable[..., Any]

_WARN_EVERY_S = 60.0
_MAX_REMEMBERED = 1024  # sources whose last warning is remembered (then the memory starts over)


def _address(host: str) -> IPv4Address | IPv6Address | None:
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # ::ffff:10.0.0.1 on a dual-stack socket is 10.0.0.1
    return address


def source_allowed(host: str | None, networks: Sequence[Network]) -> bool:
    """Whether peer address ``host`` lies in one of ``networks`` (no address: never)."""
    address = None if host is None else _address(host)
    if address is None:
        return False
    return any(address.version == net.version and address in net for net in networks)


class SourceAllowList:
    """ASGI middleware: HTTP requests to paths ``applies_to`` accepts must come from
    ``networks``; others pass through untouched (lifespan, other paths)."""

    def __init__(
        self,
        app: ASGIApp,
        networks: Sequence[Network],
        applies_to: Callable[[str], bool] = lambda path: True,
    ) -> None:
        self._app = app
        self._networks = tuple(networks)
        self._applies_to = applies_to
        self._warned: dict[str, float] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self._applies_to(scope["path"]):
            client = scope.get("client")
            host = client[0] if client else None
            if not source_allowed(host, self._networks):
                self._log(host, scope["path"])
                message = f"source address {host} is not allowed on the engine bootstrap API"
                await error_json(403, message)(scope, receive, send)
                return
        await self._app(scope, receive, send)

    def _log(self, host: str | None, path: str) -> None:
        key, now = str(host), time.monotonic()
        last = self._warned.get(key)
        if last is not None and now - last < _WARN_EVERY_S:
            logger.debug("bootstrap API: refused %s from %s (not allowed)", path, host)
            return
        if len(self._warned) >= _MAX_REMEMBERED:
            self._warned.clear()
        self._warned[key] = now
        allowed = ", ".join(str(net) for net in self._networks) or "none"
        logger.warning(
            "bootstrap API: refused %s from %s: outside the allowed sources (%s; "
            "--bootstrap-allow); repeats within %.0f s are logged at debug level",
            path,
            host,
            allowed,
            _WARN_EVERY_S,
        )
