"""The router's own request path, CPU µs per request, measured in process: no sockets, no
kernel, no load generator sharing the cores, so a change of a few µs shows.

    python -m bench.load.pipeline_cost [--engines vllm-mooncake,sglang] [--modes non-stream,stream]
        [--requests 10000] [--concurrency 32] [--tokens 16] [--repeats 5]
        [--compare-commit REV | --compare-pythonpath DIR] [--ledger] [--flow-control]
        [--json OUT]

Each build of the router (this checkout; the compare build; with ``--ledger``, this checkout
with one feature switched off at a time) runs in a process of its own
(``pipeline_cost_child.py``): its ASGI app, started as the router starts it in front of a real
fake prefill + decode pair (health probes, bootstrap queries), serves completions called in
process by ``--concurrency`` callers, its upstream legs answered from memory after one
event-loop turn. What it measures is everything the router does per request but the HTTP
server and client: parsing, admission, routing, the legs' plan and bookkeeping, breakers,
receipts, metrics. Runs are interleaved (each repeat runs every build, the order rotated);
each build's figure is the median over its repeats of its runs' median batch.

``--flow-control`` adds ``flow-control``: this checkout with client API keys (``--api-keys``, a
keys file of ``FLOW_TENANTS`` tenants, each with request, token and in-flight limits too high
ever to refuse; the callers present keys spread across the tenants) and the admission queue in
use (``--max-concurrent-requests`` at half the callers, so half of them wait and the queue
orders them by tenant): its ratio against ``ours`` (all of that off) is issue 25's CPU figure.

With ``--compare-commit`` (or ``--compare-pythonpath``) too, ``flow-keys-old`` is the compare
tree with the same keys and limits: what a change to the keys path saved, measured interleaved.

``bench.load.peers --floors`` measures the rest (the server and the client on sockets) and the
total against the Rust peers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgspec

from bench.common.cli import sigterm_raises, write_json
from bench.common.process import LOOPBACK, REPO_ROOT, BenchError
from bench.common.table import or_na, text_table
from bench.load.peer_report import median
from bench.load.peer_stack import FEATURES, engine_stack, feature_env, flow_keys_text
from bench.load.peers import PeersConfig, compare_source

__all__ = ["CostConfig", "CostReport", "main", "run_all"]

CHILD = Path(__file__).with_name("pipeline_cost_child.py")
ENGINES = ("vllm-mooncake", "sglang")  # the concurrent shapes (the stubs answer those)
MODES = {"non-stream": False, "stream": True}
OURS, OLD, FLOW = "ours", "old", "flow-control"
FLOW_PREFIX = "flow-"  # the flow-control builds: flow-control, flow-keys, flow-queue
FLOW_TENANTS = 4
FLOW_TARGET = 1.10  # issue 25: flow control's CPU per request at most +10%
CHILD_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class CostConfig:
    engines: tuple[str, ...] = ENGINES
    modes: tuple[str, ...] = ("non-stream", "stream")
    requests: int = 10000
    concurrency: int = 32
    tokens: int = 16
    repeats: int = 5
    batches: int = 3
    ledger: bool = False
    flow_control: bool = False
    compare_commit: str | None = None
    compare_pythonpath: str | None = None
    json_out: Path | None = None


@dataclass(frozen=True)
class CostBuild:
    name: str
    source: str  # PYTHONPATH of its ``router``
    features_off: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # more of its environment
    caller_args: tuple[str, ...] = ()  # more of the child's command line


def flow_keys(tenants: int = FLOW_TENANTS) -> list[str]:
    """The callers' keys, one per tenant."""
    return [f"sk-cost-tenant-{i}-0123456789abcdef" for i in range(tenants)]


