"""KV transfer benchmark: the library's bytes/s and per-request overhead against raw Mooncake.

    python -m bench.transfer.kv_transfer [--layers 32] [--tokens 4096]
                                         [--bytes-per-token-per-layer 4096] [--page-size 16]
                                         [--run-pages 16] [--requests 5] [--concurrency 1,4]
                                         [--overhead-requests 500] [--cap 30]

One process on 127.0.0.1: a registry (uvicorn, in-process) for the rendezvous, a prefill
``KVSender`` and a decode ``KVReceiver`` over two ``MooncakeEngine``s (TCP), and two more native
engines for the raw baseline (``bench.transfer.engine.raw_engines``). Both pools are
``worker.kv.KVPool``s, registered with both pairs of engines.

The request. Default geometry: a Llama-3-8B-class model in bf16 (32 layers, GQA with 8 KV heads of
128 dims): K+V per token per layer is 2 x 8 x 128 x 2 bytes = 4096 bytes; a 4096-token prompt is
then 512 MiB in 256 pages of 16 tokens, 64 regions (K and V per layer). Each request's pages are
shuffled runs of ``--run-pages`` pages on both sides (a pool after some churn; 0: in order), and
the library coalesces what is contiguous on both sides into one entry per region and run:
1024 entries of 512 KiB for the defaults.

Throughput rows, per concurrency C (C requests at once, each its own pages), interleaved
repetition by repetition so drift hits every path alike:

* ``raw sync write``: ``batch_transfer_sync_write`` of exactly the entries the library computes
  for those requests (``transfer.page_layout.transfer_entries``), in batches of 1024, back to back;
* ``engine.write``: the same entries through ``MooncakeEngine.write`` (one call per request,
  concurrently), without the control plane;
* ``library``: ``KVReceiver.request`` on the decode side plus ``KVSender.send`` on the prefill
  side, the full handshake per request (lookup cached after the first, TransferInfo, writes with
  the aux slot, status), timed from the first ``request`` call to the last Success.

GB/s is KV bytes over wall time (best and median of ``--requests`` runs); ``ratio`` divides by the
raw row's at the same C (target >= 0.90); ``cpu ms`` is the process CPU (every thread) of the best
run. Every run checks every byte that arrived (and the aux slot), then clears the destination.
Reading it: the raw path's completion wait (``get_batch_transfer_status``) spins a core, which on a
host with few cores competes with the TCP transport's own threads (its ``cpu ms`` is about twice
its wall time on 2 cores), so ``engine.write`` is the tighter ceiling there; ``library`` over
``engine.write`` is what the control plane costs at this size.

Overhead rows: 1-page requests (one entry per region), ``--overhead-requests`` times per path
(bounded by ``--cap`` seconds), p50/p90/p99 of the raw write, of ``engine.write`` and of the
library request (handshake to Success), and of a dummy library request (no pages, no aux: the
SGLang dummy rank), which is the control plane's cost alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import itertools
import random
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import zmq.asyncio

from bench.common.cli import positive_ints
from bench.common.process import LOOPBACK
from bench.common.server import serve
from bench.common.stats import Percentiles, percentiles
from bench.common.table import text_table
from bench.transfer.engine import raw_engines, raw_sync
from registry.app import create_registry_app
from registry.settings import RegistrySettings
from transfer.config import ReceiverConfig, SenderConfig
from transfer.engine.mooncake import MooncakeEngine
from transfer.page_layout import Entry, pages_for_tokens, total_bytes, transfer_entries
from transfer.receiver import KVReceiver
from transfer.rendezvous import PrefillRank, bootstrap_url
from transfer.sender import KVSender
from worker.kv import KVPool, PoolShape

__all__ = [
    "KVConfig",
    "LatencyRow",
    "Report",
    "ThroughputRow",
    "main",
    "render",
    "run_bench",
    "run_overhead",
    "run_throughput",
]

AUX_LEN = 16
TIMEOUT_S = 120.0  # one request (or one group of concurrent ones), generous on a slow VM
START_TIMEOUT_S = 10.0
RAW, ENGINE, LIBRARY = "raw sync write", "engine.write", "library"
CONTROL = "library, 0 pages"


@dataclass(frozen=True)
class KVConfig:
    """One invocation's settings; ``bytes_per_token`` is per layer, K and V together."""

    layers: int = 32
    tokens: int = 4096
    bytes_per_token: int = 4096
    page_size: int = 16
    run_pages: int = 16
    requests: int = 5
    concurrency: tuple[int, ...] = (1, 4)
    overhead_requests: int = 500
    cap_s: float = 30.0
    seed: int = 0

    @property
    def pages(self) -> int:
        return pages_for_tokens(self.tokens, self.page_size)

    @property
    def request_bytes(self) -> int:
        return self.pages * self.page_size * self.bytes_per_token * self.layers


