"""Registry benchmark: per-request worker selection, watch propagation, registration throughput.

    python -m bench.discovery.registry [--quick] [--n 2000] [--watch-n 200] [--cap 20]

Three sections, each printed as a table as soon as it is done, with ratios to a baseline measured
in the same invocation:

1. the router's per-request worker choice (``RouteChooser.route`` over an in-memory ``WorkerPool``:
   both policies' ``choose`` plus ``least_loaded_rank``) per policy, baseline ``round_robin``; for
   contrast, what reading the registry per request (``list_workers``) would cost instead;
2. watch propagation of ``RegistryService.add_worker`` to a ``watch_workers()`` consumer on a
   second store instance (two routers on one etcd), baseline ``memory://`` (one instance);
3. registration throughput: ``add_worker`` sequential and with concurrent tasks (memory vs etcd),
   and vLLM's ``POST /register`` over HTTP on a real uvicorn server (``vllm_routes``, memory
   store), baseline the same registrations called in-process.

Everything runs on 127.0.0.1. The bench starts its own etcd (``testkit/etcd_server.py``, Debian's
``etcd-server``) and always stops it; without the binary the etcd rows say "skipped". Every loop
is bounded by a count and by a wall-clock cap per measurement (``--cap``); ``--quick`` keeps the
whole run to about 15 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import platform
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
from fastapi import FastAPI

from bench.common.cli import sigterm_raises
from bench.common.process import LOOPBACK
from bench.common.server import serve
from bench.common.stats import nearest_rank
from registry.backends import RegistryStore, WatchEvent, open_store
from registry.engine_api import RankTables, RegisterWorkerPayload, vllm_routes
from registry.errors import Conflict, RegistryUnavailable
from registry.models import worker_id
from registry.service import RegistryService, WorkerChange
from router.adapters import build_adapter
from router.observability.metrics import RouterMetrics
from router.scheduling.chooser import RouteChooser
from router.scheduling.features import Featurizer
from router.scheduling.policies import POLICIES, build_policy
from router.settings import CacheAwareSettings, EngineProtocol
from router.upstream.base import UpstreamPool, UpstreamResponse
from router.upstream.lean_pool import LeanPoolTransport
from router.workers import Role, Worker
from testkit.etcd_server import EtcdMissing, EtcdServer

__all__ = ["BenchConfig", "Run", "main", "render_table", "run_bench"]

ETCD_PREFIX = "/pdr-bench"
SELECT_BATCH = 1000
SELECT_WARMUP = 2000
WATCH_TIMEOUT_S = 2.0
STOP_GRACE_S = 5.0
VLLM_NAMESPACES = 32
VLLM_TP_PER_DP = 8


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Counts and caps; every measurement stops at its count or its cap, whichever comes first."""

    registrations: int = 2000
    watch_adds: int = 200
    lookups: int = 200_000
    store_reads: int = 2000
    concurrency: int = 32
    cap_s: float = 20.0
    quick: bool = False


QUICK = BenchConfig(
    registrations=500, watch_adds=100, lookups=50_000, store_reads=300, cap_s=3.0, quick=True
)


@dataclass(slots=True)
class Run:
    """One measurement: ``ops`` completed in ``elapsed_s``, with per-op latencies if timed."""

    label: str
    ops: int
    elapsed_s: float
    latencies_s: list[float] = field(default_factory=list)
    errors: int = 0
    note: str = ""

    @property
    def rate(self) -> float:
        return self.ops / self.elapsed_s if self.elapsed_s > 0 else math.nan

    def p(self, q: float) -> float:
        return nearest_rank(self.latencies_s, q)


# --- formatting ------------------------------------------------------------------------------


def _num(value: float, digits: int = 0) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.3f}"


def _ratio(value: float, baseline: float) -> str:
    if math.isnan(value) or math.isnan(baseline) or baseline == 0:
        return "-"
    ratio = value / baseline
    return f"{ratio:.2f}x" if ratio >= 0.01 else f"{ratio:.4f}x"


