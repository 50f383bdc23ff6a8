"""The peer matrix: this router's CPU per request against a Rust router's, in front of the same
fake engines, interleaved and repeated.

    python -m bench.load.peers [--engines vllm-mooncake,sglang] [--tokens 16,256]
        [--concurrency 1,32,128] [--modes stream,non-stream] [--requests 2000] [--duration 10]
        [--repeats 3] [--quick] [--no-peers] [--ledger [--ledger-cells 16:32:stream,...]]
        [--compare-commit REV | --compare-pythonpath DIR] [--compare-python PATH] [--floors]
        [--flow-control] [--json OUT]

For each engine protocol one fake prefill + decode pair (``--token-delay 0 --no-check-kv``) and,
in front of it, long-lived routers started once: ours (``--engine vllm-mooncake`` or
``sglang``), its peer (vllm-router 0.1.17 with the Mooncake connector, sglang-router 0.3.2, from
``.venv-peers``: ``scripts/setup-peers.sh``), optionally an older build of ours (the regression
guard), ours with one feature switched off at a time (the ledger) and, with ``--floors``, the
router's own server answering by itself and a bare PD proxy on its server and client
(``bench.load.floor_app``: what the pipeline costs above its parts, and what a peer leaves),
and with ``--flow-control`` ours with client API keys and tenant limits, with a binding
admission queue (``FLOW``) and without (``FLOW_KEYS``), and ours at the concurrency ``FLOW``
admits (``FLOW_BASE``): what issue 25's flow control costs a request, in the ledger cells.
Every run is the load generator in its own process; it samples the CPU time of the router's
process tree exactly at the start and end of its measured phase. For each repeat every cell runs
on every router, the order rotated so that whoever goes first changes and drift hits all alike.
A direct run (the load generator straight at the fake decode) per cell and repeat gives the
latency baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import product
from pathlib import Path

import msgspec

from bench.common.cli import positive_ints, sigterm_raises, write_json
from bench.common.process import REPO_ROOT, BenchError
from bench.load import peer_tables, run
from bench.load.peer_report import (
    FLOOR_PROXY,
    FLOOR_SERVER,
    FLOW,
    FLOW_BASE,
    FLOW_KEYS,
    OLD,
    PEER,
    BuildInfo,
    PeersReport,
    make_report,
)
from bench.load.peer_stack import (
    DIRECT,
    FEATURES,
    FLOOR,
    OURS,
    PEER_OF,
    PEERS_BIN,
    Build,
    Cell,
    RunBudget,
    RunRecord,
    engine_stack,
    feature_env,
    flow_keys_text,
    known_features,
    measure_run,
    router_source,
)

__all__ = ["PeersConfig", "Slot", "config_from_args", "main", "plan_builds", "schedule"]

MODES = {"stream": True, "non-stream": False}
LEDGER_ROLES = frozenset({"ledger", "flow"})  # builds run in the ledger cells only
FLOW_KEY = "sk-peers-flow-0123456789abcdef"
FLOW_CONCURRENCY = 16  # --max-concurrent-requests of FLOW: half the ledger cells' C=32 wait


def flow_builds(keys_path: Path) -> list[Build]:
    """Ours with API keys (one tenant, its requests, tokens and in-flight limits counted, never
    reached: ``flow_keys_text``), with ``--max-concurrent-requests FLOW_CONCURRENCY`` (``FLOW``:
    half the callers wait in the queue) and without (``FLOW_KEYS``: the queue at its default
    never binds, as in a fleet that is not saturated); and ours with ``FLOW_CONCURRENCY``
    callers (``FLOW_BASE``): ``FLOW``'s upstream shape with nobody waiting, as fewer requests
    in flight share fewer of each event-loop turn's costs whatever admits them."""
    keys = (("PDR_AUTH__API_KEYS", str(keys_path)),)
    queue = (("PDR_ADMISSION__MAX_CONCURRENT_REQUESTS", str(FLOW_CONCURRENCY)),)
    auth = (f"Authorization: Bearer {FLOW_KEY}",)
    return [
        Build(FLOW, role="flow", env=keys + queue, headers=auth),
        Build(FLOW_KEYS, role="flow", env=keys, headers=auth),
        Build(FLOW_BASE, role="flow", callers=FLOW_CONCURRENCY),
    ]


