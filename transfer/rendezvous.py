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
  another address is found again after the caller invalidates).
* Every failure is a ``RendezvousError`` (a ``TransferError`` with ``op="bootstrap"``, the engine
  API it called; ``code`` holds the HTTP status when there was one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import httpx
import msgspec

from transfer.closing import AsyncClosing
from transfer.control import Peer
from transfer.errors import TransferError

__all__ = [
    "RendezvousClient",
    "RendezvousError",
    "PrefillInfo",
    "PrefillRank",
    "bootstrap_url",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

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


def bootstrap_url(registry: str, namespace: str | None = None) -> str:
    """The base URL of a namespace's bootstrap API on ``registry`` ("host:port" or a URL).

    ``namespace=None`` (or ``"default"`` on a plain port) uses the plain paths.
    """
    url = httpx.URL(registry)
    if url.scheme not in ("http", "https"):
        url = httpx.URL(f"http://{registry}")
    base = str(url).rstrip("/")
    return f"{base}/bootstrap/{namespace}" if namespace else base


@dataclass(frozen=True, slots=True)
class PrefillRank:
    """One prefill rank's place in its instance's parallel layout (SGLang 0.5.x names)."""

    page_size: int
    kv_cache_dtype: str = "auto"
    attn_tp_size: int = 1
    attn_tp_rank: int = 0
    attn_dp_size: int = 1
    attn_dp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    system_dp_size: int = 1
    system_dp_rank: int = 0
    engine_id: str | None = None  # set: announce with vLLM's POST /register under this id

    def __post_init__(self) -> None:
        for rank, size in (
            ("attn_tp_rank", "attn_tp_size"),
            ("attn_dp_rank", "attn_dp_size"),
            ("pp_rank", "pp_size"),
            ("system_dp_rank", "system_dp_size"),
        ):
            if not 0 <= getattr(self, rank) < getattr(self, size):
                raise ValueError(f"{rank}={getattr(self, rank)} outside [0, {size})")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")

    @property
    def dp_rank(self) -> int:
        """The DP rank decoders address (SGLang: system DP when > 1, else attention DP)."""
        return self.attn_dp_rank if self.system_dp_size == 1 else self.system_dp_rank

    @property
    def unique_rank(self) -> int:
        """SGLang's ``prefill_unique_rank`` (no context parallelism): the status sender's id."""
        return self.attn_tp_rank * self.pp_size + self.pp_rank

    def route_body(self, address: Peer) -> dict[str, Any]:
        """The 0.5.x ``PUT /route`` payload announcing this rank at ``address``."""
        return {
            "attn_tp_size": self.attn_tp_size,
            "attn_tp_rank": self.attn_tp_rank,
            "attn_dp_size": self.attn_dp_size,
            "attn_dp_rank": self.attn_dp_rank,
            "pp_size": self.pp_size,
            "pp_rank": self.pp_rank,
            "system_dp_size": self.system_dp_size,
            "system_dp_rank": self.system_dp_rank,
            "rank_ip": address.host,
            "rank_port": address.port,
            "page_size": self.page_size,
            "kv_cache_dtype": self.kv_cache_dtype,
        }

    def register_body(self, address: Peer) -> dict[str, Any]:
        """vLLM's ``POST /register`` payload announcing this rank at ``address``."""
        return {
            "engine_id": self.engine_id,
            "dp_rank": self.dp_rank,
            "tp_rank": self.attn_tp_rank,
            "pp_rank": self.pp_rank,
            "addr": f"tcp://{address.host}:{address.port}",
        }


class PrefillInfo(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    rename={"tp_size": "attn_tp_size", "cp_size": "attn_cp_size"},
):
    """A prefill instance's layout, as the 0.5.10+ parallel-info query answers it."""

    tp_size: int
    cp_size: int = 1
    dp_size: int
    pp_size: int
    page_size: int | None = None
    kv_cache_dtype: str | None = None
    follow_bootstrap_room: bool = True

    def mismatches(self, *, page_size: int, kv_cache_dtype: str | None, tp_size: int) -> list[str]:
        """Why a decode rank of this geometry cannot receive from this prefill (empty: it can).

        ``kv_cache_dtype`` None (on either side) matches any dtype.
        """
        problems = []
        if self.page_size is not None and self.page_size != page_size:
            problems.append(f"page_size {self.page_size} != {page_size}")
        dtypes = (self.kv_cache_dtype, kv_cache_dtype)
        if None not in dtypes and dtypes[0] != dtypes[1]:
            problems.append(f"kv_cache_dtype {dtypes[0]} != {dtypes[1]}")
        if self.tp_size != tp_size:
            problems.append(
                f"attn_tp_size {self.tp_size} != decode tp_size {tp_size} "
                "(TP resharding is not supported)"
            )
        if (self.pp_size, self.cp_size) != (1, 1):
            problems.append(f"pp_size={self.pp_size} cp_size={self.cp_size} (only 1 supported)")
        return problems


class _RankAnswer(msgspec.Struct, frozen=True):
    rank_ip: str
    rank_port: int


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
        info = self._infos.get(base_url)
        if info is None:
            raw = await self._get(base_url, "/route", _INFO_QUERY, timeout_s, "parallel info")
            info = _parse(raw, PrefillInfo, base_url)
            self._infos[base_url] = info
        return info

    async def rank_address(
        self, base_url: str, *, dp: int, tp: int, pp: int = 0, cp: int = 0, timeout_s: float
    ) -> Peer:
        """The control address of prefill rank (dp, cp, tp, pp) at ``base_url``."""
        key = (base_url, dp, cp, tp, pp)
        peer = self._ranks.get(key)
        if peer is None:
            query = {
                "prefill_dp_rank": str(dp),
                "prefill_cp_rank": str(cp),
                "target_tp_rank": str(tp),
                "target_pp_rank": str(pp),
            }
            what = f"rank dp={dp} cp={cp} tp={tp} pp={pp}"
            raw = await self._get(base_url, "/route", query, timeout_s, what)
            answer = _parse(raw, _RankAnswer, base_url)
            peer = self._ranks[key] = Peer(answer.rank_ip, answer.rank_port)
        return peer

    async def engine_address(
        self, base_url: str, engine_id: str, *, tp: int, pp: int = 0, timeout_s: float
    ) -> Peer:
        """The control address of ``engine_id``'s rank (tp, pp), from vLLM's ``GET /query``.

        An engine id missing from the table fails at once with vLLM's wording ("... not found
        from bootstrap server"), which routers take as a sign to re-read the prefill's layout.
        """
        key = (base_url, engine_id, tp, pp)
        peer = self._engines.get(key)
        if peer is None:
            raw = await self._get(base_url, "/query", {}, timeout_s, "the engine table")
            entry = _engine_entry(raw, engine_id, base_url)
            addr = entry.worker_addr.get(str(tp), {}).get(str(pp))
            if addr is None:
                raise RendezvousError(
                    f"engine {engine_id} at {base_url} lists no rank tp={tp} pp={pp}"
                )
            peer = self._engines[key] = _tcp_peer(addr, base_url)
        return peer

    def invalidate(self, base_url: str) -> None:
        """Forget what was cached for ``base_url`` (the next lookups ask the registry again)."""
        self._infos.pop(base_url, None)
        for key in [key for key in self._ranks if key[0] == base_url]:
            del self._ranks[key]
        for engine_key in [key for key in self._engines if key[0] == base_url]:
            del self._engines[engine_key]

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