def render_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: first column left-aligned, the rest right-aligned."""
    table = [list(header), *map(list, rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        return "  " + "  ".join(cells).rstrip()

    rule = "  " + "  ".join("-" * w for w in widths)
    return "\n".join([title, line(header), rule, *map(line, table[1:])])


# --- 1. per-request selection ----------------------------------------------------------------


class _NoUpstream:
    """A pool entry's client that is never called: selection touches no client and no store."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def open(
        self, path: str, body: bytes, headers: dict[str, str], *, whole: bool = False
    ) -> UpstreamResponse:
        raise RuntimeError("the selection benchmark sends no request")

    async def get(self, path: str, timeout: float) -> tuple[int, bytes]:
        raise RuntimeError("the selection benchmark sends no request")

    async def aclose(self) -> None:
        return None


def build_pool(prefills: int = 4, decodes: int = 4, dp_size: int = 2) -> UpstreamPool:
    """Healthy prefill workers (``dp_size`` ranks, engine ids known) and decode workers, with
    uneven in-flight counts so load-aware policies compare rather than always tie."""
    pool = UpstreamPool(needs_engine_ids=True)
    for i in range(prefills):
        worker = Worker(Role.PREFILL, f"http://10.0.0.{i + 1}:8000", 8998, healthy=True)
        worker.set_layout(dp_size, tuple(f"engine-{i}-{rank}" for rank in range(dp_size)))
        worker.rank_inflight = [(i + rank) % 3 for rank in range(dp_size)]
        worker.inflight = sum(worker.rank_inflight)
        pool.add(worker, _NoUpstream(worker))
    for i in range(decodes):
        worker = Worker(Role.DECODE, f"http://10.0.1.{i + 1}:8000", healthy=True, inflight=i % 3)
        pool.add(worker, _NoUpstream(worker))
    return pool


def build_chooser(policy: str, pool: UpstreamPool) -> RouteChooser:
    """The router's routing decision as ``router/pipeline/serve.py`` builds it (vLLM Mooncake)."""
    return RouteChooser(
        pool,
        build_adapter(EngineProtocol.VLLM_MOONCAKE).decode_can_prefill,
        build_policy(policy),
        build_policy(policy),
        RouterMetrics(),
        CacheAwareSettings(),
        Featurizer(None),
    )


def time_selection(policy: str, count: int, cap_s: float) -> Run:
    """Calls of the router's per-request choice (``RouteChooser.route``) per second."""
    chooser = build_chooser(policy, build_pool())

    def select(failed: set[str]) -> None:
        chooser.route(failed, None, count=False)

    failed: set[str] = set()
    for _ in range(SELECT_WARMUP):
        select(failed)
    done = 0
    start = time.perf_counter()
    deadline = start + cap_s
    while done < count and time.perf_counter() < deadline:
        batch = min(SELECT_BATCH, count - done)
        for _ in range(batch):
            select(failed)
        done += batch
    return Run(policy, done, time.perf_counter() - start)


async def time_store_reads(label: str, store: RegistryStore, count: int, cap_s: float) -> Run:
    """``list_workers`` per op, sequentially, over the same 4 + 4 workers (the contrast rows)."""
    service = RegistryService(store)
    for i in range(4):
        await service.add_worker("prefill", f"http://10.0.0.{i + 1}:8000", bootstrap_port=8998)
        await service.add_worker("decode", f"http://10.0.1.{i + 1}:8000")

    async def read(_: int) -> bool:
        return len(await service.list_workers()) == 8

    return await drive(label, read, count, 1, cap_s)


async def section_selection(config: BenchConfig, etcd_url: str | None) -> str:
    cap = config.cap_s / 5  # five timed runs share the section's cap
    runs = [time_selection(name, config.lookups, cap) for name in POLICIES]
    async with opened("memory://") as store:
        contrast = [await time_store_reads("list_workers (memory)", store, config.store_reads, cap)]
    contrast += await with_etcd(
        "list_workers (etcd)",
        etcd_url,
        "reads",
        lambda url: _etcd_reads(url, config.store_reads, cap),
    )
    baseline = runs[0].rate
    rows = [_selection_row(run, baseline) for run in runs]
    rows += [_selection_row(run, baseline) for run in contrast]
    title = (
        "1. Per-request worker selection: RouteChooser.route over 4 prefill (dp 2) + 4 decode, "
        f"baseline {runs[0].label}"
    )
    header = ["selection", "ops", "ops/s", "us/op", "x baseline", "note"]
    notes = [
        "   policies run on the in-memory WorkerPool: 0 store calls per request; the",
        "   list_workers rows show what reading the registry per request would cost instead.",
    ]
    return render_table(title, header, rows) + "\n" + "\n".join(notes)


