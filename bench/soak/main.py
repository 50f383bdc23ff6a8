"""Fault-matrix soak: mixed requests through ``pd-cluster`` while a schedule injects faults.

    python -m bench.soak [--requests 10000] [--engines sglang,vllm-mooncake] [--users 32]
                         [--deadline 60] [--json PATH] [--router-arg=FLAG ...]
    python -m bench.soak --short          # the suite's version: ~600 requests, sglang

Per engine protocol (the requests split evenly), a fresh ``pd-cluster --restart-workers`` 2P2D
(small KV pools; every worker with ``--fault-api``), the router on a real etcd
(``testkit.etcd_server``, when the schedule has an etcd fault) with a 256 MiB body memory budget
and 512 connections at most; after a warm-up, mixed requests (stream or not, chat or
completions) at a fixed rate spread over the fault schedule (``bench.soak.faults``: prefill 5xx,
decode SIGKILL mid-stream, a frozen prefill (1 of 2), etcd stopped, empty etcd, slow decode,
KV-pool-full burst, large bodies, a chunked trailer flood, idle keep-alive connections,
slowloris), a monitor sampling the router's and workers' state, then a settle period. Reports
per fault (table: start, end, errors during, errors after the detection window, recovery,
whether its targets were met: ``bench.soak.rows``) and per run: requests hung past their
deadline, requests without a complete answer or a clean error (``bench.soak.traffic``), the
router's fd, RSS and thread counts before and after (``bench.soak.report``). Exit status 1 when
a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.common.cli import exit_on_failure, sigterm_raises
from bench.common.process import BenchError
from bench.common.prometheus import value
from bench.soak.cluster import Monitor, ProcStats, SoakCluster, inflight
from bench.soak.faults import ETCD_FAULTS, FULL, SHORT, FaultParams, FaultSpec, run_schedule
from bench.soak.report import PhaseResult, bad_samples, counts, fault_row, render, targets
from bench.soak.traffic import Clock, Outcome, Traffic
from testkit.etcd_server import EtcdServer

__all__ = ["SoakConfig", "main", "run_soak"]

ENGINES = ("sglang", "vllm-mooncake")
QUIET_S = 6.0  # before the baseline: past the router's upstream keep-alive (4 s)
BODY_MEMORY_FLAG = "--max-body-memory"
ROUTER_DEFAULT_BODY_MEMORY = 2 * 2**30  # the router's own default


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 10_000
    engines: tuple[str, ...] = ENGINES
    schedule: tuple[FaultSpec, ...] = FULL
    tail_s: float = 15.0  # traffic after the last fault's planned end
    users: int = 32
    warmup: int = 100
    deadline_s: float = 60.0
    settle_s: float = 30.0
    fd_slack: int = 0
    prefill: int = 2
    decode: int = 2
    router_args: tuple[str, ...] = (
        "--health-interval", "1",
        BODY_MEMORY_FLAG, str(256 * 2**20),  # one large body at a time: the row's RSS bound
        "--max-connections", "512",  # the idle keep-alive flood goes past it
    )  # fmt: skip
    worker_args: tuple[str, ...] = (
        "--layers", "2", "--bytes-per-token", "256", "--pages", "256",
        "--decode-s-per-token", "0.005",
    )  # fmt: skip
    params: FaultParams = FaultParams()

    @property
    def uses_etcd(self) -> bool:
        return any(f.kind in ETCD_FAULTS for f in self.schedule)

    @property
    def planned_s(self) -> float:
        return max(f.at_s + f.duration_s for f in self.schedule) + self.tail_s


SHORT_CONFIG = SoakConfig(
    requests=600,
    engines=("sglang",),
    schedule=SHORT,
    tail_s=5.0,  # the empty etcd's row watches 3 s past its recovery
    users=16,
    warmup=32,
    deadline_s=20.0,
    settle_s=20.0,
    fd_slack=4,
    params=FaultParams(
        deadline_s=20.0, burst_requests=12, slowloris_connections=20, trailer_bytes=64 * 2**20
    ),
)


def body_budget_mib(router_args: Sequence[str]) -> float:
    """The router's body memory budget in MiB, from its arguments (the last one wins)."""
    budget = ROUTER_DEFAULT_BODY_MEMORY
    for index, arg in enumerate(router_args):
        if arg == BODY_MEMORY_FLAG and index + 1 < len(router_args):
            budget = int(router_args[index + 1])
        elif arg.startswith(BODY_MEMORY_FLAG + "="):
            budget = int(arg.split("=", 1)[1])
    return budget / 2**20