def flow_builds(cfg: CostConfig, keys_path: Path, keys: Sequence[str]) -> list[CostBuild]:
    """This checkout with keys, limits and the admission queue in use (module docstring), and
    with each half alone: keys and limits (``flow-keys``), the queue (``flow-queue``)."""
    auth = (("PDR_AUTH__API_KEYS", str(keys_path)),)
    queue = (("PDR_ADMISSION__MAX_CONCURRENT_REQUESTS", str(max(cfg.concurrency // 2, 1))),)
    caller = ("--keys", ",".join(keys))
    here = str(REPO_ROOT)
    return [
        CostBuild(FLOW, here, env=auth + queue, caller_args=caller),
        CostBuild(f"{FLOW_PREFIX}keys", here, env=auth, caller_args=caller),
        CostBuild(f"{FLOW_PREFIX}queue", here, env=queue),
    ]


class CostRow(msgspec.Struct, frozen=True):
    engine: str
    mode: str
    build: str
    runs_us: list[float]  # each run's median batch
    us: float | None  # the median over the runs


class CostReport(msgspec.Struct, frozen=True):
    config: dict[str, object]
    builds: dict[str, str]  # name -> where its ``router`` came from
    rows: list[CostRow]


@dataclass
class _Runs:
    us: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)
    routers: dict[str, str] = field(default_factory=dict)


def plan_builds(
    cfg: CostConfig, compare: str | None, keys_path: Path | None = None
) -> list[CostBuild]:
    builds = [CostBuild(OURS, str(REPO_ROOT))]
    if cfg.flow_control and keys_path is not None:
        builds += flow_builds(cfg, keys_path, flow_keys())
    if compare is not None:
        builds.append(CostBuild(OLD, compare))
        if cfg.flow_control and keys_path is not None:  # the compare tree's keys and limits
            keys = next(b for b in builds if b.name == f"{FLOW_PREFIX}keys")
            builds.append(replace(keys, name=f"{FLOW_PREFIX}keys-{OLD}", source=compare))
    if cfg.ledger:
        here = str(REPO_ROOT)
        builds += [CostBuild(f"no-{f.lower()}", here, (f,)) for f in FEATURES]
        builds.append(CostBuild("all-off", here, FEATURES))
    return builds


def child_argv(
    cfg: CostConfig, engine: str, ports: tuple[int, int, int], stream: bool
) -> list[str]:
    prefill, bootstrap, decode = ports
    argv = [sys.executable, "-P", str(CHILD), "--engine", engine]
    argv += ["--prefill", f"http://{LOOPBACK}:{prefill}", str(bootstrap)]
    argv += ["--decode", f"http://{LOOPBACK}:{decode}", "--tokens", str(cfg.tokens)]
    argv += ["--requests", str(cfg.requests), "--concurrency", str(cfg.concurrency)]
    argv += ["--batches", str(cfg.batches)]
    return argv + (["--stream"] if stream else [])


def run_child(argv: Sequence[str], build: CostBuild) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"PYTHONPATH": build.source, **feature_env(build.features_off), **dict(build.env)}
    try:
        done = subprocess.run(
            argv, env=env, capture_output=True, timeout=CHILD_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"{build.name}: no result within {CHILD_TIMEOUT_S:.0f}s") from exc
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace")[-2000:]
        raise BenchError(f"{build.name}: exit {done.returncode}\n{tail}")
    result: dict[str, object] = json.loads(done.stdout)
    statuses = result.get("statuses")
    if not isinstance(statuses, dict) or set(statuses) != {"200"}:
        raise BenchError(f"{build.name}: answers other than 200: {statuses}")
    return result


def run_engine(
    cfg: CostConfig, engine: str, builds: Sequence[CostBuild], say: Callable[[str], None]
) -> _Runs:
    runs = _Runs()
    with (
        tempfile.TemporaryDirectory(prefix="pd-pipeline-cost-") as logs,
        engine_stack(engine, [], cfg.tokens, Path(logs), 60.0) as stack,
    ):
        ports = (stack.ports.prefill, stack.ports.bootstrap, stack.ports.decode)
        for repeat in range(cfg.repeats):
            for index, mode in enumerate(cfg.modes):
                shift = (repeat + index) % len(builds)
                for build in [*builds[shift:], *builds[:shift]]:
                    argv = [*child_argv(cfg, engine, ports, MODES[mode]), *build.caller_args]
                    result = run_child(argv, build)
                    batches = [float(x) for x in result["us"]]  # type: ignore[attr-defined]
                    us = median(batches) or 0.0
                    runs.us.setdefault((engine, mode, build.name), []).append(us)
                    runs.routers[build.name] = str(result["router"])
                    say(f"  {engine} {mode:<10} #{repeat + 1} {build.name:<18} {us:6.1f} µs")
    return runs


def run_all(cfg: CostConfig, say: Callable[[str], None]) -> CostReport:
    rows: list[CostRow] = []
    routers: dict[str, str] = {}
    peers_cfg = PeersConfig(
        compare_commit=cfg.compare_commit, compare_pythonpath=cfg.compare_pythonpath
    )
    with (
        compare_source(peers_cfg) as compare,
        tempfile.TemporaryDirectory(prefix="pd-pipeline-keys-") as keys_dir,
    ):
        keys_path = Path(keys_dir) / "keys.yaml"
        keys_path.write_text(flow_keys_text(flow_keys()))
        builds = plan_builds(cfg, compare, keys_path)
        for engine in cfg.engines:
            runs = run_engine(cfg, engine, builds, say)
            routers |= runs.routers
            for (eng, mode, name), values in runs.us.items():
                rows.append(CostRow(eng, mode, name, values, median(values)))
    config = msgspec.to_builtins(cfg, enc_hook=str)
    return CostReport(config, routers, rows)


def render(report: CostReport) -> str:
    us = {(r.engine, r.mode, r.build): r.us for r in report.rows}
    names = list(dict.fromkeys(r.build for r in report.rows))
    cells = list(dict.fromkeys((r.engine, r.mode) for r in report.rows))
    table = [["engine", "mode", *(f"{n} µs" for n in names)]]
    for engine, mode in cells:
        table.append([engine, mode, *(or_na(us.get((engine, mode, n))) for n in names)])
    lines = [f"  {name:<18} {where}" for name, where in report.builds.items()]
    lines += ["", "router CPU per request in process (median of runs):", *text_table(table, left=2)]
    if OLD in names:
        lines += ["", "| engine | mode | new µs | old µs | new/old |", "|---|---|---|---|---|"]
        for engine, mode in cells:
            new, old = us.get((engine, mode, OURS)), us.get((engine, mode, OLD))
            ratio = None if new is None or not old else new / old
            lines.append(
                f"| {engine} | {mode} | {or_na(new)} | {or_na(old)} | {or_na(ratio, '.2f')} |"
            )
    flow = [n for n in names if n.startswith(FLOW_PREFIX)]
    if flow:
        lines += _flow_lines(us, cells, flow)
    ledger = [n for n in names if n not in (OURS, OLD) and n not in flow]
    if ledger:
        lines += ["", "ledger, µs per request: ours - ours with it off"]
        rows = [["feature off", *(f"{e} {m}" for e, m in cells)]]
        for name in ledger:
            costs = [_cost(us.get((e, m, OURS)), us.get((e, m, name))) for e, m in cells]
            rows.append([name, *costs])
        lines += text_table(rows, left=1)
    return "\n".join(lines)


def _flow_lines(
    us: dict[tuple[str, str, str], float | None],
    cells: Sequence[tuple[str, str]],
    flow: Sequence[str],
) -> list[str]:
    """The flow-control builds against ``ours`` (all of it off), and the verdict."""
    lines = [
        "",
        f"flow control on / off, CPU per request (target {FLOW} / {OURS} <= {FLOW_TARGET:.2f}):",
        f"| engine | mode | {OURS} µs | {' | '.join(f'{n} µs | ratio' for n in flow)} | verdict |",
        "|---|---|---|" + "---|---|" * len(flow) + "---|",
    ]
    for engine, mode in cells:
        off = us.get((engine, mode, OURS))
        cells_out = [or_na(off)]
        for name in flow:
            on = us.get((engine, mode, name))
            cells_out += [or_na(on), or_na(None if on is None or not off else on / off, ".3f")]
        on = us.get((engine, mode, FLOW))
        ratio = None if on is None or not off else on / off
        verdict = "n/a" if ratio is None else "pass" if ratio <= FLOW_TARGET else "FAIL"
        lines.append(f"| {engine} | {mode} | {' | '.join(cells_out)} | {verdict} |")
    return lines


def _cost(ours: float | None, off: float | None) -> str:
    return "n/a" if ours is None or off is None else f"{ours - off:+.1f}"


def config_from_args(argv: Sequence[str] | None) -> CostConfig:
    p = argparse.ArgumentParser(prog="python -m bench.load.pipeline_cost", description=__doc__)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--modes", default="non-stream,stream")
    p.add_argument("--requests", type=int, default=10000, help="per measured batch")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5, help="runs per build, interleaved")
    p.add_argument("--batches", type=int, default=3, help="measured batches per run")
    p.add_argument("--ledger", action="store_true", help="also ours with each feature off")
    p.add_argument(
        "--flow-control",
        action="store_true",
        help="also ours with API keys, tenant limits and the admission queue in use",
    )
    p.add_argument("--compare-commit", default=None, metavar="REV")
    p.add_argument("--compare-pythonpath", default=None, metavar="DIR")
    p.add_argument("--json", type=Path, default=None, metavar="OUT")
    args = p.parse_args(argv)
    engines = tuple(e for e in args.engines.split(",") if e)
    modes = tuple(m for m in args.modes.split(",") if m)
    if not engines or set(engines) - set(ENGINES):
        p.error(f"--engines: some of {', '.join(ENGINES)}")
    if not modes or set(modes) - set(MODES):
        p.error(f"--modes: some of {', '.join(MODES)}")
    if args.compare_commit and args.compare_pythonpath:
        p.error("--compare-commit and --compare-pythonpath both name the source tree")
    for name in ("requests", "concurrency", "tokens", "repeats", "batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be positive")
    return CostConfig(
        engines=engines,
        modes=modes,
        requests=args.requests,
        concurrency=args.concurrency,
        tokens=max(args.tokens, 2),
        repeats=args.repeats,
        batches=args.batches,
        ledger=args.ledger,
        flow_control=args.flow_control,
        compare_commit=args.compare_commit,
        compare_pythonpath=args.compare_pythonpath,
        json_out=args.json,
    )


def main(argv: Sequence[str] | None = None) -> int:
    cfg = config_from_args(argv)
    try:
        with sigterm_raises():
            report = run_all(cfg, lambda text: print(text, file=sys.stderr, flush=True))
    except BenchError as exc:
        print(f"pipeline_cost: failed: {exc}", file=sys.stderr)
        return 1
    print(render(report), flush=True)
    if cfg.json_out is not None:
        write_json(report, cfg.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