async def _etcd_reads(url: str, count: int, cap_s: float) -> list[Run]:
    async with opened(url) as store:
        return [await time_store_reads("list_workers (etcd)", store, count, cap_s)]


def _selection_row(run: Run, baseline: float) -> list[str]:
    us = 1e6 / run.rate if run.ops else math.nan
    return [
        run.label,
        _num(run.ops),
        _num(run.rate),
        _num(us, 3),
        _ratio(run.rate, baseline),
        run.note,
    ]


# --- 2. watch propagation --------------------------------------------------------------------


class StampedStore:
    """Delegates to a store, noting the time just before each ``put`` (the writer's side)."""

    def __init__(self, inner: RegistryStore) -> None:
        self._inner = inner
        self.last_put = math.nan

    async def put(self, key: str, value: bytes, *, ttl: float | None = None) -> None:
        self.last_put = time.perf_counter()
        await self._inner.put(key, value, ttl=ttl)

    async def refresh(self, key: str) -> bool:
        return await self._inner.refresh(key)

    async def get(self, key: str) -> bytes | None:
        return await self._inner.get(key)

    async def list(self, prefix: str) -> dict[str, bytes]:
        return await self._inner.list(prefix)

    async def delete(self, key: str) -> bool:
        return await self._inner.delete(key)

    def watch(self, prefix: str) -> AsyncIterator[WatchEvent]:
        return self._inner.watch(prefix)

    async def close(self) -> None:
        await self._inner.close()


class Arrivals:
    """Resolves a future with the arrival time when the watch delivers the awaited worker id."""

    def __init__(self) -> None:
        self._pending: dict[str, asyncio.Future[float]] = {}
        self._failure: BaseException | None = None

    def expect(self, wid: str) -> asyncio.Future[float]:
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        if self._failure is not None:
            future.set_exception(self._failure)
        else:
            self._pending[wid] = future
        return future

    def forget(self, wid: str) -> None:
        self._pending.pop(wid, None)

    async def consume(self, changes: AsyncIterator[WorkerChange]) -> None:
        try:
            async for change in changes:
                now = time.perf_counter()
                future = self._pending.pop(change.worker_id, None)
                if future is not None and not future.done():
                    future.set_result(now)
        except RegistryUnavailable as exc:
            self._failure = exc
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(exc)
            raise


async def _add_seen(
    writer: RegistryService, stamp: StampedStore, arrivals: Arrivals, url: str, timeout: float
) -> tuple[float, float] | None:
    """(put -> seen, add_worker call -> seen) in seconds; None when not seen within timeout."""
    wid = worker_id("decode", url)
    arrived = arrivals.expect(wid)
    called = time.perf_counter()
    await writer.add_worker("decode", url)
    try:
        seen = await asyncio.wait_for(arrived, timeout)
    except TimeoutError:
        arrivals.forget(wid)
        return None
    return seen - stamp.last_put, seen - called


async def measure_watch(
    label: str, writer_store: RegistryStore, reader_store: RegistryStore, count: int, cap_s: float
) -> list[Run]:
    """Sequential adds by the writer, each awaited on the reader's ``watch_workers()``."""
    stamp = StampedStore(writer_store)
    writer = RegistryService(stamp)
    reader = RegistryService(reader_store)
    await reader.list_workers()  # etcd: the watch replays from this revision on, so no gap
    arrivals = Arrivals()
    consumer = asyncio.create_task(arrivals.consume(reader.watch_workers()))
    try:
        if await _add_seen(writer, stamp, arrivals, _worker_url(10**6), WATCH_TIMEOUT_S) is None:
            raise RegistryUnavailable("the watch saw no warm-up add")
        return await _watch_loop(label, writer, stamp, arrivals, count, cap_s)
    finally:
        consumer.cancel()
        with contextlib.suppress(asyncio.CancelledError, RegistryUnavailable):
            await consumer