@dataclass(frozen=True)
class ThroughputRow:
    """One path at one concurrency: the wall time of each run that moved ``nbytes``."""

    name: str
    concurrency: int
    entries: int  # per request
    nbytes: int  # per run (all ``concurrency`` requests)
    walls_s: tuple[float, ...]
    cpu_s: float  # process CPU during the best run

    @property
    def best_gbps(self) -> float:
        return self.nbytes / min(self.walls_s) / 1e9

    @property
    def median_gbps(self) -> float:
        return self.nbytes / statistics.median(self.walls_s) / 1e9


@dataclass(frozen=True)
class LatencyRow:
    """One path's latencies for 1-page requests, in seconds."""

    name: str
    entries: int
    nbytes: int
    samples_s: tuple[float, ...]

    @property
    def ms(self) -> Percentiles:
        return percentiles(self.samples_s)


@dataclass(frozen=True)
class Report:
    config: KVConfig
    throughput: tuple[ThroughputRow, ...]
    overhead: tuple[LatencyRow, ...]


# --- the rig: pools, engines, registry, sender and receiver ------------------------------------


@dataclass(frozen=True)
class _Slot:
    """One request's pages on both sides and the entries the library computes for them."""

    src: list[int]
    dst: list[int]
    tokens: int
    entries: list[Entry]
    aux_index: int | None  # None: a dummy request (no pages, no aux)


@dataclass
class _Rig:
    prefill: KVPool
    decode: KVPool
    p_engine: MooncakeEngine
    d_engine: MooncakeEngine
    sender: KVSender
    receiver: KVReceiver
    bootstrap: str
    raw: _RawPair
    rooms: itertools.count[int]

    def slot(self, src: list[int], dst: list[int], tokens: int, aux_index: int) -> _Slot:
        entries = transfer_entries(self.prefill.layout, self.decode.layout, src, dst)
        return _Slot(src, dst, tokens, entries, aux_index)


def shuffled_runs(first: int, count: int, run: int, rng: random.Random) -> list[int]:
    """Pages ``first .. first+count-1`` as runs of ``run`` pages in random order (0: in order)."""
    pages = list(range(first, first + count))
    if run <= 0:
        return pages
    runs = [pages[i : i + run] for i in range(0, count, run)]
    rng.shuffle(runs)
    return [page for chunk in runs for page in chunk]