@dataclass(frozen=True)
class PeersConfig:
    """Everything one invocation needs; built once from the command line."""

    engines: tuple[str, ...] = tuple(PEER_OF)
    tokens: tuple[int, ...] = (16, 256)
    concurrency: tuple[int, ...] = (1, 32, 128)
    modes: tuple[bool, ...] = (True, False)  # stream?
    requests: int = 2000
    duration: float = 10.0
    warmup: int = 3
    repeats: int = 3
    peers: bool = True
    ledger: bool = False
    ledger_cells: tuple[Cell, ...] = (Cell(16, 32, True), Cell(16, 32, False))
    compare_python: str | None = None
    compare_pythonpath: str | None = None
    compare_commit: str | None = None
    floors: bool = False
    flow_control: bool = False
    startup_timeout: float = 60.0
    json_out: Path | None = None
    log_dir: Path | None = None
    check: bool = False

    @property
    def compares(self) -> bool:
        return bool(self.compare_python or self.compare_pythonpath or self.compare_commit)

    @property
    def cells(self) -> tuple[Cell, ...]:
        """The matrix, then the ledger cells it lacks (with ``--ledger``)."""
        matrix = tuple(Cell(*c) for c in product(self.tokens, self.concurrency, self.modes))
        extra = tuple(c for c in self.ledger_cells if c not in matrix) if self.ledger_on else ()
        return matrix + extra

    @property
    def ledger_on(self) -> bool:
        """The ledger cells are run: for the ledger or the flow-control build."""
        return self.ledger or self.flow_control


# ---------------------------------------------------------------------------------------------
# Plan: the builds and the interleaved order of the runs
# ---------------------------------------------------------------------------------------------


def ledger_build_name(feature: str) -> str:
    return f"ours-no-{feature.lower().replace('_', '-')}"


def plan_builds(
    cfg: PeersConfig,
    engine: str,
    compare_source: str | None,
    features: Sequence[str] = FEATURES,
    keys_path: Path | None = None,
) -> list[Build]:
    """Ours, the engine's peer, the compare build, the floors, then one ledger build per feature
    and one with every feature off. ``compare_source``: the compare build's PYTHONPATH (``""``: the
    compare interpreter's own install)."""
    builds = [Build(OURS)]
    if cfg.peers:
        builds.append(Build(PEER, kind=PEER_OF[engine], role="peer"))
    if cfg.compares:
        builds.append(
            Build(OLD, role="compare", python=cfg.compare_python, source=compare_source or "")
        )
    if cfg.floors:
        builds += [
            Build(FLOOR_SERVER, kind=FLOOR, role="floor", shape="server"),
            Build(FLOOR_PROXY, kind=FLOOR, role="floor", shape="proxy"),
        ]
    if cfg.ledger:
        builds += [Build(ledger_build_name(f), role="ledger", features_off=(f,)) for f in features]
        builds.append(Build("ours-all-off", role="ledger", features_off=tuple(features)))
    if cfg.flow_control and keys_path is not None:
        builds += flow_builds(keys_path)
    return builds


@dataclass(frozen=True)
class Slot:
    """One run of the schedule."""

    repeat: int
    cell: Cell
    target: str  # a build's name or ``direct``


def targets_for(cell: Cell, builds: Sequence[Build], ledger_cells: Sequence[Cell]) -> list[str]:
    """``direct`` and every build that runs in ``cell`` (ledger and flow-control builds in
    ledger cells only)."""
    names = [b.name for b in builds if b.role not in LEDGER_ROLES or cell in ledger_cells]
    return [DIRECT, *names]


def schedule(
    cells: Sequence[Cell], targets: Callable[[Cell], Sequence[str]], repeats: int
) -> list[Slot]:
    """For each repeat, each cell on every target back to back; the order rotated by one per
    repeat and per cell, so who goes first changes (ABC, BCA, CAB, ...)."""
    slots = []
    for repeat in range(repeats):
        for index, cell in enumerate(cells):
            names = list(targets(cell))
            shift = (repeat + index) % len(names)
            slots += [Slot(repeat, cell, name) for name in names[shift:] + names[:shift]]
    return slots


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def compare_source(cfg: PeersConfig) -> Iterator[str | None]:
    """The compare build's source tree: ``--compare-pythonpath``, or ``--compare-commit``
    archived into a temporary directory (removed on exit), or None."""
    if cfg.compare_commit is None:
        yield cfg.compare_pythonpath
        return
    where = Path(tempfile.mkdtemp(prefix="pd-peers-old-"))
    try:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", cfg.compare_commit],
            cwd=REPO_ROOT,
            capture_output=True,
            timeout=120,
            check=False,
        )
        if archive.returncode != 0:
            raise BenchError(f"git archive {cfg.compare_commit}: {archive.stderr.decode()}")
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(where, filter="data")
        yield str(where)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _describe(record: RunRecord) -> str:
    if not record.ok:
        return f"FAILED: {record.failure}"
    load = record.load
    assert load is not None
    cpu = "" if record.router_cpu_us is None else f"cpu={record.router_cpu_us:.0f}us/req "
    return (
        f"{cpu}p50={load.latency_ms.p50:.2f}ms rps={load.rps:.0f} "
        f"ok={load.completed} wall={load.wall_s:.1f}s"
    )