async def _watch_loop(
    label: str,
    writer: RegistryService,
    stamp: StampedStore,
    arrivals: Arrivals,
    count: int,
    cap_s: float,
) -> list[Run]:
    put_seen: list[float] = []
    add_seen: list[float] = []
    missed = 0
    start = time.perf_counter()
    deadline = start + cap_s
    for i in range(count):
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        timeout = min(WATCH_TIMEOUT_S, left)
        result = await _add_seen(writer, stamp, arrivals, _worker_url(i), timeout)
        if result is None:
            missed += 1
            continue
        put_seen.append(result[0])
        add_seen.append(result[1])
    elapsed = time.perf_counter() - start
    return [
        Run(f"{label}: put -> seen", len(put_seen), elapsed, put_seen, missed),
        Run(f"{label}: add_worker -> seen", len(add_seen), elapsed, add_seen, missed),
    ]


async def _memory_watch(count: int, cap_s: float) -> list[Run]:
    async with opened("memory://") as store:
        return await measure_watch("memory (1 store)", store, store, count, cap_s)


async def _etcd_watch(url: str, count: int, cap_s: float) -> list[Run]:
    async with opened(url) as writer, opened(url) as reader:
        return await measure_watch("etcd (2 stores)", writer, reader, count, cap_s)


async def section_watch(config: BenchConfig, etcd_url: str | None) -> str:
    cap = config.cap_s / 2
    runs = await _memory_watch(config.watch_adds, cap)
    runs += await with_etcd(
        "etcd (2 stores)", etcd_url, "watch", lambda url: _etcd_watch(url, config.watch_adds, cap)
    )
    baseline = runs[0].p(50)
    rows = [
        [
            run.label,
            _num(run.ops),
            _ms(run.p(50)),
            _ms(run.p(90)),
            _ms(run.p(99)),
            _ms(max(run.latencies_s, default=math.nan)),
            _num(run.errors),
            _ratio(run.p(50), baseline),
            run.note,
        ]
        for run in runs
    ]
    title = (
        "2. Watch propagation of add_worker (writer store -> watch_workers() on the reader), "
        f"baseline {runs[0].label} p50"
    )
    header = ["path", "adds", "p50 ms", "p90 ms", "p99 ms", "max ms", "missed", "x p50", "note"]
    return render_table(title, header, rows)


# --- 3. registration throughput --------------------------------------------------------------


def _worker_url(i: int) -> str:
    return f"http://10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}:8000"


async def drive(
    label: str, op: Callable[[int], Awaitable[bool]], count: int, concurrency: int, cap_s: float
) -> Run:
    """``op(0..count-1)`` over ``concurrency`` tasks until done or ``cap_s``; ``op`` returns ok.

    Tasks still running ``STOP_GRACE_S`` after the cap are cancelled.
    """
    indices = iter(range(count))
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + cap_s

    async def loop() -> None:
        nonlocal errors
        for i in indices:  # shared: each index is taken by exactly one task
            if time.perf_counter() >= deadline:
                return
            began = time.perf_counter()
            ok = await op(i)
            latencies.append(time.perf_counter() - began)
            errors += not ok

    start = time.perf_counter()
    tasks = [asyncio.create_task(loop()) for _ in range(concurrency)]
    done, late = await asyncio.wait(tasks, timeout=cap_s + STOP_GRACE_S)
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    for task in done:
        task.result()  # re-raise an op's unexpected failure
    note = f"cut at {cap_s:g}s cap" if len(latencies) < count else ""
    return Run(label, len(latencies), time.perf_counter() - start, latencies, errors, note)


def _add_op(service: RegistryService) -> Callable[[int], Awaitable[bool]]:
    async def add(i: int) -> bool:
        try:
            await service.add_worker("decode", _worker_url(i))
        except RegistryUnavailable:
            return False
        return True

    return add


async def measure_adds(label: str, url: str, config: BenchConfig) -> list[Run]:
    """``add_worker`` of fresh workers, sequential then concurrent, each on a fresh store."""
    runs = []
    for tasks in (1, config.concurrency):
        store_url = url if url == "memory://" else f"{url}/adds-{tasks}"
        async with opened(store_url) as store:
            op = _add_op(RegistryService(store))
            mode = "sequential" if tasks == 1 else f"{tasks} tasks"
            runs.append(
                await drive(f"{label} {mode}", op, config.registrations, tasks, config.cap_s / 4)
            )
    return runs


