"""The rank-layout reader: learn a prefill's DP rank layout (DP size, engine id per rank).

Read from the engine's own bootstrap server (vLLM ``GET /query``, SGLang ``GET /route``) or,
for a prefill that registers with this router's registry, from the namespace's rank tables.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import msgspec

from registry.engine_api import RankTables
from registry.errors import RegistryError, RegistryUnavailable
from router.errors import UpstreamError
from router.fleet.probe_client import ProbeClient
from router.settings import EngineProtocol
from router.workers import Worker

__all__ = [
    "RankLayout",
    "RankLayoutUnavailable",
    "RegistryDown",
    "fetch_rank_layout",
    "namespace_rank_layout",
    "parse_vllm_query",
]

logger = logging.getLogger(__name__)

# SGLang >= 0.5.10 parallel-info query; answers 503 until every rank registered.
_SGLANG_INFO_NEW = {
    "prefill_dp_rank": "-1",
    "prefill_cp_rank": "-1",
    "target_tp_rank": "-1",
    "target_pp_rank": "-1",
}
# SGLang 0.4.x - 0.5.9 parallel-info query (the extra target_pp_rank is ignored by 0.4.x).
_SGLANG_INFO_OLD = {"engine_rank": "-1", "target_dp_group": "-1", "target_pp_rank": "-1"}


class RankLayoutUnavailable(Exception):
    """The prefill's bootstrap server could not tell its layout (yet)."""


class RegistryDown(RankLayoutUnavailable):
    """The registry's store could not be read: no evidence about the prefill (keep its layout)."""


@dataclass(frozen=True, slots=True)
class RankLayout:
    """A prefill's DP size and, for vLLM, the engine id of each DP rank (index = rank)."""

    dp_size: int
    engine_ids: tuple[str, ...] = ()


def parse_vllm_query(data: Any) -> RankLayout:
    """``{dp_rank: {engine_id, worker_addr}}`` -> engine ids ordered by DP rank."""
    if not isinstance(data, dict) or not data:
        raise RankLayoutUnavailable("bootstrap /query returned no registered DP rank yet")
    try:
        ranks = sorted((int(rank), entry["engine_id"]) for rank, entry in data.items())
    except (ValueError, TypeError, KeyError) as exc:
        raise RankLayoutUnavailable(f"unexpected /query answer: {exc!r}") from exc
    if [rank for rank, _ in ranks] != list(range(len(ranks))):
        raise RankLayoutUnavailable(f"/query lists DP ranks {[r for r, _ in ranks]}, not 0..n-1")
    return RankLayout(dp_size=len(ranks), engine_ids=tuple(str(engine) for _, engine in ranks))


async def fetch_rank_layout(
    client: ProbeClient, engine: EngineProtocol, worker: Worker
) -> RankLayout:
    """Ask ``worker``'s bootstrap server for its layout; raises RankLayoutUnavailable."""
    if engine is EngineProtocol.VLLM_NIXL:
        return RankLayout(dp_size=1)
    if worker.bootstrap_port is None:
        if engine is EngineProtocol.VLLM_MOONCAKE:
            raise RankLayoutUnavailable("vllm-mooncake prefill needs a bootstrap port")
        return RankLayout(dp_size=1)
    try:
        if engine is EngineProtocol.VLLM_MOONCAKE:
            return parse_vllm_query(await _get_json(client, worker, "/query", {}))
        return await _sglang_layout(client, worker)
    except (UpstreamError, _StatusError, ValueError) as exc:
        raise RankLayoutUnavailable(f"bootstrap server {worker.bootstrap_addr}: {exc!r}") from exc


async def namespace_rank_layout(
    tables: RankTables, engine: EngineProtocol, namespace: str
) -> RankLayout:
    """The layout a prefill registered with this router's own registry; raises
    RankLayoutUnavailable until every rank is there, RegistryDown when the store is unavailable
    and the table has no last known data to answer from."""
    try:
        if engine is EngineProtocol.VLLM_MOONCAKE:
            vllm = await tables.vllm(namespace).snapshot()
            if not vllm.complete or not vllm.dp_size or None in vllm.engine_ids:
                raise RankLayoutUnavailable(
                    f"namespace {namespace!r}: vLLM ranks still registering"
                )
            return RankLayout(vllm.dp_size, tuple(str(e) for e in vllm.engine_ids))
        if engine is EngineProtocol.SGLANG:
            info = await tables.sglang(namespace).parallel_info()
            if info is None or not info.complete:
                raise RankLayoutUnavailable(
                    f"namespace {namespace!r}: SGLang ranks still registering"
                )
            return RankLayout(info.dp_size)
        return RankLayout(dp_size=1)
    except RegistryUnavailable as exc:
        raise RegistryDown(f"namespace {namespace!r}: {exc}") from exc
    except RegistryError as exc:
        raise RankLayoutUnavailable(f"namespace {namespace!r}: {exc}") from exc


class _StatusError(Exception):
    """The bootstrap server answered an error status (other than 503: not registered yet)."""

    def __init__(self, path: str, status: int) -> None:
        super().__init__(f"GET {path} answered HTTP {status}")
        self.status = status


async def _get_json(client: ProbeClient, worker: Worker, path: str, params: dict[str, str]) -> Any:
    query = f"{path}?{urlencode(params)}" if params else path
    response = await client.get(worker, query, base_url=worker.bootstrap_addr)
    if response.status == 503:
        raise RankLayoutUnavailable(
            f"{worker.bootstrap_addr}{path}: not all ranks registered (503)"
        )
    if not 200 <= response.status < 300:
        raise _StatusError(path, response.status)
    return msgspec.json.decode(response.body)


async def _sglang_layout(client: ProbeClient, worker: Worker) -> RankLayout:
    try:
        info = await _get_json(client, worker, "/route", _SGLANG_INFO_NEW)
        return RankLayout(dp_size=_positive_int(info, "dp_size"))
    except _StatusError as exc:
        if exc.status != 400:
            raise
    info = await _get_json(client, worker, "/route", _SGLANG_INFO_OLD)
    return RankLayout(dp_size=_positive_int(info, "prefill_dp_size"))


def _positive_int(info: Any, key: str) -> int:
    value = info.get(key) if isinstance(info, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RankLayoutUnavailable(f"bootstrap answer has no valid {key!r}: {info!r}")
    return value
