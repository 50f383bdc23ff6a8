"""Engine load: poll each worker's own load report and keep it on the worker.

Sources, by engine protocol (docs/concepts/protocols.md 11.1):

* vLLM (``vllm-mooncake``, ``vllm-nixl``): ``GET /metrics``, per DP engine (label ``engine``):
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``.
* SGLang: ``GET /v1/loads?include=core,disagg`` (see ``parse_sglang_loads`` for the shapes
  accepted); once it answers 404 that worker is read from ``GET /metrics`` instead (``sglang:`` or
  ``sglang_`` prefix, label ``dp_rank``): ``num_running_reqs``, ``num_queue_reqs``,
  ``token_usage``, ``num_decode_prealloc_queue_reqs``. A decode's waiting queue holds only
  requests whose KV has arrived; those still waiting for pages to receive it into are its
  prealloc queue (``disaggregation.decode_prealloc_queue_reqs`` in ``/v1/loads``), counted as
  waiting too. (Its transfer queue, KV on the way into pages it holds, is not counted.)

Series of one rank (several ``model_name`` values, say) are summed; KV usage takes their maximum.
A failed, timed-out or unparsable read, or one without the running and waiting counts, leaves
the worker's load unknown (the router's own in-flight counts stand in), never idle.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from router.errors import UpstreamError
from router.fleet.engine_cache import EngineCaches
from router.fleet.probe_client import ProbeAnswer, ProbeClient
from router.settings import EngineProtocol, LoadSettings
from router.workers import EngineLoad, Role, Worker, WorkerPool

__all__ = [
    "EngineLoadMonitor",
    "LoadUnavailable",
    "fit_ranks",
    "parse_sglang_loads",
    "parse_sglang_metrics",
    "parse_vllm_metrics",
]

logger = logging.getLogger(__name__)

RankLoads = dict[int, EngineLoad | None]  # engine/DP index -> its load; None: gauges missing

_RUNNING, _WAITING, _KV, _PREALLOC = "running", "waiting", "kv", "prealloc"
_VLLM_GAUGES = {
    "vllm:num_requests_running": _RUNNING,
    "vllm:num_requests_waiting": _WAITING,
    "vllm:kv_cache_usage_perc": _KV,
}
_SGLANG_GAUGES = {
    f"sglang{sep}{name}": field
    for sep in (":", "_")
    for name, field in (
        ("num_running_reqs", _RUNNING),
        ("num_queue_reqs", _WAITING),
        ("token_usage", _KV),
        ("num_decode_prealloc_queue_reqs", _PREALLOC),  # a decode's requests waiting for pages
    )
}


class LoadUnavailable(Exception):
    """A worker's load could not be read (transport, status, timeout, format, gauges missing)."""


# --- parsing: pure functions from an engine's answer to per-rank loads ---------------------


def parse_vllm_metrics(text: str) -> RankLoads:
    """Per DP engine (label ``engine``; none: 0) load from vLLM's Prometheus ``/metrics``."""
    return _parse_prometheus(text, _VLLM_GAUGES, "engine")


def parse_sglang_metrics(text: str) -> RankLoads:
    """Per DP rank (label ``dp_rank``; none: 0) load from SGLang's Prometheus ``/metrics``."""
    return _parse_prometheus(text, _SGLANG_GAUGES, "dp_rank")