def _fill(pool: KVPool) -> None:
    """A byte pattern with every (region, page) stamped, so a misplaced page shows."""
    layout, data = pool.layout, pool.data
    pattern = bytes(range(256)) * (layout.page_bytes // 256 + 1)
    for region in range(layout.num_regions):
        for page in range(layout.num_pages):
            start = region * layout.region_bytes + page * layout.page_bytes
            stamp = region.to_bytes(4, "little") + page.to_bytes(4, "little")
            data[start : start + layout.page_bytes] = (stamp + pattern)[: layout.page_bytes]


_libc = ctypes.CDLL(None)  # Linux only, as the Mooncake wheel
_libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_libc.memcmp.restype = ctypes.c_int


def _landed(entries: Sequence[Entry]) -> bool:
    """Every entry's destination holds its source bytes (memcmp: no copies, ~15 GB/s)."""
    return all(_libc.memcmp(e.dst, e.src, e.length) == 0 for e in entries)


def _clear(entries: Sequence[Entry]) -> None:
    for entry in entries:
        ctypes.memset(entry.dst, 0, entry.length)


@contextlib.asynccontextmanager
async def registry_server() -> AsyncIterator[str]:
    """A standalone registry on 127.0.0.1 (OS-chosen port), on this event loop; yields its URL."""
    app = create_registry_app(RegistrySettings())
    async with serve(app, START_TIMEOUT_S, lifespan="on") as port:
        yield f"http://{LOOPBACK}:{port}"


class _RawPair:
    """Two native engines (the baseline), both pools registered; ``write`` is synchronous."""

    def __init__(self, prefill: KVPool, decode: KVPool) -> None:
        self._natives = raw_engines()
        for native, pool in zip(self._natives, (prefill, decode), strict=True):
            if native.register_memory(pool.layout.base_ptrs[0], pool.layout.total_bytes) != 0:
                raise RuntimeError("the raw Mooncake engine refused to register a pool")
        self._session = f"{LOOPBACK}:{self._natives[1].get_rpc_port()}"

    def write(self, entries: Sequence[Entry]) -> None:
        raw_sync(self._natives[0], self._session, entries)


@contextlib.asynccontextmanager
async def open_rig(cfg: KVConfig) -> AsyncIterator[_Rig]:
    """Pools sized for ``max(cfg.concurrency)`` requests, engines, registry, sender, receiver."""
    slots = max(cfg.concurrency)
    shape = PoolShape(
        layers=cfg.layers,
        page_size=cfg.page_size,
        bytes_per_token=cfg.bytes_per_token,
        pages=cfg.pages * slots + 1,
    )
    prefill, decode = KVPool(shape), KVPool(shape)
    _fill(prefill)
    ctypes.memset(decode.layout.base_ptrs[0], 0, decode.layout.total_bytes)  # fault it in now
    context = zmq.asyncio.Context()
    try:
        async with contextlib.AsyncExitStack() as stack:
            registry = await stack.enter_async_context(registry_server())
            p_engine = await stack.enter_async_context(await MooncakeEngine.start(LOOPBACK))
            d_engine = await stack.enter_async_context(await MooncakeEngine.start(LOOPBACK))
            sender = KVSender(
                context,
                p_engine,
                prefill.layout,
                PrefillRank(page_size=cfg.page_size),
                SenderConfig(
                    registry=registry,
                    aux_item_len=AUX_LEN,
                    aux_slots=slots,
                    bootstrap_timeout_s=TIMEOUT_S,
                    transfer_timeout_s=TIMEOUT_S,
                ),
            )
            receiver = KVReceiver(
                context,
                d_engine,
                decode.layout,
                ReceiverConfig(aux_item_len=AUX_LEN, aux_slots=slots),
            )
            await stack.enter_async_context(sender)
            await stack.enter_async_context(receiver)
            yield _Rig(
                prefill,
                decode,
                p_engine,
                d_engine,
                sender,
                receiver,
                bootstrap_url(registry),
                _RawPair(prefill, decode),
                itertools.count(1),
            )
    finally:
        context.term()


# --- the three paths ---------------------------------------------------------------------------

Path = Callable[[_Rig, Sequence[_Slot]], Awaitable[None]]


async def _raw_path(rig: _Rig, slots: Sequence[_Slot]) -> None:
    rig.raw.write([entry for slot in slots for entry in slot.entries])


async def _engine_path(rig: _Rig, slots: Sequence[_Slot]) -> None:
    session = rig.d_engine.session_id
    await asyncio.gather(*(rig.p_engine.write(session, slot.entries) for slot in slots))


async def _library_path(rig: _Rig, slots: Sequence[_Slot]) -> None:
    await asyncio.gather(*(_library_request(rig, slot) for slot in slots))


async def _library_request(rig: _Rig, slot: _Slot) -> None:
    """One request, handshake to Success; raises when the aux slot did not arrive intact."""
    room = next(rig.rooms)
    aux = None if slot.aux_index is None else room.to_bytes(8, "little")
    async with asyncio.TaskGroup() as group:
        receiving = group.create_task(
            rig.receiver.request(room, rig.bootstrap, slot.dst, slot.aux_index, TIMEOUT_S)
        )
        group.create_task(rig.sender.send(room, slot.src, slot.tokens, is_last_chunk=True, aux=aux))
    if aux is not None and not receiving.result().aux.startswith(aux):
        raise RuntimeError(f"room {room}: the aux slot does not hold what the prefill sent")


PATHS: dict[str, Path] = {RAW: _raw_path, ENGINE: _engine_path, LIBRARY: _library_path}


async def _checked(rig: _Rig, path: Path, slots: Sequence[_Slot]) -> tuple[float, float]:
    """Wall and process CPU seconds of one run of ``path``; checks and clears what landed."""
    wall, cpu = time.perf_counter(), time.process_time()
    await path(rig, slots)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    entries = [entry for slot in slots for entry in slot.entries]
    if not _landed(entries):
        raise RuntimeError("the destination pages do not hold the source bytes")
    _clear(entries)
    return wall, cpu


# --- measurements ------------------------------------------------------------------------------


def request_slots(rig: _Rig, cfg: KVConfig, concurrency: int) -> list[_Slot]:
    """``concurrency`` full requests, each on its own pages (shuffled runs on both sides)."""
    rng = random.Random(cfg.seed)
    n = cfg.pages
    return [
        rig.slot(
            shuffled_runs(i * n, n, cfg.run_pages, rng),
            shuffled_runs(i * n, n, cfg.run_pages, rng),
            cfg.tokens,
            i,
        )
        for i in range(concurrency)
    ]


def _rotated(names: list[str], rep: int) -> list[str]:
    """Who goes first changes every repetition (what runs after a clear, or after a path that
    left the caches cold, is not always the same path)."""
    k = rep % len(names)
    return names[k:] + names[:k]


async def run_throughput(rig: _Rig, cfg: KVConfig, concurrency: int) -> list[ThroughputRow]:
    """The three paths at ``concurrency``, one warm-up run each, then ``cfg.requests`` runs each
    (fewer once ``cfg.cap_s`` has passed), interleaved."""
    slots = request_slots(rig, cfg, concurrency)
    for path in PATHS.values():
        await _checked(rig, path, slots)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in PATHS}
    deadline = time.monotonic() + cfg.cap_s
    for rep in range(cfg.requests):
        for name in _rotated(list(PATHS), rep):
            runs[name].append(await _checked(rig, PATHS[name], slots))
        if time.monotonic() > deadline:
            break
    nbytes = sum(total_bytes(slot.entries) for slot in slots)
    return [
        ThroughputRow(
            name,
            concurrency,
            len(slots[0].entries),
            nbytes,
            tuple(wall for wall, _ in samples),
            min(samples)[1],
        )
        for name, samples in runs.items()
    ]