def vllm_registration(i: int) -> tuple[str, dict[str, Any]]:
    """Registration ``i``: (namespace, ``/register`` body), each a distinct (namespace, dp, tp)
    with one engine id per (namespace, dp), so none conflicts with another."""
    namespace, j = i % VLLM_NAMESPACES, i // VLLM_NAMESPACES
    dp, tp = divmod(j, VLLM_TP_PER_DP)
    body = {
        "engine_id": f"engine-{namespace}-{dp}",
        "dp_rank": dp,
        "tp_rank": tp,
        "pp_rank": 0,
        "addr": f"10.{namespace % 256}.{dp % 256}.{tp}:17000",
    }
    return f"bench-{namespace}", body


async def measure_vllm_inprocess(config: BenchConfig, cap_s: float) -> Run:
    """The same registrations as the HTTP run, called on ``VllmRankTable`` in-process."""
    async with opened("memory://") as store:
        tables = RankTables()
        tables.bind(store)

        async def register(i: int) -> bool:
            namespace, body = vllm_registration(i)
            try:
                await tables.vllm(namespace).register(RegisterWorkerPayload(**body))
            except Conflict:
                return False
            return True

        run = await drive(
            "VllmRankTable.register in-process",
            register,
            config.registrations,
            config.concurrency,
            cap_s,
        )
        return _with_stored(run, len(await store.list("bootstrap/vllm/")))


def _with_stored(run: Run, stored: int) -> Run:
    note = f"{stored} stored"
    return replace(run, note=f"{run.note}; {note}" if run.note else note)


async def _warm_up(client: httpx.AsyncClient, connections: int) -> None:
    """Open the client's connections (and the server's code paths) before timing."""
    answers = await asyncio.gather(
        *(client.get("/bootstrap/warmup/query") for _ in range(connections))
    )
    for answer in answers:
        answer.raise_for_status()


def _http_op(client: httpx.AsyncClient) -> Callable[[int], Awaitable[bool]]:
    async def post(i: int) -> bool:
        namespace, body = vllm_registration(i)
        try:
            response = await client.post(f"/bootstrap/{namespace}/register", json=body)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    return post


def _http_transport(lean: bool, connections: int) -> httpx.AsyncBaseTransport:
    """httpx's own pool, or the router's ``LeanPoolTransport`` (O(1) per request)."""
    nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    if lean:
        return LeanPoolTransport(
            max_connections=connections,
            max_idle=connections,
            keepalive_expiry=4.0,
            socket_options=nodelay,
        )
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncHTTPTransport(limits=limits, socket_options=nodelay)


async def measure_vllm_http(config: BenchConfig, *, lean: bool, cap_s: float) -> Run:
    """``POST /bootstrap/{ns}/register`` on a real uvicorn server over a memory store."""
    async with opened("memory://") as store:
        tables = RankTables()
        tables.bind(store)
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        app.include_router(vllm_routes(tables.vllm))
        async with (
            serve(app) as port,
            httpx.AsyncClient(
                base_url=f"http://{LOOPBACK}:{port}",
                transport=_http_transport(lean, config.concurrency),
                timeout=httpx.Timeout(10.0),
                trust_env=False,
            ) as client,
        ):
            await _warm_up(client, config.concurrency)
            pool = "LeanPoolTransport" if lean else "httpx pool"
            run = await drive(
                f"POST /register over HTTP ({pool})",
                _http_op(client),
                config.registrations,
                config.concurrency,
                cap_s,
            )
        return _with_stored(run, len(await store.list("bootstrap/vllm/")))


def _rate_row(run: Run, baseline: float) -> list[str]:
    return [
        run.label,
        _num(run.ops),
        _num(run.rate),
        _ms(run.p(50)),
        _ms(run.p(99)),
        _num(run.errors),
        _ratio(run.rate, baseline),
        run.note,
    ]