async def _warm_up(cfg: SoakConfig, cluster: SoakCluster) -> None:
    clock = Clock()
    traffic = Traffic(
        cluster.url,
        requests=cfg.warmup,
        rate=1000.0,
        users=cfg.users,
        deadline_s=cfg.deadline_s,
        seed=0,
        model=cfg.params.model,
        clock=clock,
    )
    outcomes = await traffic.run()
    if not any(o.ok for o in outcomes):
        raise BenchError(cluster.child.describe(f"warm-up failed: {bad_samples(outcomes)}"))


async def _router_stats(cluster: SoakCluster) -> ProcStats:
    """The router process's resources with its asyncio task count (``pdr_event_loop_tasks``)."""
    stats = cluster.router_stats()
    async with httpx.AsyncClient(timeout=5.0) as http:
        text = (await http.get(f"{cluster.url}/metrics")).text
    tasks = value(text, "pdr_event_loop_tasks")
    return dataclasses.replace(stats, tasks=-1 if tasks is None else int(tasks))


async def _quiet_stats(cluster: SoakCluster, window_s: float) -> ProcStats:
    """The router's resources with the fewest fds (then tasks) over ``window_s`` (idle
    connections close, probes end)."""
    deadline = time.monotonic() + window_s
    best = await _router_stats(cluster)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        best = min(best, await _router_stats(cluster), key=lambda stats: (stats.fds, stats.tasks))
    return best


async def _inflight(url: str) -> int:
    async with httpx.AsyncClient(timeout=5.0) as http:
        return inflight((await http.get(f"{url}/status/data")).json())


async def _settle(
    cfg: SoakConfig, cluster: SoakCluster, before: ProcStats
) -> tuple[ProcStats, int]:
    """The router's resources once back to ``before`` (fds, nothing in flight), or at the end of
    the settle period."""
    deadline = time.monotonic() + cfg.settle_s
    while True:
        after, busy = await _router_stats(cluster), await _inflight(cluster.url)
        if after.fds <= before.fds + cfg.fd_slack and after.tasks <= before.tasks and not busy:
            return after, busy
        if time.monotonic() > deadline:
            return after, busy
        await asyncio.sleep(0.5)


async def _soak(
    cfg: SoakConfig, cluster: SoakCluster, etcd: EtcdServer | None, requests: int, seed: int
) -> tuple[list[Outcome], list[Any], Monitor, float, int]:
    clock = Clock()
    params = dataclasses.replace(cfg.params, body_budget_mib=body_budget_mib(cfg.router_args))
    traffic = Traffic(
        cluster.url,
        requests=requests,
        rate=requests / cfg.planned_s,
        users=cfg.users,
        deadline_s=cfg.deadline_s,
        seed=seed,
        model=cfg.params.model,
        clock=clock,
    )
    monitor, stop = Monitor(cluster, clock), asyncio.Event()
    watching = asyncio.create_task(monitor.run(stop))
    mid = asyncio.create_task(_rss_at(cluster, cfg.planned_s / 2))
    scheduled = asyncio.Event()  # the last fault ended tail_s ago: the traffic may stop

    async def faults() -> list[Any]:
        runs = await run_schedule(cluster, etcd, cfg.schedule, params, clock)
        await asyncio.sleep(cfg.tail_s)
        scheduled.set()
        return runs

    try:
        outcomes, runs = await asyncio.gather(traffic.run(scheduled), faults())
    finally:
        stop.set()
        await watching
    return outcomes, runs, monitor, clock(), await mid


async def _rss_at(cluster: SoakCluster, delay_s: float) -> int:
    await asyncio.sleep(delay_s)
    return cluster.router_stats().rss_kib