async def run_overhead(rig: _Rig, cfg: KVConfig, warmup: int = 5) -> list[LatencyRow]:
    """1-page requests through the three paths, plus the library with a dummy request (no pages,
    no aux: the control plane alone), interleaved, ``cfg.overhead_requests`` times (fewer once
    ``cfg.cap_s`` has passed) after ``warmup`` unrecorded rounds."""
    n = cfg.pages
    pages = [
        rig.slot([i % n], [(7 * i + 3) % n], min(cfg.tokens, cfg.page_size), 0) for i in range(16)
    ]
    dummy = _Slot([], [], 0, [], None)
    samples: dict[str, list[float]] = {name: [] for name in (*PATHS, CONTROL)}
    deadline = time.monotonic() + cfg.cap_s
    for i in range(warmup + cfg.overhead_requests):
        slot = pages[i % len(pages)]
        for name, path, one in [
            *((name, path, slot) for name, path in PATHS.items()),
            (CONTROL, _library_path, dummy),
        ]:
            wall, _ = await _checked(rig, path, [one])
            if i >= warmup:
                samples[name].append(wall)
        if time.monotonic() > deadline:
            break
    return [
        LatencyRow(name, len(slot.entries), total_bytes(slot.entries), tuple(values))
        for (name, values), slot in zip(samples.items(), [*[pages[0]] * 3, dummy], strict=True)
    ]


async def run_bench(cfg: KVConfig) -> Report:
    """Every throughput row (per concurrency) and the overhead rows, on one rig."""
    async with open_rig(cfg) as rig:
        throughput: list[ThroughputRow] = []
        for concurrency in cfg.concurrency:
            throughput += await run_throughput(rig, cfg, concurrency)
        overhead = await run_overhead(rig, cfg) if cfg.overhead_requests > 0 else []
    return Report(cfg, tuple(throughput), tuple(overhead))


# --- output ------------------------------------------------------------------------------------


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    return "\n".join(text_table([header, *rows], left=1))