def run_engine(
    cfg: PeersConfig,
    engine: str,
    builds: Sequence[Build],
    log_dir: Path,
    say: Callable[[str], None],
) -> list[RunRecord]:
    """Every scheduled run of one engine protocol, its stack started once and stopped after."""
    budget = RunBudget(cfg.requests, cfg.duration, cfg.warmup)
    ledger_cells = cfg.ledger_cells if cfg.ledger_on else ()
    slots = schedule(cfg.cells, lambda c: targets_for(c, builds, ledger_cells), cfg.repeats)
    records = []
    with engine_stack(
        engine, builds, max(c.tokens for c in cfg.cells), log_dir, cfg.startup_timeout
    ) as stack:
        say(f"{engine}: up: {', '.join(f'{n} :{p}' for n, (_, p) in stack.routers.items())}")
        for number, slot in enumerate(slots, 1):
            record = measure_run(stack, slot.target, slot.cell, slot.repeat, budget)
            records.append(record)
            say(
                f"  [{number}/{len(slots)}] {engine} {slot.cell.label:<24} #{slot.repeat + 1} "
                f"{slot.target:<22} {_describe(record)}"
            )
    return records


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _names(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(part.strip() for part in text.split(",") if part.strip())
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"expected some of {', '.join(choices)}, got {text!r}")
        return names

    return parse


def ledger_cells(text: str) -> tuple[Cell, ...]:
    """``TOKENS:C:MODE,...`` (e.g. ``16:32:stream,16:32:non-stream``) -> cells."""
    cells = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        tokens, sep, rest = part.partition(":")
        concurrency, sep2, mode = rest.partition(":")
        if not (sep and sep2 and tokens.isdigit() and concurrency.isdigit() and mode in MODES):
            raise argparse.ArgumentTypeError(f"expected TOKENS:C:stream|non-stream, got {part!r}")
        if int(tokens) < 1 or int(concurrency) < 1:
            raise argparse.ArgumentTypeError(f"tokens and C must be positive, got {part!r}")
        cells.append(Cell(int(tokens), int(concurrency), MODES[mode]))
    if not cells:
        raise argparse.ArgumentTypeError("expected at least one TOKENS:C:MODE")
    return tuple(cells)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.load.peers",
        description="Router CPU per request, ours vs the Rust peers, interleaved and repeated.",
    )
    p.add_argument("--engines", type=_names(tuple(PEER_OF)), default=None)
    p.add_argument("--tokens", type=positive_ints, default=None, help="e.g. 16,256")
    p.add_argument("--concurrency", type=positive_ints, default=None, help="e.g. 1,32,128")
    p.add_argument("--modes", type=_names(tuple(MODES)), default=None)
    p.add_argument("--requests", type=int, default=None, help="measured requests per run")
    p.add_argument("--duration", type=float, default=None, help="max measured seconds per run")
    p.add_argument("--warmup", type=int, default=None, help="uncounted requests per user")
    p.add_argument("--repeats", type=int, default=None, help="runs of each cell per router")
    p.add_argument("--quick", action="store_true", help="smoke run: fewer requests, 1 repeat")
    p.add_argument("--no-peers", dest="peers", action="store_false", help="ours only")
    p.add_argument("--ledger", action="store_true", help="also ours with each feature off")
    p.add_argument("--ledger-cells", type=ledger_cells, default=None, metavar="T:C:MODE,...")
    p.add_argument("--compare-python", default=None, metavar="PATH", help="interpreter of it")
    p.add_argument("--compare-pythonpath", default=None, metavar="DIR", help="source tree of it")
    p.add_argument("--compare-commit", default=None, metavar="REV", help="git archive of REV")
    p.add_argument("--floors", action="store_true", help="also the router's parts alone")
    p.add_argument(
        "--flow-control", action="store_true", help="also ours with keys, limits and a queue"
    )
    p.add_argument("--startup-timeout", type=float, default=60.0)
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write everything")
    p.add_argument("--log-dir", type=Path, default=None, help="keep process logs here")
    p.add_argument("--check", action="store_true", help="exit 3 if a cell's ratio is > 1.0")
    return p


