"""The transfer rendezvous client: prefill ranks publish their control address, decode ranks look
it up, through the registry's engine bootstrap APIs: SGLang's (docs/concepts/protocols.md 5.6) and
vLLM's (3.2).

Prefill ranks announce their control address with the SGLang 0.5.x ``PUT /route`` payload; decode
ranks read the prefill's parallel layout and a rank's address with the 0.5.10+ ``GET /route``
queries. A rank with an ``engine_id`` (a vLLM MooncakeConnector DP engine) announces itself with
vLLM's ``POST /register`` instead (``addr`` = ``tcp://host:port``, its control socket), and a
decode finds it by engine id in ``GET /query`` (``engine_address``).

The APIs are served by the standalone registry and by the router at its own port, at the
plain paths (namespace ``default``) or under ``/bootstrap/{namespace}``: ``bootstrap_url`` builds
the base URL of either (the engines' bootstrap API, named as they name it).

Decisions:

* Registration retries transport errors and 5xx answers with exponential backoff (SGLang makes
  5 attempts from 1 s); a 4xx answer (a refused layout) fails at once.
* Lookups retry "not ready yet" (503: not every rank registered) and transport errors until the
  caller's timeout, then fail with the last reason; other answers (404 unknown rank, 400) fail at
  once. Answers are cached per base URL until ``invalidate`` (a prefill rank that restarted at
  another address is found again after the caller invalidates). Concurrent lookups of one
  answer make one call (the rest wait for it, within their own timeouts), as an SGLang decode's
  scheduler, which looks a prefill up once, does: a burst of rooms to a new prefill is one
  lookup, not one per room.
* Every failure is a ``RendezvousError`` (a ``TransferError`` with ``op="bootstrap"``, the engine
  API it called; ``code`` holds the HTTP status when there was one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable
from typing import Final, TypeVar

import httpx
import msgspec

from transfer.closing import AsyncClosing
from transfer.control import Peer
from transfer.errors import TransferError
from transfer.rendezvous_payloads import PrefillInfo, PrefillRank, RankAnswer, bootstrap_url

__all__ = [
    "RendezvousClient",
    "RendezvousError",
    "PrefillInfo",
    "PrefillRank",
    "bootstrap_url",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

_INFO_QUERY: Final = {
    "prefill_dp_rank": "-1",
    "prefill_cp_rank": "-1",
    "target_tp_rank": "-1",
    "target_pp_rank": "-1",
}


class RendezvousError(TransferError):
    """Publishing or looking up a rank through the bootstrap API failed (``code``: HTTP status)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message, op="bootstrap", code=status)


