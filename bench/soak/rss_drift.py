"""The router's RSS curve under steady mixed traffic, without faults: a leak or a plateau?

    python -m bench.soak.rss_drift [--engine vllm-mooncake] [--requests 20000] [--every 1000]
                                   [--users 16] [--warmup 1000] [--router-arg=FLAG ...]
                                   [--worker-arg=FLAG ...] [--json PATH]

Starts the soak's ``pd-cluster`` (``bench.soak.cluster``: 2P2D, the soak's small workers), sends
``--warmup`` requests, then ``--requests`` distinct mixed requests (``bench.soak.traffic``) in
chunks of ``--every``, and after each chunk reads the router's RSS, fds and threads from
``/proc``. Prints one line per sample (requests -> RSS) and the drift of the second half (the
steady state): a leak keeps climbing there, bounded caches flatten out. Bounded in time by
``--max-seconds``.

Then the KV page canary: once the traffic stopped, every decode must be idle within
``--idle-seconds`` (well under the workers' transfer timeout): no KV page referenced (cached pages
nobody uses are evictable: not counted), none quarantined, no transfer room open. Pages freed only
by a transfer deadline count as leaked: a pool short of them answers 503 under load. The run exits
1 when a decode is not idle. Prefills are shown too: a computed prompt whose decode never pulls
(the decode leg failed) legitimately holds its pages until the transfer deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.common.cli import exit_on_failure, sigterm_raises
from bench.soak.cluster import ProcStats, SoakCluster, WorkerProc
from bench.soak.main import SoakConfig
from bench.soak.traffic import Clock, Traffic

__all__ = ["Drift", "IdlePages", "Point", "idle_line", "idle_pages", "leaked", "main", "measure"]


@dataclass(frozen=True)
class Point:
    requests: int  # sent after the warm-up
    rss_kib: int
    fds: int
    threads: int
    ok: int  # of the chunk
    wall_s: float


@dataclass(frozen=True)
class IdlePages:
    """A worker's KV once the traffic stopped (all 0 when nothing leaked)."""

    role: str
    port: int
    used_tokens: int  # in pages requests reference (evictable cached pages excluded)
    quarantined_pages: int
    open_rooms: int

    @property
    def idle(self) -> bool:
        return not (self.used_tokens or self.quarantined_pages or self.open_rooms)


@dataclass(frozen=True)
class Drift:
    points: list[Point]
    idle: list[IdlePages]  # every worker after the run (the KV page canary)


async def _chunk(cluster: SoakCluster, requests: int, users: int, seed: int) -> int:
    """Send ``requests`` mixed requests; the number answered ok (the commonest failure is
    printed)."""
    traffic = Traffic(
        cluster.url,
        requests=requests,
        rate=10_000.0,
        users=users,
        deadline_s=60.0,
        seed=seed,
        model=SoakConfig().params.model,
        clock=Clock(),
    )
    outcomes = await traffic.run()
    failures = Counter(f"{o.kind} {o.status} {o.detail[:120]}" for o in outcomes if not o.ok)
    for failure, count in failures.most_common(1):
        print(f"  {count} failed, commonest: {failure}", flush=True)
    return len(outcomes) - failures.total()


def _point(sent: int, stats: ProcStats, ok: int, t0: float) -> Point:
    return Point(sent, stats.rss_kib, stats.fds, stats.threads, ok, time.monotonic() - t0)


async def _get(http: httpx.AsyncClient, url: str) -> Any:
    response = await http.get(url)
    response.raise_for_status()
    return response.json()


async def _worker_pages(http: httpx.AsyncClient, worker: WorkerProc) -> IdlePages:
    health = await _get(http, f"{worker.url}/health")
    loads = await _get(http, f"{worker.url}/v1/loads?include=core")
    return IdlePages(
        worker.role,
        worker.port,
        int(loads["aggregate"]["total_used_tokens"]),
        int(health["quarantined_pages"]),
        int(health["open_rooms"]),
    )


async def idle_pages(cluster: SoakCluster, settle_s: float) -> list[IdlePages]:
    """Every worker's KV pages, polled until the decodes are idle or ``settle_s`` passed."""
    deadline = time.monotonic() + settle_s
    async with httpx.AsyncClient(timeout=5.0) as http:
        while True:
            pages = [await _worker_pages(http, worker) for worker in cluster.workers()]
            if not leaked(pages) or time.monotonic() > deadline:
                return pages
            await asyncio.sleep(0.25)