def _parse_prometheus(text: str, gauges: Mapping[str, str], rank_label: str) -> RankLoads:
    """Sum each wanted gauge per rank (KV usage: the maximum) with prometheus_client's parser.

    Matches sample names (the parser may strip ``_total`` from family names, never samples).
    Raises LoadUnavailable when the text does not parse or holds none of the gauges.
    """
    values: dict[int, dict[str, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                field = gauges.get(sample.name)
                if field is None or not math.isfinite(sample.value):
                    continue
                rank = int(sample.labels.get(rank_label, "0"))
                fields = values.setdefault(rank, {})
                _accumulate(fields, field, sample.value)
    except ValueError as exc:  # the parser's only error; int() of a bad label too
        raise LoadUnavailable(f"unparsable metrics: {exc}") from exc
    if not values:
        raise LoadUnavailable(f"no load gauges among the metrics ({', '.join(gauges)})")
    return {rank: _load(fields) for rank, fields in values.items()}


def _accumulate(fields: dict[str, float], field: str, value: float) -> None:
    if field == _KV:
        fields[field] = max(fields.get(field, value), value)
    else:
        fields[field] = fields.get(field, 0.0) + value


def _load(fields: Mapping[str, float]) -> EngineLoad | None:
    if _RUNNING not in fields or _WAITING not in fields:
        return None
    waiting = fields[_WAITING] + fields.get(_PREALLOC, 0.0)
    return EngineLoad(fields[_RUNNING], waiting, fields.get(_KV))


class _Disaggregation(msgspec.Struct):
    """An entry's ``disaggregation`` section (``include=disagg``; other keys ignored)."""

    decode_prealloc_queue_reqs: float | None = None


class _RankEntry(msgspec.Struct):
    """One DP rank's entry in SGLang's ``/v1/loads`` (``LoadSnapshot.to_dict``; others ignored)."""

    dp_rank: int | None = None
    num_running_reqs: float | None = None
    num_waiting_reqs: float | None = None
    num_queue_reqs: float | None = None
    token_usage: float | None = None
    disaggregation: _Disaggregation | None = None


class _LoadsAnswer(_RankEntry):
    """The whole answer: ``{"timestamp", "version", ..., "loads": [entry, ...]}``, or one entry."""

    loads: list[_RankEntry] | None = None


_loads_decoder = msgspec.json.Decoder(_LoadsAnswer | list[_RankEntry])


def parse_sglang_loads(content: bytes) -> RankLoads:
    """Per DP rank load from SGLang's ``GET /v1/loads`` JSON.

    Accepted shapes: SGLang's own ``{"loads": [{"dp_rank": 0, "num_running_reqs": ..., ...}]}``
    (sglang PR #16976; the other keys are ignored), a bare list of such entries, or one entry as
    the whole object (a single-rank engine). An entry's rank is its ``dp_rank``, else its place in
    the list (0 for a lone object); waiting is ``num_waiting_reqs``, else ``num_queue_reqs``, plus
    ``disaggregation.decode_prealloc_queue_reqs`` when present; KV usage is ``token_usage`` when
    present. An entry without the counts is an unknown rank. Raises
    LoadUnavailable for other JSON, or when no entry has them.
    """
    try:
        answer = _loads_decoder.decode(content)
    except msgspec.DecodeError as exc:
        raise LoadUnavailable(f"unexpected /v1/loads answer: {exc}") from exc
    if isinstance(answer, list):
        entries: list[_RankEntry] = answer
    else:
        entries = answer.loads if answer.loads else [answer]
    loads: RankLoads = {}
    for index, entry in enumerate(entries):
        rank = index if entry.dp_rank is None else entry.dp_rank
        loads[rank] = _entry_load(entry)
    if not any(load is not None for load in loads.values()):
        raise LoadUnavailable("no running and waiting counts in the /v1/loads answer")
    return loads


def _entry_load(entry: _RankEntry) -> EngineLoad | None:
    waiting = entry.num_waiting_reqs if entry.num_waiting_reqs is not None else entry.num_queue_reqs
    if entry.num_running_reqs is None or waiting is None:
        return None
    disagg = entry.disaggregation
    if disagg is not None and disagg.decode_prealloc_queue_reqs is not None:
        waiting += disagg.decode_prealloc_queue_reqs
    return EngineLoad(entry.num_running_reqs, waiting, entry.token_usage)


def fit_ranks(loads: RankLoads, dp_size: int) -> list[EngineLoad | None]:
    """Map an engine's per-index loads onto the worker's ``dp_size`` DP ranks.

    One rank (a decode, or a prefill without DP): every series summed (unknown if any is). As
    many indexes as ranks: in index order (an engine serving DP ranks 2 and 3 is ranks 0 and 1).
    Otherwise by index; ranks without one are unknown.
    """
    if dp_size == 1:
        return [_combine(list(loads.values()))]
    if len(loads) == dp_size:
        return [loads[index] for index in sorted(loads)]
    return [loads.get(rank) for rank in range(dp_size)]


def _combine(loads: list[EngineLoad | None]) -> EngineLoad | None:
    if len(loads) == 1:
        return loads[0]
    known = [load for load in loads if load is not None]
    if len(known) != len(loads):
        return None
    usages = [load.kv_usage for load in known if load.kv_usage is not None]
    return EngineLoad(
        sum(load.running for load in known),
        sum(load.waiting for load in known),
        max(usages) if usages else None,
    )


# --- polling --------------------------------------------------------------------------------

_Reader = Callable[[Worker], Awaitable[RankLoads]]


class EngineLoadMonitor:
    """Owns the load client and the poll loop; run ``run()`` as a lifespan task.

    Every ``interval_s`` (0: never) it reads every worker's load concurrently, each read bounded
    by ``timeout_s``, and records it on the worker (``Worker.record_engine_load``), or forgets it
    when the read fails. It logs only when a worker's load becomes known (INFO) or unknown
    (WARNING), every other read at DEBUG; a worker that has never answered yet (still starting:
    connection refused, no answer in time) is unknown at DEBUG until it first answers.
    """

    def __init__(
        self,
        pool: WorkerPool[Any],
        engine: EngineProtocol,
        settings: LoadSettings,
        *,
        read_caches: bool = False,
    ) -> None:
        """``read_caches``: also read an SGLang prefill's ``/metrics`` beside its ``/v1/loads``
        for its prefix-cache counters (vLLM's come with its load, always)."""
        self._pool = pool
        self._read_caches = read_caches
        self._settings = settings
        self._client = ProbeClient(settings.timeout_s)
        sglang = engine is EngineProtocol.SGLANG
        self._read: _Reader = self._read_sglang if sglang else self._read_vllm
        self._metrics_only: set[str] = set()  # SGLang workers whose /v1/loads answered 404
        self._known: dict[str, bool] = {}  # worker id -> whether its last read succeeded
        self._answered: set[str] = set()  # workers that have answered a read at least once
        self.caches = EngineCaches()  # the prefills' prefix-cache counters, from /metrics

    async def run(self) -> None:
        """Read every worker's load now and then every ``interval_s`` until cancelled."""
        if self._settings.interval_s <= 0:
            logger.info("engine load polling is off: load-aware policies use in-flight counts")
            await asyncio.Event().wait()  # until cancelled
        while True:
            await self.poll_all()
            await asyncio.sleep(self._settings.interval_s)

    async def poll_all(self) -> None:
        """One round over the pool's current workers (membership changes between rounds)."""
        workers = self._pool.all()
        ids = {worker.id for worker in workers}
        self._metrics_only &= ids
        self._known = {wid: known for wid, known in self._known.items() if wid in ids}
        self._answered &= ids
        self.caches.prune(ids)
        await self._client.prune(ids)
        await asyncio.gather(*(self.poll(worker) for worker in workers))

    async def poll(self, worker: Worker) -> None:
        """Read one worker's load and record it (or forget the old one). Never raises."""
        dispatched = worker.dispatched_counts()  # sent later: maybe not in the engine's count
        started = time.monotonic()
        try:
            async with asyncio.timeout(self._settings.timeout_s):
                loads = await self._read(worker)
        except (LoadUnavailable, TimeoutError) as exc:
            worker.forget_engine_load()
            reason = str(exc) or f"no answer within {self._settings.timeout_s:g}s"
            self._note(worker, False, reason)
            return
        ranks = fit_ranks(loads, worker.dp_size)
        worker.record_engine_load(
            ranks, at=started, stale_after=self._settings.stale_after_s, dispatched=dispatched
        )
        self._note(worker, any(load is not None for load in ranks), ranks)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _read_vllm(self, worker: Worker) -> RankLoads:
        return parse_vllm_metrics(self._cache_counters(worker, await self._get(worker, "/metrics")))

    async def _read_sglang(self, worker: Worker) -> RankLoads:
        if worker.id not in self._metrics_only:
            response = await self._get(worker, "/v1/loads?include=core,disagg", missing_ok=True)
            if response.status != 404:
                if self._read_caches and worker.role is Role.PREFILL:
                    self._cache_counters(worker, await self._get(worker, "/metrics"))
                return parse_sglang_loads(response.body)
            logger.info("SGLang worker %s has no /v1/loads: reading /metrics", worker.public_url)
            self._metrics_only.add(worker.id)
        return parse_sglang_metrics(
            self._cache_counters(worker, await self._get(worker, "/metrics"))
        )

    def _cache_counters(self, worker: Worker, response: ProbeAnswer) -> str:
        """A prefill's ``/metrics`` text, its prefix-cache counters recorded on the way."""
        text = response.text
        if worker.role is Role.PREFILL:
            self.caches.record(worker.id, worker.dp_size, text, time.monotonic())
        return text

    async def _get(self, worker: Worker, path: str, *, missing_ok: bool = False) -> ProbeAnswer:
        try:
            response = await self._client.get(worker, path)
        except UpstreamError as exc:
            raise LoadUnavailable(f"GET {path} failed: {exc!r}") from exc
        self._answered.add(worker.id)
        if response.status != 200 and not (missing_ok and response.status == 404):
            raise LoadUnavailable(f"GET {path} answered HTTP {response.status}")
        return response

    def _note(self, worker: Worker, known: bool, detail: object) -> None:
        """INFO when the worker's load turns known, WARNING when it turns unknown; DEBUG for every
        other read. A worker that has never answered (any HTTP answer) is still starting: its
        failed reads are DEBUG, and recorded as nothing, until it first answers."""
        role, url = worker.role.value, worker.public_url
        if not known and worker.id not in self._answered:
            logger.debug("load of %s worker %s: not answering yet: %s", role, url, detail)
            return
        if self._known.get(worker.id) is known:
            logger.debug("load of %s worker %s: %s", role, url, detail)
            return
        self._known[worker.id] = known
        if known:
            logger.info("load of %s worker %s is known: %s", role, url, detail)
        else:
            logger.warning(
                "load of %s worker %s is unknown (in-flight counts stand in): %s", role, url, detail
            )