class RendezvousClient(AsyncClosing):
    """Publishes prefill ranks and looks them up; one per process, safe for concurrent use.

    Pass an ``httpx.AsyncClient`` to share one (its timeouts apply), or let this build its own
    with ``timeout_s`` per HTTP call; an own client is closed by ``aclose`` / ``async with``.
    """

    def __init__(
        self,
        http: httpx.AsyncClient | None = None,
        *,
        timeout_s: float = 5.0,
        retry_interval_s: float = 0.05,
    ) -> None:
        self._owned = http is None
        self._http = http or httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s), limits=httpx.Limits(max_connections=32)
        )
        self._retry_interval = retry_interval_s
        self._infos: dict[str, PrefillInfo] = {}
        self._ranks: dict[tuple[str, int, int, int, int], Peer] = {}
        self._engines: dict[tuple[str, str, int, int], Peer] = {}
        self._lookups: dict[tuple[str, str, str], asyncio.Lock] = {}  # one call at a time each

    async def aclose(self) -> None:
        if self._owned:
            await self._http.aclose()

    async def register(
        self,
        base_url: str,
        rank: PrefillRank,
        address: Peer,
        *,
        attempts: int = 5,
        backoff_s: float = 0.5,
    ) -> None:
        """``PUT {base_url}/route`` (``POST /register`` for a vLLM rank) announcing ``rank``.

        Raises ``RendezvousError`` when refused (4xx) or still failing after ``attempts``.
        """
        if rank.engine_id is None:
            method, url, body = "PUT", f"{base_url}/route", rank.route_body(address)
        else:
            method, url, body = "POST", f"{base_url}/register", rank.register_body(address)
        reason = "no attempt made"
        for attempt in range(max(attempts, 1)):
            if attempt:
                await asyncio.sleep(min(backoff_s * 2 ** (attempt - 1), 30.0))
            try:
                response = await self._http.request(method, url, json=body)
            except httpx.HTTPError as exc:
                reason = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code == 200:
                    return
                reason = f"HTTP {response.status_code}: {response.text[:200]}"
                if response.status_code < 500:
                    raise RendezvousError(
                        f"bootstrap registration at {base_url} refused: {reason}",
                        status=response.status_code,
                    )
            logger.warning("bootstrap registration at %s failed (%s)", base_url, reason)
        raise RendezvousError(
            f"bootstrap registration at {base_url} failed after {attempts} attempts: {reason}"
        )

    async def prefill_info(self, base_url: str, *, timeout_s: float) -> PrefillInfo:
        """The prefill layout at ``base_url``, waiting up to ``timeout_s`` for it to be complete."""
        return await self._looked_up(
            self._infos, base_url, (base_url, "/route", _INFO_QUERY), timeout_s, "parallel info",
            lambda raw: _parse(raw, PrefillInfo, base_url),
        )  # fmt: skip

    async def rank_address(
        self, base_url: str, *, dp: int, tp: int, pp: int = 0, cp: int = 0, timeout_s: float
    ) -> Peer:
        """The control address of prefill rank (dp, cp, tp, pp) at ``base_url``."""
        query = {
            "prefill_dp_rank": str(dp),
            "prefill_cp_rank": str(cp),
            "target_tp_rank": str(tp),
            "target_pp_rank": str(pp),
        }

        def peer(raw: bytes) -> Peer:
            answer = _parse(raw, RankAnswer, base_url)
            return Peer(answer.rank_ip, answer.rank_port)

        what = f"rank dp={dp} cp={cp} tp={tp} pp={pp}"
        key = (base_url, dp, cp, tp, pp)
        return await self._looked_up(
            self._ranks, key, (base_url, "/route", query), timeout_s, what, peer
        )

    async def engine_address(
        self, base_url: str, engine_id: str, *, tp: int, pp: int = 0, timeout_s: float
    ) -> Peer:
        """The control address of ``engine_id``'s rank (tp, pp), from vLLM's ``GET /query``.

        An engine id missing from the table fails at once with vLLM's wording ("... not found
        from bootstrap server"), which routers take as a sign to re-read the prefill's layout.
        """

        def peer(raw: bytes) -> Peer:
            entry = _engine_entry(raw, engine_id, base_url)
            addr = entry.worker_addr.get(str(tp), {}).get(str(pp))
            if addr is None:
                raise RendezvousError(
                    f"engine {engine_id} at {base_url} lists no rank tp={tp} pp={pp}"
                )
            return _tcp_peer(addr, base_url)

        key = (base_url, engine_id, tp, pp)
        call: tuple[str, str, dict[str, str]] = (base_url, "/query", {})
        return await self._looked_up(self._engines, key, call, timeout_s, "the engine table", peer)

    def invalidate(self, base_url: str) -> None:
        """Forget what was cached for ``base_url`` (the next lookups ask the registry again)."""
        self._infos.pop(base_url, None)
        for key in [key for key in self._ranks if key[0] == base_url]:
            del self._ranks[key]
        for engine_key in [key for key in self._engines if key[0] == base_url]:
            del self._engines[engine_key]

    async def _looked_up(
        self,
        cache: dict[K, V],
        key: K,
        call: tuple[str, str, dict[str, str]],
        timeout_s: float,
        what: str,
        parse: Callable[[bytes], V],
    ) -> V:
        """``cache[key]``, else the answer to ``call`` (base URL, path, query), parsed and kept.
        One call at a time per base URL, path and query (a lock each: as many as the prefill
        ranks looked up); the others wait for it within their own ``timeout_s``."""
        found = cache.get(key)
        if found is not None:
            return found
        base_url, path, query = call
        deadline = time.monotonic() + timeout_s
        params = "&".join(f"{name}={value}" for name, value in sorted(query.items()))
        lock = self._lookups.setdefault((base_url, path, params), asyncio.Lock())
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                await lock.acquire()
        except TimeoutError as exc:
            raise RendezvousError(
                f"bootstrap lookup of {what} at {base_url} did not succeed within "
                f"{timeout_s:g} s: the same lookup, made for another room, is still running"
            ) from exc
        try:
            found = cache.get(key)
            if found is None:
                raw = await self._get(base_url, path, query, deadline - time.monotonic(), what)
                found = cache[key] = parse(raw)
            return found
        finally:
            lock.release()

    async def _get(
        self, base_url: str, path: str, query: dict[str, str], timeout_s: float, what: str
    ) -> bytes:
        """GET ``base_url + path`` until 200, retrying 503 and transport errors until
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        reason = "no attempt made"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RendezvousError(
                    f"bootstrap lookup of {what} at {base_url} did not succeed within "
                    f"{timeout_s:g} s: {reason}"
                )
            try:
                async with asyncio.timeout(remaining):
                    response = await self._http.get(base_url + path, params=query)
            except (httpx.HTTPError, TimeoutError) as exc:
                reason = f"{type(exc).__name__}: {exc}".rstrip(": ")
            else:
                if response.status_code == 200:
                    return response.content
                reason = f"HTTP {response.status_code}: {response.text[:200]}"
                if response.status_code != 503:
                    raise RendezvousError(
                        f"bootstrap lookup of {what} at {base_url} failed: {reason}",
                        status=response.status_code,
                    )
            await asyncio.sleep(min(self._retry_interval, max(deadline - time.monotonic(), 0)))


def _parse(raw: bytes, kind: type[T], base_url: str) -> T:
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.MsgspecError as exc:
        raise RendezvousError(f"bootstrap answer from {base_url} is not understood: {exc}") from exc


class _EngineEntry(msgspec.Struct, frozen=True):
    engine_id: str
    worker_addr: dict[str, dict[str, str]]


def _engine_entry(raw: bytes, engine_id: str, base_url: str) -> _EngineEntry:
    table = _parse(raw, dict[str, _EngineEntry], base_url)
    for entry in table.values():
        if entry.engine_id == engine_id:
            return entry
    raise RendezvousError(
        f"remote engine_id {engine_id} not found from bootstrap server {base_url}", status=404
    )


def _tcp_peer(addr: str, base_url: str) -> Peer:
    """``tcp://host:port`` (IPv6 in brackets) -> Peer."""
    url = httpx.URL(addr.replace("tcp://", "http://", 1))
    if not addr.startswith("tcp://") or not url.host or url.port is None:
        raise RendezvousError(f"bootstrap server {base_url} lists a bad worker address {addr!r}")
    return Peer(url.host, url.port)