def config_from_args(argv: Sequence[str] | None) -> PeersConfig:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.compare_commit and args.compare_pythonpath:
        parser.error("--compare-commit and --compare-pythonpath both name the source tree")
    for name in ("requests", "warmup", "repeats", "duration", "startup_timeout"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1e-9):
            parser.error(f"--{name.replace('_', '-')} must be positive")
    quick, base = args.quick, PeersConfig()
    return replace(
        base,
        engines=args.engines or base.engines,
        tokens=args.tokens or base.tokens,
        concurrency=args.concurrency or base.concurrency,
        modes=tuple(MODES[m] for m in args.modes) if args.modes else base.modes,
        requests=args.requests or (500 if quick else base.requests),
        duration=args.duration or (3.0 if quick else base.duration),
        warmup=args.warmup if args.warmup is not None else (1 if quick else base.warmup),
        repeats=args.repeats or (1 if quick else base.repeats),
        peers=args.peers,
        ledger=args.ledger,
        ledger_cells=args.ledger_cells or base.ledger_cells,
        compare_python=args.compare_python,
        compare_pythonpath=args.compare_pythonpath,
        compare_commit=args.compare_commit,
        floors=args.floors,
        flow_control=args.flow_control,
        startup_timeout=args.startup_timeout,
        json_out=args.json,
        log_dir=args.log_dir,
        check=args.check,
    )


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _check_peers(cfg: PeersConfig) -> None:
    if not cfg.peers:
        return
    wanted = {"vllm-mooncake": PEERS_BIN / "vllm-router", "sglang": PEERS_BIN / "python"}
    missing = [str(wanted[e]) for e in cfg.engines if not wanted[e].exists()]
    if missing:
        raise BenchError(f"no peer router ({', '.join(missing)}): run scripts/setup-peers.sh")


def build_infos(builds: Sequence[Build]) -> list[BuildInfo]:
    """The report's view of ``builds``: where each build of ours imports ``router`` from."""
    infos = []
    for b in builds:
        if b.role == "ledger":
            where = " ".join(f"{k}={v}" for k, v in feature_env(b.features_off).items())
        else:
            where = router_source(b)
        infos.append(BuildInfo(b.name, b.kind, b.role, list(b.features_off), where))
    return infos


def _unknown_features(cfg: PeersConfig, say: Callable[[str], None]) -> frozenset[str]:
    if not cfg.ledger:
        return frozenset()
    from router.settings.root import RouterSettings

    unknown = frozenset(FEATURES) - known_features(RouterSettings)
    if unknown:
        say(f"ledger: not settings of this router (rows measure nothing): {sorted(unknown)}")
    return unknown


def run_all(cfg: PeersConfig, log_dir: Path, say: Callable[[str], None]) -> PeersReport:
    """Every engine's runs; the assembled report."""
    _check_peers(cfg)
    unknown = _unknown_features(cfg, say)
    records: list[RunRecord] = []
    infos: dict[tuple[str, str], BuildInfo] = {}
    keys_path = log_dir / "flow-keys.yaml"
    keys_path.write_text(flow_keys_text([FLOW_KEY]))
    with compare_source(cfg) as source:
        for engine in cfg.engines:
            builds = plan_builds(cfg, engine, source, keys_path=keys_path)
            for info in build_infos(builds):
                infos.setdefault((info.name, info.kind), info)
            say(f"{engine}: starting {len(builds)} routers: {', '.join(b.name for b in builds)}")
            records += run_engine(cfg, engine, builds, log_dir, say)
    config = msgspec.to_builtins(cfg, enc_hook=str)
    return make_report(config, run.environment(), list(infos.values()), records, unknown)


def exit_code(report: PeersReport, check: bool) -> int:
    if report.failures:
        return 1
    if check and any(row.passed is not True for row in report.matrix):
        return 3
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    cfg = config_from_args(argv)
    log_dir = cfg.log_dir or Path(tempfile.mkdtemp(prefix="pd-peers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    code = 130
    try:
        with sigterm_raises():
            report = run_all(cfg, log_dir, _say)
            print(peer_tables.render(report), flush=True)
            if cfg.json_out is not None:
                write_json(report, cfg.json_out)
            code = exit_code(report, cfg.check)
    except BenchError as exc:
        _say(f"peers: failed: {exc}")
        code = 1
    except KeyboardInterrupt:
        _say("peers: interrupted; every process stopped")
    finally:
        if cfg.log_dir is None and code == 0:
            shutil.rmtree(log_dir, ignore_errors=True)
        elif code != 0:
            _say(f"peers: process logs kept in {log_dir}")
    return code


if __name__ == "__main__":
    sys.exit(main())
