"""Throughput and CPU per request of the router at N = 1, 2, 4, ... processes (``--workers``).

    python -m bench.load.workers [--workers-list 1,2,4,8,16] [--sockets reuseport,shared]
                                 [--engine vllm-mooncake|sglang] [--fake-procs auto]
                                 [--loadgen-procs auto] [--concurrency 32] [--requests 200000]
                                 [--duration 10] [--repeats 3] [--stream] [--json OUT] [--quick]

F fake prefill and F fake decode engines (``testkit/fake_engine.py``, fast mode), each its own
process and port, all given to every router (round robin). Per N, per ``--worker-sockets``
mode and per repeat, a fresh router serves a group of L load generators
(``bench.load.loadgen_group``) that start their measured phase together, each bounded in
requests and time, with ``--concurrency`` users per router process in all. With enough cores
(N + 4) the router's process tree is pinned to the first N cores and the fakes and load
generators to the rest. CPU time comes from ``/proc``: the router's whole tree, each serving
process, the supervisor alone (the serial part), each fake. Every process is stopped on exit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.common.cli import positive_ints, run_in_log_dir, write_json
from bench.common.process import BenchError
from bench.load import run
from bench.load.loadgen_group import Group, GroupSpec
from bench.load.worker_procs import pin, pin_tree, processes_cpu, serving_processes, tree_cpu
from bench.load.workers_report import (
    SINGLE,
    Measured,
    Report,
    RunRecord,
    make_record,
    make_rows,
    render,
    render_markdown,
)
from bench.load.workers_stack import (
    Fakes,
    Placement,
    Router,
    auto_fakes,
    auto_loadgens,
    placement,
    running_fakes,
    running_router,
)

__all__ = ["Config", "config_from_args", "main", "run_bench"]

ENGINES = ("vllm-mooncake", "sglang")
SOCKETS = ("reuseport", "shared")
WARM_TIMEOUT_S, COLLECT_SLACK_S = 60.0, 30.0


@dataclass(frozen=True)
class Config:
    """One invocation, from the command line; ``None`` counts are chosen automatically."""

    engine: str = "vllm-mooncake"
    workers: tuple[int, ...] = (1, 2)
    sockets: tuple[str, ...] = SOCKETS
    fake_procs: int | None = None
    loadgen_procs: int | None = None
    users: int = 32  # closed-loop users per router process
    requests: int = 200_000  # measured requests per run, all load generators together
    duration: float = 10.0
    warmup: int = 2
    tokens: int = 16
    stream: bool = False  # non-streaming: the fakes cost ~1x the router per request, not ~1.6x
    repeats: int = 3
    startup_timeout: float = 60.0
    json_out: Path | None = None
    log_dir: Path | None = None


# ---------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------


def _group_spec(cfg: Config, port: int, n: int, loadgens: int) -> GroupSpec:
    users = cfg.users * n
    procs = min(loadgens, users, cfg.requests)
    return GroupSpec(
        port, users, cfg.requests, cfg.duration, cfg.warmup, cfg.tokens, cfg.stream, procs
    )


def measure(
    cfg: Config, fakes: Fakes, router: Router, place: Placement, loadgens: int, log_dir: Path
) -> Measured:
    """One synchronized load-generator group against ``router``; CPU read at the common
    start and after the last member ended."""
    n, root, serving = len(router.serving), router.child.pid, router.serving
    with Group(_group_spec(cfg, router.port, n, loadgens), log_dir, place.helper_cpus) as group:
        group.wait_warm(WARM_TIMEOUT_S + cfg.warmup * cfg.users * n * 0.01)
        t0, cpu0, fakes0 = time.monotonic(), tree_cpu(root, serving), processes_cpu(fakes.pids)
        group.go()
        shares = group.collect(cfg.duration + COLLECT_SLACK_S)
        t1, cpu1, fakes1 = time.monotonic(), tree_cpu(root, serving), processes_cpu(fakes.pids)
    return Measured(
        shares=shares,
        cpu_window_s=t1 - t0,
        tree_s=cpu1.tree - cpu0.tree,
        root_s=cpu1.root - cpu0.root,
        serving_s=[cpu1.serving[pid] - cpu0.serving[pid] for pid in serving],
        fakes_s=[fakes1[pid] - fakes0[pid] for pid in fakes.pids],
        supervised=n > 1,
    )


def _after(router: Router, n: int) -> str | None:
    code = router.child.exit_code
    if code is not None:
        return f"the router exited with code {code}\n{router.child.log_tail()}"
    now = serving_processes(router.child.pid, router.port, supervised=n > 1)
    if now != router.serving:
        return f"router processes changed during the run: {router.serving} -> {now}"
    return None


def run_one(
    cfg: Config, fakes: Fakes, where: RunRecord, place: Placement, log_dir: Path
) -> RunRecord:
    """One fresh router, one measurement; a failed run (start-up, errors, a process that died
    or was replaced) comes back as a record that says so."""
    loadgens = cfg.loadgen_procs or auto_loadgens(where.n, len(place.helper_cpus))
    try:
        with running_router(
            cfg.engine, fakes, where.n, where.sockets, log_dir, cfg.startup_timeout
        ) as router:
            if place.pinned:
                pin_tree(router.child.pid, place.router)
            record = make_record(where, measure(cfg, fakes, router, place, loadgens, log_dir))
            problem = _after(router, where.n)
    except BenchError as exc:
        return RunRecord(where.n, where.sockets, where.repeat, failure=str(exc))
    if problem is not None:
        record = RunRecord(where.n, where.sockets, where.repeat, failure=problem)
    return record


# ---------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------


def modes(cfg: Config, n: int, repeat: int) -> list[str]:
    """The socket modes of N in this repeat, the order rotated every repeat."""
    if n == 1:
        return [SINGLE]
    shift = repeat % len(cfg.sockets)
    return [*cfg.sockets[shift:], *cfg.sockets[:shift]]


def _summary(record: RunRecord) -> str:
    if not record.ok:
        return f"FAILED: {(record.failure or '').splitlines()[0]}"
    procs = " ".join(f"{us:.0f}" for us in record.process_us)
    sup = "" if record.supervisor_us is None else f", supervisor {record.supervisor_us:.2f}"
    return (
        f"{record.rps:.0f} req/s, CPU {record.router_us or 0:.0f} µs/req (processes {procs}"
        f"{sup}), p50/p99 {record.p50_ms or 0:.2f}/{record.p99_ms or 0:.2f} ms, "
        f"busy fakes {100 * (record.fakes_busy_max or 0):.0f}% "
        f"loadgens {100 * (record.loadgen_busy_max or 0):.0f}% ({record.loadgens})"
    )


def _one_n(
    cfg: Config,
    fakes: Fakes,
    n: int,
    cpus: Sequence[int],
    log_dir: Path,
    say: Callable[[str], None],
) -> list[RunRecord]:
    place = placement(n, cpus)
    for pid in fakes.pids:
        pin(pid, place.helper_cpus)
    records = []
    for repeat in range(cfg.repeats):
        for sockets in modes(cfg, n, repeat):
            record = run_one(cfg, fakes, RunRecord(n, sockets, repeat), place, log_dir)
            say(f"  N={n:<3} {sockets:<9} repeat {repeat}: {_summary(record)}")
            records.append(record)
            fakes.check_alive()
    return records


def _report(
    cfg: Config, fake_pairs: int, placements: dict[str, str], records: list[RunRecord]
) -> Report:
    failures = [f"N={r.n} {r.sockets} repeat {r.repeat}: {r.failure}" for r in records if not r.ok]
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(cfg).items()}
    environment = {**run.environment(), "fake_pairs": fake_pairs}
    return Report(config, environment, placements, make_rows(records), records, failures)


def run_bench(
    cfg: Config,
    log_dir: Path,
    say: Callable[[str], None],
    checkpoint: Callable[[Report], None] = lambda _report: None,
) -> Report:
    """Start the fakes, run every N, stop everything; the report. ``checkpoint`` gets the
    report so far after each N."""
    cpus = sorted(os.sched_getaffinity(0))
    count = cfg.fake_procs or auto_fakes(max(cfg.workers), len(cpus))
    placements = {str(n): placement(n, cpus).describe(n) for n in cfg.workers}
    records: list[RunRecord] = []
    with running_fakes(cfg.engine, cfg.tokens, count, log_dir, cfg.startup_timeout) as fakes:
        say(f"{count} fake prefill + {count} fake decode processes ({cfg.engine})")
        for n in cfg.workers:
            say(f"N={n}: {placements[str(n)]}")
            records += _one_n(cfg, fakes, n, cpus, log_dir, say)
            checkpoint(_report(cfg, count, placements, records))
    return _report(cfg, count, placements, records)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _count_or_auto(text: str) -> int | None:
    if text == "auto":
        return None
    (value,) = positive_ints(text)
    return value


def _socket_modes(text: str) -> tuple[str, ...]:
    values = tuple(part.strip() for part in text.split(",") if part.strip())
    if not values or not set(values) <= set(SOCKETS):
        raise argparse.ArgumentTypeError(f"expected a list of {', '.join(SOCKETS)}")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.load.workers",
        description="Router throughput and CPU per request at N processes (--workers).",
    )
    p.add_argument("--workers-list", type=positive_ints, default=None, help="e.g. 1,2,4,8,16")
    p.add_argument("--sockets", type=_socket_modes, default=SOCKETS, help="reuseport,shared")
    p.add_argument("--engine", choices=ENGINES, default="vllm-mooncake")
    p.add_argument("--fake-procs", type=_count_or_auto, default=None, help="pairs, or auto")
    p.add_argument("--loadgen-procs", type=_count_or_auto, default=None, help="N, or auto")
    p.add_argument("--concurrency", type=int, default=32, help="users per router process")
    p.add_argument("--requests", type=int, default=None, help="max measured requests per run")
    p.add_argument("--duration", type=float, default=None, help="max measured seconds per run")
    p.add_argument("--warmup", type=int, default=2, help="uncounted requests per user")
    p.add_argument("--tokens", type=int, default=16, help="max_tokens of each request")
    p.add_argument("--stream", action="store_true", help="SSE answers (default: whole ones)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--startup-timeout", type=float, default=60.0)
    p.add_argument("--quick", action="store_true", help="one short repeat")
    p.add_argument("--json", type=Path, default=None, metavar="OUT")
    p.add_argument("--log-dir", type=Path, default=None, help="keep process logs here")
    return p


def config_from_args(argv: Sequence[str] | None) -> Config:
    args = _parser().parse_args(argv)
    quick = args.quick
    cores = len(os.sched_getaffinity(0))
    return Config(
        engine=args.engine,
        workers=args.workers_list or ((1, 2) if cores < 8 else (1, 2, 4, 8, 16)),
        sockets=args.sockets,
        fake_procs=args.fake_procs,
        loadgen_procs=args.loadgen_procs,
        users=max(1, args.concurrency),
        requests=max(1, args.requests or (20_000 if quick else 200_000)),
        duration=args.duration or (2.0 if quick else 10.0),
        warmup=max(0, args.warmup),
        tokens=args.tokens,
        stream=args.stream,
        repeats=max(1, args.repeats or (1 if quick else 3)),
        startup_timeout=args.startup_timeout,
        json_out=args.json,
        log_dir=args.log_dir,
    )


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _execute(cfg: Config, log_dir: Path) -> int:
    json_out = cfg.json_out

    def checkpoint(report: Report) -> None:
        if json_out is not None:
            write_json(report, json_out)  # so far: a run cut short still leaves its N done

    try:
        report = run_bench(cfg, log_dir, _say, checkpoint)
    except BenchError as exc:
        _say(f"bench.load.workers failed: {exc}")
        return 1
    print(render(report), "", render_markdown(report.rows), sep="\n", flush=True)
    if json_out is not None:
        write_json(report, json_out)
        _say(f"report written to {json_out}")
    return 1 if report.failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    cfg = config_from_args(argv)
    return run_in_log_dir(
        lambda log_dir: _execute(cfg, log_dir), cfg.log_dir, "pd-workers-", "bench.load.workers"
    )


if __name__ == "__main__":
    sys.exit(main())