async def _phase(
    cfg: SoakConfig, cluster: SoakCluster, etcd: EtcdServer | None, engine: str, requests: int
) -> PhaseResult:
    await _warm_up(cfg, cluster)
    before = await _quiet_stats(cluster, QUIET_S)
    outcomes, runs, monitor, wall, mid_rss = await _soak(cfg, cluster, etcd, requests, len(engine))
    if not cluster.alive():
        raise BenchError(cluster.child.describe("pd-cluster stopped during the soak"))
    after, busy = await _settle(cfg, cluster, before)
    sent = [o for run in runs for o in run.outcomes]
    return PhaseResult(
        engine=engine,
        wall_s=wall,
        main=counts(outcomes),
        fault_requests=counts(sent),
        statuses={str(k): v for k, v in sorted(Counter(o.status for o in outcomes + sent).items())},
        faults=[fault_row(run, monitor.samples, outcomes) for run in runs],
        router_before=before,
        router_mid_rss_kib=mid_rss,
        router_after=after,
        inflight_after=busy,
        bad_samples=bad_samples(outcomes + sent),
    )


@contextlib.contextmanager
def _etcd(cfg: SoakConfig) -> Iterator[EtcdServer | None]:
    if not cfg.uses_etcd:
        yield None
        return
    with EtcdServer() as etcd:
        yield etcd


def _router_args(cfg: SoakConfig, etcd: EtcdServer | None, engine: str) -> list[str]:
    registry = [] if etcd is None else ["--registry", f"{etcd.url}/pdr-soak/{uuid.uuid4().hex}"]
    return [*cfg.router_args, *registry]


def run_soak(cfg: SoakConfig) -> list[PhaseResult]:
    """One phase per engine protocol, each on a fresh cluster (always stopped)."""
    phases = []
    share, extra = divmod(cfg.requests, len(cfg.engines))
    with sigterm_raises(), _etcd(cfg) as etcd:
        for index, engine in enumerate(cfg.engines):
            cluster = SoakCluster(
                engine, cfg.prefill, cfg.decode, _router_args(cfg, etcd, engine), cfg.worker_args
            )
            try:
                requests = share + (index < extra)
                phases.append(asyncio.run(_phase(cfg, cluster, etcd, engine, requests)))
            finally:
                cluster.stop()
    return phases


def _as_json(cfg: SoakConfig, phases: Sequence[PhaseResult]) -> dict[str, Any]:
    t = targets(phases)
    return {
        "phases": [
            {
                **dataclasses.asdict(p),
                "fd_leak": p.fd_leak,
                "task_leak": p.task_leak,
                "rss_drift": p.rss_drift,
            }
            for p in phases
        ],
        "targets": dataclasses.asdict(t),
        "met": t.met(cfg.fd_slack),
    }


def parse_args(argv: Sequence[str] | None = None) -> tuple[SoakConfig, Path | None]:
    parser = argparse.ArgumentParser(prog="bench.soak", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--short", action="store_true", help="the test suite's short version")
    parser.add_argument("--requests", type=int, help="requests in all, split between engines")
    parser.add_argument("--engines", help="comma-separated pd-cluster --engine values")
    parser.add_argument("--users", type=int, help="most requests in flight")
    parser.add_argument("--deadline", type=float, help="per-request deadline, s (hung beyond)")
    parser.add_argument(
        "--router-arg",
        action="append",
        metavar="ARG",
        help="router argument, replacing the defaults (SoakConfig.router_args) (repeat)",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the result here")
    args = parser.parse_args(argv)
    cfg = SHORT_CONFIG if args.short else SoakConfig()
    changes: dict[str, Any] = {}
    if args.requests is not None:
        changes["requests"] = args.requests
    if args.engines:
        changes["engines"] = tuple(e.strip() for e in args.engines.split(",") if e.strip())
        if set(changes["engines"]) - set(ENGINES) or not changes["engines"]:
            parser.error(f"--engines: choose from {','.join(ENGINES)}")
    if args.users is not None:
        changes["users"] = args.users
    if args.deadline is not None:
        changes["deadline_s"] = args.deadline
        changes["params"] = dataclasses.replace(cfg.params, deadline_s=args.deadline)
    if args.router_arg:
        changes["router_args"] = tuple(args.router_arg)
    cfg = dataclasses.replace(cfg, **changes)
    if cfg.requests < len(cfg.engines) or cfg.users < 1 or cfg.deadline_s <= 0:
        parser.error("--requests, --users and --deadline must be positive")
    return cfg, args.json


def main(argv: Sequence[str] | None = None) -> None:
    cfg, json_path = parse_args(argv)
    with exit_on_failure("soak"):
        phases = run_soak(cfg)
    print(render(phases, cfg.fd_slack), flush=True)
    if json_path is not None:
        json_path.write_text(json.dumps(_as_json(cfg, phases), indent=2))
    if not targets(phases).met(cfg.fd_slack):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
