"""One-command benchmark: a fake decode engine directly vs the router in front of fake engines.

    python -m bench.load.run [--engine sglang] [--concurrency 1,32,128] [--requests 2000]
                             [--duration 15] [--tokens 16] [--json OUT] [--quick]

Both in the same invocation, on loopback: the router in front of a fake prefill and a fake
decode engine, and the fake decode alone. Every process (fakes, router, load generator) is a
subprocess in its own session; all are stopped (SIGTERM, then SIGKILL after a grace period) on
success, error, Ctrl-C or SIGTERM. The load generator samples the CPU time of the router and the
engines itself, exactly at the start and end of its measured phase, so warmup and start-up are
not charged.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import msgspec

from bench.common.cli import positive_ints, run_in_log_dir
from bench.common.process import (
    LOOPBACK,
    REPO_ROOT,
    BenchError,
    Child,
    free_ports,
    set_parent_death_signal,
)
from bench.common.ready import wait_http_ok
from bench.common.table import text_table
from bench.load.loadgen import LoadResult

__all__ = ["BenchConfig", "BenchError", "Report", "main", "run_bench"]

ENGINES = ("sglang", "vllm-mooncake", "vllm-nixl")
MODEL = "fake-model"
EVENT_CONCURRENCY = 32
STOP_GRACE_S = 5.0
DEFAULT_ROUTER_CMD = (
    "{python} -m router --prefill {prefill_url} {bootstrap_port} --decode {decode_url} "
    "--engine {engine} --policy round_robin --port {router_port} --log-level warning"
)

# Targets, checked in targets().
TARGET_CPU_MS_PER_REQUEST = 0.5
TARGET_CPU_US_PER_EVENT = 10.0
TARGET_RATIO_AT_32 = 0.45
TARGET_DELTA_P50_MS_AT_1 = 1.0


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    """Everything one invocation needs; built once from the command line."""

    engine: str = "sglang"
    concurrency: tuple[int, ...] = (1, 32, 128)
    requests: int = 2000
    duration: float = 15.0
    tokens: int = 16
    event_tokens: int = 256
    warmup: int = 3
    startup_timeout: float = 30.0
    router_cmd: str | None = None
    router_ready_path: str = "/ready"
    json_out: Path | None = None
    log_dir: Path | None = None
    check: bool = False


@dataclass(frozen=True)
class Ports:
    prefill: int
    bootstrap: int
    decode: int
    router: int


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _spawn(argv: Sequence[str], **streams: Any) -> subprocess.Popen[bytes]:
    """Start ``argv`` in the repo root, in its own session, killed if this process dies."""
    return subprocess.Popen(
        argv,
        cwd=REPO_ROOT,
        env=_child_env(),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=set_parent_death_signal,
        **streams,
    )


def managed(name: str, argv: Sequence[str], log_dir: Path) -> Child:
    """A process in its own session, its output in ``LOG_DIR/NAME.log``, killed if this process
    dies; stopped (SIGTERM, SIGKILL after ``STOP_GRACE_S``) on exit from a ``with`` block."""
    return Child(
        argv,
        name=name,
        log_path=log_dir / f"{name}.log",
        env=_child_env(),
        die_with_parent=True,
        stop_grace_s=STOP_GRACE_S,
    )


def check_alive(proc: Child) -> None:
    """Raise ``BenchError`` (with the log tail) if the process has exited."""
    code = proc.exit_code
    if code is not None:
        raise BenchError(f"{proc.name} exited with code {code}\n{proc.log_tail()}")


def wait_ready(proc: Child, url: str, deadline: float) -> None:
    """Poll ``url`` until it answers 200; ``BenchError`` if ``proc`` dies or time runs out."""
    if not wait_http_ok(url, deadline, alive=lambda: check_alive(proc)):
        raise BenchError(f"{proc.name} not ready at {url} in time\n{proc.log_tail()}")


# ---------------------------------------------------------------------------------------------
# The system under test
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stack:
    ports: Ports
    prefill: Child
    decode: Child
    router: Child
    direct_extra: dict[str, object]  # body fields the fake decode needs to answer directly


def fake_argv(role: str, cfg: BenchConfig, port: int, bootstrap_port: int | None) -> list[str]:
    """The fake engine in fast mode (no KV checks, no token delay).

    It answers min(--tokens, max_tokens) tokens, so it is started with the longest stream and
    each request's ``max_tokens`` picks its length.
    """
    tokens = max(cfg.tokens, cfg.event_tokens)
    opts = (
        f"--role {role} --protocol {cfg.engine} --host {LOOPBACK} --port {port} "
        f"--tokens {tokens} --token-delay 0 --no-check-kv"
    )
    if bootstrap_port is not None:
        opts += f" --bootstrap-port {bootstrap_port}"
    return [sys.executable, "-m", "testkit.fake_engine", *opts.split()]


def router_argv(cfg: BenchConfig, ports: Ports) -> list[str]:
    """``--router-cmd`` with its placeholders filled in, or the default ``python -m router``."""
    fields = {
        "python": sys.executable,
        "prefill_url": f"http://{LOOPBACK}:{ports.prefill}",
        "bootstrap_port": str(ports.bootstrap),
        "decode_url": f"http://{LOOPBACK}:{ports.decode}",
        "router_port": str(ports.router),
        "engine": cfg.engine,
    }
    template = cfg.router_cmd or DEFAULT_ROUTER_CMD
    return [token.format(**fields) for token in shlex.split(template)]


@contextlib.contextmanager
def running_stack(cfg: BenchConfig, log_dir: Path) -> Iterator[Stack]:
    """Fake prefill + fake decode + router, all ready; everything stopped on exit."""
    ports = Ports(*free_ports(4))
    deadline = time.monotonic() + cfg.startup_timeout
    with contextlib.ExitStack() as stack:
        prefill_cmd = fake_argv("prefill", cfg, ports.prefill, ports.bootstrap)
        prefill = stack.enter_context(managed("prefill", prefill_cmd, log_dir))
        decode_cmd = fake_argv("decode", cfg, ports.decode, None)
        decode = stack.enter_context(managed("decode", decode_cmd, log_dir))
        wait_ready(prefill, f"http://{LOOPBACK}:{ports.prefill}/health", deadline)
        wait_ready(decode, f"http://{LOOPBACK}:{ports.decode}/health", deadline)
        router = stack.enter_context(managed("router", router_argv(cfg, ports), log_dir))
        ready_url = f"http://{LOOPBACK}:{ports.router}{cfg.router_ready_path}"
        wait_ready(router, ready_url, time.monotonic() + cfg.startup_timeout)
        yield Stack(ports, prefill, decode, router, direct_extra(cfg, ports))


def _answers(url: str, body: Mapping[str, object]) -> tuple[bool, str]:
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        response = client.post(url, json=body)
    return response.status_code == 200, f"HTTP {response.status_code}: {response.text[:300]}"


def direct_extra(cfg: BenchConfig, ports: Ports) -> dict[str, object]:
    """Fields to add to a request sent straight to the fake decode (the baseline).

    A plain OpenAI request when the decode answers one; otherwise (an SGLang decode insists on
    bootstrap fields) the SGLang bootstrap fields, which a ``--no-check-kv`` fake accepts without
    contacting the prefill. Raises ``BenchError`` if neither is answered.
    """
    url = f"http://{LOOPBACK}:{ports.decode}/v1/completions"
    plain: dict[str, object] = {"model": MODEL, "prompt": "probe", "max_tokens": 1}
    ok, why = _answers(url, plain)
    if ok:
        return {}
    if cfg.engine == "sglang":
        extra: dict[str, object] = {
            "bootstrap_host": LOOPBACK,
            "bootstrap_port": ports.bootstrap,
            "bootstrap_room": 1,
        }
        ok, why = _answers(url, {**plain, **extra})
        if ok:
            return extra
    raise BenchError(f"the fake decode does not answer a direct request: {why}")


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------


class Measurement(msgspec.Struct, frozen=True):
    """One loadgen run and the CPU it cost each watched process (ms per completed request)."""

    via: str  # "direct" (fake decode) or "router"
    concurrency: int
    tokens: int
    stream: bool
    load: LoadResult
    cpu_ms_per_request: dict[str, float]

    def cpu_ms(self, name: str) -> float:
        return self.cpu_ms_per_request.get(name, 0.0)


@dataclass(frozen=True)
class RunSpec:
    via: str
    concurrency: int
    tokens: int
    stream: bool = True


def loadgen_argv(
    cfg: BenchConfig,
    port: int,
    spec: RunSpec,
    watch: Mapping[str, int],
    extra: Mapping[str, object],
    headers: Sequence[str] = (),
) -> list[str]:
    opts = (
        f"--url http://{LOOPBACK}:{port} -c {spec.concurrency} -n {cfg.requests} "
        f"-d {cfg.duration} --warmup {cfg.warmup} --tokens {spec.tokens} --model {MODEL} --json"
    )
    if not spec.stream:
        opts += " --no-stream"
    opts += "".join(f" --watch {name}={pid}" for name, pid in watch.items())
    argv = [sys.executable, "-m", "bench.load.loadgen", *opts.split()]
    if extra:
        argv += ["--extra", json.dumps(dict(extra))]
    for header in headers:
        argv += ["--header", header]
    return argv


def run_loadgen(argv: Sequence[str], budget_s: float) -> LoadResult:
    """Run the load generator in its own process; its JSON result, or ``BenchError``."""
    proc = _spawn(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=budget_s)
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"loadgen did not finish within {budget_s:.0f}s") from exc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise BenchError(f"loadgen failed ({proc.returncode}): {err.decode(errors='replace')}")
    return msgspec.json.decode(out, type=LoadResult)


def measure(cfg: BenchConfig, stack: Stack, spec: RunSpec) -> Measurement:
    """One loadgen run against the fake decode (``direct``) or the router."""
    engines = {"prefill": stack.prefill.pid, "decode": stack.decode.pid}
    if spec.via == "direct":
        port, watch = stack.ports.decode, {"decode": stack.decode.pid}
        extra = stack.direct_extra
    else:
        port, watch = stack.ports.router, {"router": stack.router.pid, **engines}
        extra = {}
    budget = cfg.duration + 60.0 + cfg.warmup * spec.concurrency * 0.05
    load = run_loadgen(loadgen_argv(cfg, port, spec, watch, extra), budget)
    for proc in (stack.prefill, stack.decode, stack.router):
        check_alive(proc)
    return Measurement(spec.via, spec.concurrency, spec.tokens, spec.stream, load, _cpu_ms(load))


def _cpu_ms(load: LoadResult) -> dict[str, float]:
    per = 1000.0 / max(load.completed, 1)
    cpu = {name: seconds * per for name, seconds in load.watched_cpu_s.items()}
    cpu["engines"] = cpu.get("prefill", 0.0) + cpu.get("decode", 0.0)
    cpu["loadgen"] = load.loadgen_cpu_s * per
    return cpu


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


class Row(msgspec.Struct, frozen=True):
    concurrency: int
    direct: Measurement
    router: Measurement
    ratio: float
    latency_p50_delta_ms: float


class EventCost(msgspec.Struct, frozen=True):
    """Router CPU per relayed SSE event: the slope between a short and a long stream."""

    concurrency: int
    base: Measurement
    long: Measurement
    us_per_event: float | None


class Target(msgspec.Struct, frozen=True):
    name: str
    value: float | None
    op: str
    limit: float
    unit: str
    passed: bool | None


class Report(msgspec.Struct, frozen=True):
    config: dict[str, object]
    environment: dict[str, object]
    rows: list[Row]
    events: EventCost
    non_stream: Measurement
    targets: list[Target]
    total_errors: int
    direct_extra: dict[str, object]


def make_row(direct: Measurement, router: Measurement) -> Row:
    ratio = router.load.rps / direct.load.rps if direct.load.rps > 0 else 0.0
    delta = router.load.latency_ms.p50 - direct.load.latency_ms.p50
    return Row(direct.concurrency, direct, router, ratio, delta)


def event_cost(base: Measurement, long: Measurement) -> EventCost:
    extra_events = long.load.events_per_request - base.load.events_per_request
    slope = None
    if extra_events > 0:
        slope = 1000.0 * (long.cpu_ms("router") - base.cpu_ms("router")) / extra_events
    return EventCost(base.concurrency, base, long, slope)


def _check(name: str, value: float | None, op: str, limit: float, unit: str) -> Target:
    passed = None if value is None else (value <= limit if op == "<=" else value >= limit)
    return Target(name, value, op, limit, unit, passed)


def _row_at(rows: Sequence[Row], concurrency: int) -> Row | None:
    return next((row for row in rows if row.concurrency == concurrency), None)


def targets(rows: Sequence[Row], events: EventCost) -> list[Target]:
    worst = max(rows, key=lambda row: row.router.cpu_ms("router"))
    at32, at1 = _row_at(rows, 32), _row_at(rows, 1)
    return [
        _check(
            f"router CPU per request (worst, C={worst.concurrency})",
            worst.router.cpu_ms("router"),
            "<=",
            TARGET_CPU_MS_PER_REQUEST,
            "ms",
        ),
        _check(
            "router CPU per SSE event", events.us_per_event, "<=", TARGET_CPU_US_PER_EVENT, "us"
        ),
        _check(
            "throughput ratio router/direct at C=32",
            at32.ratio if at32 else None,
            ">=",
            TARGET_RATIO_AT_32,
            "x",
        ),
        _check(
            "p50 latency delta router-direct at C=1",
            at1.latency_p50_delta_ms if at1 else None,
            "<=",
            TARGET_DELTA_P50_MS_AT_1,
            "ms",
        ),
    ]


def environment() -> dict[str, object]:
    commit = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
    return {
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "commit": commit,
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


# ---------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------


def run_bench(cfg: BenchConfig, log_dir: Path, say: Callable[[str], None]) -> Report:
    """Start the stack, run every measurement, stop the stack; the assembled Report."""
    with running_stack(cfg, log_dir) as stack:
        say(f"stack up: {stack.ports}; direct request extra fields: {stack.direct_extra or 'none'}")
        rows = [_sweep_one(cfg, stack, c, say) for c in cfg.concurrency]
        events, non_stream = _extras(cfg, stack, rows, say)
        direct_fields = stack.direct_extra
    all_runs = [m for row in rows for m in (row.direct, row.router)]
    all_runs += [events.long, events.base, non_stream]
    return Report(
        config=_config_dict(cfg),
        environment=environment(),
        rows=rows,
        events=events,
        non_stream=non_stream,
        targets=targets(rows, events),
        total_errors=sum({id(m): m.load.errors for m in all_runs}.values()),
        direct_extra=direct_fields,
    )


def _measure_logged(
    cfg: BenchConfig, stack: Stack, spec: RunSpec, say: Callable[[str], None]
) -> Measurement:
    result = measure(cfg, stack, spec)
    kind = "stream" if spec.stream else "non-stream"
    say(
        f"  {spec.via:<6} C={spec.concurrency:<4} tokens={spec.tokens:<4} {kind:<10} "
        f"{result.load.summary()}"
    )
    return result


def _sweep_one(cfg: BenchConfig, stack: Stack, c: int, say: Callable[[str], None]) -> Row:
    direct = _measure_logged(cfg, stack, RunSpec("direct", c, cfg.tokens), say)
    router = _measure_logged(cfg, stack, RunSpec("router", c, cfg.tokens), say)
    return make_row(direct, router)


def _extras(
    cfg: BenchConfig, stack: Stack, rows: Sequence[Row], say: Callable[[str], None]
) -> tuple[EventCost, Measurement]:
    row = _row_at(rows, EVENT_CONCURRENCY)
    base = (
        row.router
        if row
        else _measure_logged(cfg, stack, RunSpec("router", EVENT_CONCURRENCY, cfg.tokens), say)
    )
    long = _measure_logged(cfg, stack, RunSpec("router", EVENT_CONCURRENCY, cfg.event_tokens), say)
    plain = RunSpec("router", EVENT_CONCURRENCY, cfg.tokens, stream=False)
    return event_cost(base, long), _measure_logged(cfg, stack, plain, say)


def _config_dict(cfg: BenchConfig) -> dict[str, object]:
    raw = msgspec.to_builtins(cfg, enc_hook=str)
    return dict(raw) if isinstance(raw, dict) else {}


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def _pair(a: float, b: float) -> str:
    return f"{a:.2f}/{b:.2f}"


def _row_cells(row: Row) -> list[str]:
    d, r = row.direct.load, row.router.load
    return [
        str(row.concurrency),
        f"{d.rps:.0f}",
        f"{r.rps:.0f}",
        f"{row.ratio:.2f}",
        _pair(d.ttft_ms.p50, d.ttft_ms.p99),
        _pair(r.ttft_ms.p50, r.ttft_ms.p99),
        _pair(d.latency_ms.p50, d.latency_ms.p99),
        _pair(r.latency_ms.p50, r.latency_ms.p99),
        f"{row.latency_p50_delta_ms:+.2f}",
        f"{row.router.cpu_ms('router'):.3f}",
        f"{row.router.cpu_ms('engines'):.3f}",
        f"{row.router.cpu_ms('loadgen'):.3f}",
        f"{d.errors}/{r.errors}",
    ]


_HEADERS = [
    "C",
    "direct rps",
    "router rps",
    "ratio",
    "direct TTFT p50/p99",
    "router TTFT p50/p99",
    "direct lat p50/p99",
    "router lat p50/p99",
    "dp50 lat",
    "router CPU",
    "engines CPU",
    "loadgen CPU",
    "errors d/r",
]


def render_table(rows: Sequence[Row]) -> str:
    return "\n".join(text_table([_HEADERS, *(_row_cells(row) for row in rows)]))


def _fmt(value: float | None, unit: str) -> str:
    return "n/a" if value is None else f"{value:.3f} {unit}".strip()


def render_targets(report: Report) -> str:
    lines = []
    for t in report.targets:
        verdict = {True: "PASS", False: "FAIL", None: "----"}[t.passed]
        lines.append(
            f"  {verdict}  {t.name:<48} {_fmt(t.value, t.unit):>12}   "
            f"target {t.op} {t.limit:g} {t.unit}"
        )
    return "\n".join(lines)


def render_events(report: Report) -> str:
    ev, ns = report.events, report.non_stream
    b, lg = ev.base, ev.long
    return "\n".join(
        [
            f"router CPU per SSE event (C={ev.concurrency}): "
            f"({lg.cpu_ms('router'):.3f} - {b.cpu_ms('router'):.3f}) ms/req / "
            f"({lg.load.events_per_request:.1f} - {b.load.events_per_request:.1f}) events/req "
            f"= {_fmt(ev.us_per_event, 'us/event')}",
            f"router CPU per request, non-stream (C={ns.concurrency}): "
            f"{ns.cpu_ms('router'):.3f} ms  (rps {ns.load.rps:.0f}, "
            f"lat p50/p99 {_pair(ns.load.latency_ms.p50, ns.load.latency_ms.p99)} ms)",
        ]
    )


def render(report: Report) -> str:
    cfg, env = report.config, report.environment
    header = (
        f"pd-router bench: engine={cfg['engine']} tokens={cfg['tokens']} stream "
        f"requests<={cfg['requests']} duration<={cfg['duration']}s warmup={cfg['warmup']}/user "
        f"cpus={env['affinity']} python={env['python']} commit={env['commit'] or '?'}"
    )
    direct = "plain OpenAI request"
    if report.direct_extra:
        direct += f" + {', '.join(report.direct_extra)} (the fake decode needs them)"
    legend = (
        "times in ms; rps = completed req/s; ratio = router/direct rps; dp50 lat = router p50 "
        "latency - direct p50;\nCPU columns = ms of CPU per request during the router run "
        f"(router process tree, fake prefill+decode, load generator);\ndirect = {direct}"
    )
    return "\n".join(
        [
            header,
            "",
            render_table(report.rows),
            "",
            legend,
            "",
            render_events(report),
            "",
            "targets:",
            render_targets(report),
        ]
    )


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.load.run",
        description="Benchmark the PD router against direct access to a fake decode engine.",
    )
    p.add_argument("--engine", choices=ENGINES, default="sglang")
    p.add_argument("--concurrency", type=positive_ints, default=None, help="e.g. 1,32,128")
    p.add_argument("--requests", type=int, default=None, help="max measured requests per run")
    p.add_argument("--duration", type=float, default=None, help="max measured seconds per run")
    p.add_argument("--tokens", type=int, default=16, help="max_tokens (SSE events) per request")
    p.add_argument("--event-tokens", type=int, default=256, help="long stream for the slope")
    p.add_argument("--warmup", type=int, default=None, help="uncounted requests per user")
    p.add_argument("--quick", action="store_true", help="~30 s smoke run (fewer requests)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the report")
    p.add_argument(
        "--router-cmd",
        default=None,
        help=(
            "router command template; placeholders {python} {prefill_url} {bootstrap_port} "
            "{decode_url} {router_port} {engine}"
        ),
    )
    p.add_argument("--router-ready-path", default="/ready")
    p.add_argument("--startup-timeout", type=float, default=30.0)
    p.add_argument("--log-dir", type=Path, default=None, help="keep process logs here")
    p.add_argument("--check", action="store_true", help="exit 3 if a target is missed")
    return p


def config_from_args(argv: Sequence[str] | None) -> BenchConfig:
    args = _parser().parse_args(argv)
    quick = args.quick
    cfg = BenchConfig(
        engine=args.engine,
        concurrency=args.concurrency or (1, 32, 128),
        requests=args.requests or (1000 if quick else 2000),
        duration=args.duration or (3.0 if quick else 15.0),
        tokens=args.tokens,
        event_tokens=args.event_tokens,
        warmup=args.warmup if args.warmup is not None else (2 if quick else 3),
        startup_timeout=args.startup_timeout,
        router_cmd=args.router_cmd,
        router_ready_path=args.router_ready_path,
        json_out=args.json,
        log_dir=args.log_dir,
        check=args.check,
    )
    if cfg.event_tokens <= cfg.tokens:
        cfg = replace(cfg, event_tokens=cfg.tokens + 240)
    return cfg


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _exit_code(report: Report, check: bool) -> int:
    if report.total_errors:
        _say(f"bench: {report.total_errors} request errors (see error_samples in the JSON)")
        return 1
    if check and any(t.passed is False for t in report.targets):
        return 3
    return 0


def _execute(cfg: BenchConfig, log_dir: Path) -> int:
    try:
        report = run_bench(cfg, log_dir, _say)
    except BenchError as exc:
        _say(f"bench failed: {exc}")
        return 1
    print(render(report), flush=True)
    if cfg.json_out is not None:
        cfg.json_out.parent.mkdir(parents=True, exist_ok=True)
        cfg.json_out.write_bytes(msgspec.json.format(msgspec.json.encode(report)) + b"\n")
        _say(f"report written to {cfg.json_out}")
    return _exit_code(report, cfg.check)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = config_from_args(argv)
    return run_in_log_dir(lambda log_dir: _execute(cfg, log_dir), cfg.log_dir, "pd-bench-", "bench")


if __name__ == "__main__":
    sys.exit(main())
