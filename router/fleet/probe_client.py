"""The fleet's GETs to its workers (health probes, engine load and ``/metrics`` reads,
``/v1/models``) on the lean client's keep-alive connections (``router.upstream.lean_client``).

One small pool per worker, apart from the request path's, so that a probe neither waits behind
nor takes a connection from the traffic. A GET costs ~50 µs of the router's CPU against ~500 µs
through httpx, which these reads used before (``docs/performance.md``, "Background CPU"); a
4P2D fleet's probes and load reads are ~20 GETs a second per router at the default intervals.

Every read is bounded: ``timeout_s`` for the whole exchange (connect, head, body), and
``max_answer_bytes`` for the body (an engine's ``/metrics`` is tens of KiB; beyond the bound the
read fails and the connection is closed). A worker URL's ``user:password@`` goes out as HTTP
Basic authorization, as httpx sent it before.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from router.settings import UpstreamSettings
from router.upstream.base import transport_error
from router.upstream.lean_client import LeanUpstream
from router.workers import Worker

__all__ = ["MAX_PROBE_ANSWER_BYTES", "ProbeAnswer", "ProbeClient"]

MAX_PROBE_ANSWER_BYTES = 8 * 1024 * 1024  # a /metrics page of a large DP engine fits
_CONNECTIONS = 4  # per worker: a health probe, a load read, a /metrics read, a models read
_KEEPALIVE_S = 4.0  # below uvicorn's 5 s default: the router closes an idle one first


@dataclass(slots=True, frozen=True)
class ProbeAnswer:
    """A worker's whole answer to a GET."""

    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class ProbeClient:
    """GETs to the fleet's workers; ``prune`` the pools of workers that left."""

    def __init__(self, timeout_s: float, *, max_answer_bytes: int = MAX_PROBE_ANSWER_BYTES) -> None:
        self._timeout_s = timeout_s
        self._settings = UpstreamSettings(
            connect_timeout_s=timeout_s,
            read_timeout_s=timeout_s,
            max_connections=_CONNECTIONS,
            max_keepalive=_CONNECTIONS,
            keepalive_s=_KEEPALIVE_S,
            max_answer_bytes=max_answer_bytes,
            max_error_answer_bytes=max_answer_bytes,
        )
        # (worker id, base URL) -> its pool and the headers every GET carries
        self._pools: dict[tuple[str, str], tuple[LeanUpstream, dict[str, str]]] = {}

    async def get(
        self,
        worker: Worker,
        path: str,
        headers: dict[str, str] | None = None,
        *,
        base_url: str = "",
    ) -> ProbeAnswer:
        """GET ``path`` (with its query) of ``worker`` (``base_url``: of another server of its,
        its bootstrap server); its status and body. Raises UpstreamError: a transport failure
        (a refused connection has ConnectionRefusedError among its causes), no whole answer
        within ``timeout_s``, a body over the bound."""
        pool, fixed = self._pool(worker, base_url)
        sent = fixed if not headers else {**fixed, **headers}
        try:
            async with asyncio.timeout(self._timeout_s):
                answer = await pool.open(path, b"", sent, whole=True, method=b"GET")
                try:
                    body = await answer.read()
                finally:
                    await answer.aclose()
        except TimeoutError as exc:
            raise transport_error(exc, worker, connect_failed=False, timed_out=True) from exc
        return ProbeAnswer(answer.status, body)

    async def prune(self, kept: Iterable[str]) -> None:
        """Close the connections of the workers not in ``kept`` (worker ids)."""
        ids = set(kept)
        gone = [self._pools.pop(key)[0] for key in list(self._pools) if key[0] not in ids]
        await asyncio.gather(*(pool.aclose() for pool in gone))

    async def aclose(self) -> None:
        pools, self._pools = self._pools, {}
        await asyncio.gather(*(pool.aclose() for pool, _ in pools.values()))

    def _pool(self, worker: Worker, base_url: str) -> tuple[LeanUpstream, dict[str, str]]:
        key = (worker.id, base_url)
        found = self._pools.get(key)
        if found is None:
            found = self._pools[key] = (
                LeanUpstream(worker, self._settings, base_url),
                _basic_authorization(base_url or worker.url),
            )
        return found


def _basic_authorization(url: str) -> dict[str, str]:
    """HTTP Basic authorization for a URL's ``user:password@`` (none without one)."""
    parts = urlsplit(url)
    if parts.username is None:
        return {}
    secret = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
    return {"authorization": "Basic " + base64.b64encode(secret.encode()).decode("ascii")}