async def _measure(
    cluster: SoakCluster, warmup: int, requests: int, every: int, users: int, max_s: float
) -> list[Point]:
    t0 = time.monotonic()
    ok = await _chunk(cluster, warmup, users, seed=1) if warmup else 0
    points = [_point(0, cluster.router_stats(), ok, t0)]
    print(_line(points[0]), flush=True)
    sent, seed = 0, 2
    while sent < requests and time.monotonic() - t0 < max_s:
        size = min(every, requests - sent)
        ok = await _chunk(cluster, size, users, seed)
        sent, seed = sent + size, seed + 1
        points.append(_point(sent, cluster.router_stats(), ok, t0))
        print(_line(points[-1]), flush=True)
    return points


def _line(p: Point) -> str:
    return (
        f"{p.requests:>7} req  RSS {p.rss_kib / 1024:7.1f} MiB  fds {p.fds:4}  "
        f"threads {p.threads:3}  ok {p.ok:5}  t {p.wall_s:6.1f} s"
    )


def leaked(pages: Sequence[IdlePages]) -> list[IdlePages]:
    """The decodes still holding KV (pages, quarantine, rooms) once the traffic stopped."""
    return [p for p in pages if p.role == "decode" and not p.idle]


def idle_line(p: IdlePages) -> str:
    state = "idle" if p.idle else "NOT IDLE" + (" (leaked KV pages)" if p.role == "decode" else "")
    return (
        f"  {p.role:7} :{p.port}  used tokens {p.used_tokens:6}  quarantined pages "
        f"{p.quarantined_pages:4}  open rooms {p.open_rooms:3}  {state}"
    )


def second_half_drift(points: Sequence[Point]) -> float:
    """RSS growth from the half-way sample to the last, relative to the half-way one."""
    mid = points[len(points) // 2]
    return points[-1].rss_kib / mid.rss_kib - 1.0


async def _run(
    cluster: SoakCluster,
    warmup: int,
    requests: int,
    every: int,
    users: int,
    max_s: float,
    idle_s: float,
) -> Drift:
    points = await _measure(cluster, warmup, requests, every, users, max_s)
    return Drift(points, await idle_pages(cluster, idle_s))


def measure(
    engine: str,
    *,
    requests: int,
    every: int,
    users: int,
    warmup: int,
    router_args: Sequence[str],
    worker_args: Sequence[str] = (),
    max_s: float,
    idle_s: float = 10.0,
) -> Drift:
    """The RSS curve, and every worker's KV pages once idle (given ``idle_s`` to get there)."""
    cfg = SoakConfig()
    workers = [*cfg.worker_args, *worker_args]
    with sigterm_raises():
        cluster = SoakCluster(engine, cfg.prefill, cfg.decode, router_args, workers)
        try:
            return asyncio.run(_run(cluster, warmup, requests, every, users, max_s, idle_s))
        finally:
            cluster.stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="bench.soak.rss_drift", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--engine", default="vllm-mooncake", choices=("sglang", "vllm-mooncake"))
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--every", type=int, default=1000, help="requests between samples")
    parser.add_argument("--users", type=int, default=16, help="most requests in flight")
    parser.add_argument("--warmup", type=int, default=1000, help="requests before the baseline")
    parser.add_argument("--max-seconds", type=float, default=540.0, help="stop sampling after")
    parser.add_argument("--router-arg", action="append", default=[], metavar="ARG")
    parser.add_argument(
        "--worker-arg", action="append", default=[], metavar="ARG", help="after the soak's"
    )
    parser.add_argument(
        "--idle-seconds", type=float, default=10.0, help="for the workers to be idle after"
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the curve here")
    args = parser.parse_args(argv)
    if min(args.requests, args.every, args.users) < 1 or min(args.warmup, args.idle_seconds) < 0:
        parser.error("--requests, --every and --users must be positive, --warmup >= 0")
    with exit_on_failure("rss_drift"):
        drift = measure(
            args.engine,
            requests=args.requests,
            every=args.every,
            users=args.users,
            warmup=args.warmup,
            router_args=["--health-interval", "1", *args.router_arg],
            worker_args=args.worker_arg,
            max_s=args.max_seconds,
            idle_s=args.idle_seconds,
        )
    points = drift.points
    total = points[-1].rss_kib / points[0].rss_kib - 1.0
    print(f"drift: {100 * total:+.1f}% overall, {100 * second_half_drift(points):+.1f}% 2nd half")
    print(f"KV pages {args.idle_seconds:g} s after the traffic:")
    for worker in drift.idle:
        print(idle_line(worker))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(p) for p in points], indent=2))
    if leaked(drift.idle):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