def _throughput_cells(row: ThroughputRow, raw: ThroughputRow) -> list[str]:
    best = min(row.walls_s)
    return [
        row.name,
        str(row.concurrency),
        str(len(row.walls_s)),
        str(row.entries),
        f"{row.nbytes / 2**20:.1f}",
        f"{row.best_gbps:.2f}",
        f"{row.median_gbps:.2f}",
        f"{row.best_gbps / raw.best_gbps:.2f}",
        f"{row.median_gbps / raw.median_gbps:.2f}",
        f"{best * 1e3:.1f}",
        f"{row.cpu_s * 1e3:.0f}",
    ]


def _latency_cells(row: LatencyRow, raw: LatencyRow) -> list[str]:
    ms, base = row.ms, raw.ms
    return [
        row.name,
        str(len(row.samples_s)),
        f"{ms.p50:.3f}",
        f"{ms.p90:.3f}",
        f"{ms.p99:.3f}",
        f"{ms.p50 - base.p50:+.3f}",
    ]


def render(report: Report) -> str:
    cfg = report.config
    head = (
        f"kv_transfer: {cfg.layers} layers x {cfg.tokens} tokens, {cfg.bytes_per_token} "
        f"B/token/layer (K+V), page {cfg.page_size} -> {cfg.pages} pages x "
        f"{2 * cfg.layers} regions = {cfg.request_bytes / 2**20:.1f} MiB/request; "
        f"runs of {cfg.run_pages or 'all'} pages; Mooncake TCP on {LOOPBACK}"
    )
    raws = {row.concurrency: row for row in report.throughput if row.name == RAW}
    out = [
        head,
        "",
        _table(
            [
                "path",
                "C",
                "runs",
                "entries/req",
                "MiB/run",
                "best GB/s",
                "median GB/s",
                "ratio",
                "ratio(med)",
                "best ms",
                "cpu ms",
            ],
            [_throughput_cells(row, raws[row.concurrency]) for row in report.throughput],
        ),
    ]
    if report.overhead:
        one = report.overhead[0]
        out += [
            "",
            f"per-request overhead, 1-page requests ({one.entries} entries, "
            f"{one.nbytes / 2**20:.2f} MiB), ms:",
            _table(
                ["path", "n", "p50", "p90", "p99", "p50 - raw"],
                [_latency_cells(row, one) for row in report.overhead],
            ),
        ]
    out += [
        "",
        "ratio = GB/s / raw GB/s at the same C (best; median); target >= 0.90. "
        "library = KVReceiver.request + KVSender.send, handshake to Success.",
    ]
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None = None) -> KVConfig:
    parser = argparse.ArgumentParser(
        prog="bench.transfer.kv_transfer", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--layers", type=int, default=KVConfig.layers)
    parser.add_argument("--tokens", type=int, default=KVConfig.tokens)
    parser.add_argument(
        "--bytes-per-token-per-layer",
        type=int,
        default=KVConfig.bytes_per_token,
        help="K+V bytes of one token in one layer (a multiple of 16)",
    )
    parser.add_argument("--page-size", type=int, default=KVConfig.page_size)
    parser.add_argument(
        "--run-pages",
        type=int,
        default=KVConfig.run_pages,
        help="pages per contiguous run of a request (0: all contiguous)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=KVConfig.requests,
        help="timed runs per path and concurrency",
    )
    parser.add_argument(
        "--concurrency",
        type=positive_ints,
        default=KVConfig.concurrency,
        help="comma-separated requests in flight at once, e.g. 1,4",
    )
    parser.add_argument("--overhead-requests", type=int, default=KVConfig.overhead_requests)
    parser.add_argument(
        "--cap",
        type=float,
        default=KVConfig.cap_s,
        help="seconds after which a measurement stops repeating",
    )
    parser.add_argument("--seed", type=int, default=KVConfig.seed)
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests needs a value >= 1")
    return KVConfig(
        layers=args.layers,
        tokens=args.tokens,
        bytes_per_token=args.bytes_per_token_per_layer,
        page_size=args.page_size,
        run_pages=args.run_pages,
        requests=args.requests,
        concurrency=args.concurrency,
        overhead_requests=args.overhead_requests,
        cap_s=args.cap,
        seed=args.seed,
    )


def main(argv: Sequence[str] | None = None) -> None:
    print(render(asyncio.run(run_bench(parse_args(argv)))), flush=True)


if __name__ == "__main__":
    main()