RATE_HEADER = ["operation", "ops", "ops/s", "p50 ms", "p99 ms", "errors", "x baseline", "note"]


async def section_adds(config: BenchConfig, etcd_url: str | None) -> str:
    runs = await measure_adds("memory", "memory://", config)
    runs += await with_etcd("etcd", etcd_url, "adds", lambda url: measure_adds("etcd", url, config))
    rows = [_rate_row(run, runs[0].rate) for run in runs]
    title = f"3a. Registration throughput: RegistryService.add_worker, baseline {runs[0].label}"
    return render_table(title, RATE_HEADER, rows)


async def section_http(config: BenchConfig) -> str:
    cap = config.cap_s / 3
    runs = [
        await measure_vllm_inprocess(config, cap),
        await measure_vllm_http(config, lean=True, cap_s=cap),
        await measure_vllm_http(config, lean=False, cap_s=cap),
    ]
    rows = [_rate_row(run, runs[0].rate) for run in runs]
    title = (
        f"3b. vLLM bootstrap registration ({config.concurrency} tasks, memory store, "
        f"{VLLM_NAMESPACES} namespaces), baseline in-process"
    )
    return render_table(title, RATE_HEADER, rows)


# --- wiring ----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def opened(url: str) -> AsyncIterator[RegistryStore]:
    store = open_store(url)
    try:
        yield store
    finally:
        await store.close()


async def with_etcd(
    label: str,
    etcd_url: str | None,
    section: str,
    measure: Callable[[str], Awaitable[list[Run]]],
) -> list[Run]:
    """``measure`` on a fresh key prefix of the bench's etcd; a row saying why when it cannot."""
    if etcd_url is None:
        return [Run(label, 0, math.nan, note="skipped: no etcd")]
    try:
        return await measure(f"{etcd_url}{ETCD_PREFIX}/{section}")
    except RegistryUnavailable as exc:
        return [Run(label, 0, math.nan, note=f"failed: {exc}")]


async def run_bench(
    config: BenchConfig, etcd_url: str | None, emit: Callable[[str], None] = print
) -> None:
    """Run every section, emitting each table when it is done."""
    emit(await section_selection(config, etcd_url))
    emit("")
    emit(await section_watch(config, etcd_url))
    emit("")
    emit(await section_adds(config, etcd_url))
    emit("")
    emit(await section_http(config))


def _start_etcd(etcd: EtcdServer) -> str | None:
    try:
        etcd.start()
    except EtcdMissing as exc:
        print(f"note: {exc}; etcd rows are skipped", file=sys.stderr)
        return None
    return etcd.url


def _config(args: argparse.Namespace) -> BenchConfig:
    base = QUICK if args.quick else BenchConfig()
    overrides = {
        "registrations": args.n,
        "watch_adds": args.watch_n,
        "lookups": args.lookups,
        "concurrency": args.concurrency,
        "cap_s": args.cap,
    }
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.discovery.registry",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="small counts, ~15 s in all")
    parser.add_argument("--n", type=int, help="registrations per throughput run (2000)")
    parser.add_argument("--watch-n", type=int, help="adds per watch-latency run (200)")
    parser.add_argument("--lookups", type=int, help="selections per policy (200000)")
    parser.add_argument("--concurrency", type=int, help="concurrent tasks (32)")
    parser.add_argument("--cap", type=float, help="wall-clock cap per section, s (20)")
    args = parser.parse_args(argv)
    for name in ("n", "watch_n", "lookups", "concurrency", "cap"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    config = _config(parse_args(argv))
    logging.basicConfig(level=logging.WARNING)
    print(
        f"pd-router registry bench: python {platform.python_version()}, "
        f"{'quick' if config.quick else 'full'}, n={config.registrations}, "
        f"watch n={config.watch_adds}, lookups={config.lookups}, cap {config.cap_s:g}s"
    )
    started = time.perf_counter()
    etcd = EtcdServer()
    with sigterm_raises(lambda signum: SystemExit(128 + signum)):  # etcd is stopped
        try:
            etcd_url = _start_etcd(etcd)
            asyncio.run(run_bench(config, etcd_url, lambda text: print(text, flush=True)))
        finally:
            etcd.close()
    print(f"\ntotal {time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
