"""The systems the peer benchmark measures: which router builds run (ours, a peer, an older build
of ours, ours with a feature off), the command and environment each gets, the long-lived stack
of one engine protocol (one fake prefill + decode pair, every router build in front of it), and
one measured load-generator run against one of them.

Every process is a ``Child`` in a session of its own, killed if the benchmark dies, stopped
(SIGTERM, then SIGKILL after a grace period) when the stack's ``with`` block is left.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
from pydantic import BaseModel

from bench.common.process import LOOPBACK, REPO_ROOT, BenchError, Child, free_ports
from bench.common.ready import wait_http_ok
from bench.load import run
from bench.load.loadgen import LoadResult

__all__ = [
    "FEATURES",
    "FLOOR",
    "PEER_OF",
    "Build",
    "Cell",
    "EngineStack",
    "RunRecord",
    "engine_stack",
    "feature_env",
    "known_features",
    "measure_run",
    "router_argv",
    "flow_keys_text",
    "target_loadgen_argv",
    "router_env",
    "router_source",
]

# The router's switchable features (requirement 2 of issue 22): NAME is switched off for a
# router process by the environment variable PDR_FEATURES__NAME=false.
FEATURES = (
    "METRICS",
    "RECEIPTS",
    "ADMISSION",
    "BREAKERS",
    "HEALTH",
    "ENGINE_LOAD",
    "OUTLIERS",
    "TRAFFIC",
    "TRACE_HEADERS",
)
FEATURE_ENV_PREFIX = "PDR_FEATURES__"

OURS, VLLM_ROUTER, SGLANG_ROUTER = "ours", "vllm-router", "sglang-router"
FLOOR = "floor"  # ``bench.load.floor_app``: the router's own parts without its pipeline
PEER_OF = {"vllm-mooncake": VLLM_ROUTER, "sglang": SGLANG_ROUTER}
PEERS_BIN = REPO_ROOT / ".venv-peers" / "bin"
DIRECT = "direct"  # the load generator straight at the fake decode: the latency baseline
LOADGEN_SLACK_S = 60.0  # beyond --duration: warmup, start-up and the requests still in flight


@dataclass(frozen=True)
class Build:
    """One router under test.

    ``role``: ``ours`` (this checkout), ``peer`` (the engine protocol's Rust router),
    ``compare`` (another build of ours), ``ledger`` (ours with ``features_off`` switched off)
    or ``floor`` (``bench.load.floor_app``'s ``shape`` of this checkout's parts).
    For builds of ours, ``python`` is the interpreter (default: this one) and ``source`` the
    directory put on ``PYTHONPATH`` (default: this checkout; ``""``: none, the interpreter's
    own installed ``router``).
    """

    name: str
    kind: str = OURS  # OURS, VLLM_ROUTER or SGLANG_ROUTER
    role: str = "ours"
    python: str | None = None
    source: str | None = None
    features_off: tuple[str, ...] = ()
    shape: str = ""  # a floor's: ``server`` or ``proxy``
    env: tuple[tuple[str, str], ...] = ()  # more of a build of ours' environment
    headers: tuple[str, ...] = ()  # more request headers its load sends (``Name: value``)
    callers: int | None = None  # its load's concurrency (None: the cell's)


@dataclass(frozen=True)
class Cell:
    """One point of the matrix: tokens per request, concurrency, streaming or not."""

    tokens: int
    concurrency: int
    stream: bool

    @property
    def label(self) -> str:
        return f"{self.tokens} tok C={self.concurrency} {'stream' if self.stream else 'non-stream'}"


class RunRecord(msgspec.Struct, frozen=True):
    """One load-generator run against one target (a build, or ``direct``) in one cell.

    ``ok``: it completed requests with no error and every process lived; otherwise ``failure``
    says why and the run counts in no median.
    """

    engine: str
    target: str
    repeat: int
    tokens: int
    concurrency: int
    stream: bool
    ok: bool
    failure: str | None = None
    router_cpu_us: float | None = None  # CPU of the router's process tree per completed request
    latency_p50_ms: float | None = None
    load: LoadResult | None = None


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnginePorts:
    prefill: int
    bootstrap: int
    decode: int

    def url(self, port: int) -> str:
        return f"http://{LOOPBACK}:{port}"


def feature_env(features_off: Sequence[str]) -> dict[str, str]:
    """The environment that switches ``features_off`` off in our router."""
    return {f"{FEATURE_ENV_PREFIX}{name}": "false" for name in features_off}


def known_features(settings: type[BaseModel]) -> frozenset[str]:
    """The NAMEs a ``PDR_FEATURES__NAME`` variable can switch in a settings tree whose root is
    ``settings`` (its ``features`` group's fields, upper-cased); empty if it has no such group.

    pydantic-settings ignores an environment variable that names no setting, so a ledger row of
    a feature the router does not know would silently measure nothing: this says which."""
    group = settings.model_fields.get("features")
    model = group.annotation if group is not None else None
    if isinstance(model, type) and issubclass(model, BaseModel):
        return frozenset(name.upper() for name in model.model_fields)
    return frozenset()


def python_argv(build: Build) -> list[str]:
    """The interpreter of a build of ours; -P: the working directory (this checkout) is not put
    first on sys.path, so PYTHONPATH alone says which source tree's ``router`` is imported."""
    return [build.python or sys.executable, "-P"]


def router_argv(
    build: Build, engine: str, ports: EnginePorts, port: int, metrics_port: int
) -> list[str]:
    """The command of ``build`` in front of the fake pair at ``ports``, listening on ``port``:
    round-robin, logging warnings only, every other option at its default."""
    prefill, decode, boot = ports.url(ports.prefill), ports.url(ports.decode), str(ports.bootstrap)
    common = ["--host", LOOPBACK, "--port", str(port), "--policy", "round_robin"]
    if build.kind == FLOOR:
        return [
            *python_argv(build),
            *("-m", "bench.load.floor_app", "--shape", build.shape, "--engine", engine),
            *("--prefill", prefill, boot, "--decode", decode),
            *("--host", LOOPBACK, "--port", str(port)),
        ]
    if build.kind == VLLM_ROUTER:
        return [
            str(PEERS_BIN / "vllm-router"),
            "--vllm-pd-disaggregation",
            *("--prefill", prefill, boot, "--decode", decode, "--kv-connector", "mooncake"),
            *common,
            *("--prometheus-host", LOOPBACK, "--prometheus-port", str(metrics_port)),
            *("--log-level", "warning"),
        ]
    if build.kind == SGLANG_ROUTER:
        return [
            str(PEERS_BIN / "python"),
            *("-m", "sglang_router.launch_router", "--pd-disaggregation"),
            *("--prefill", prefill, boot, "--decode", decode),
            *common,
            *("--prometheus-host", LOOPBACK, "--prometheus-port", str(metrics_port)),
            *("--log-level", "warn"),
        ]
    return [
        *python_argv(build),
        *("-m", "router", "--engine", engine),
        *("--prefill", prefill, boot, "--decode", decode),
        *common,
        *("--log-level", "warning"),
    ]


def flow_keys_text(keys: Sequence[str]) -> str:
    """A keys file (YAML) for the flow-control builds (``peers``, ``pipeline_cost``): a tenant
    per key, limits that never refuse, equal weights."""
    lines = ["tenants:"]
    for i, key in enumerate(keys):
        lines += [
            f"  tenant-{i}:",
            f"    keys: [{key}]",
            "    requests_per_minute: 1000000000",
            "    tokens_per_minute: 1000000000000",
            "    max_concurrent: 1000000",
        ]
    return "\n".join(lines) + "\n"


def router_env(build: Build, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``build``'s environment: ``base`` (default: ours) without its PYTHONPATH; for a build of
    ours its source tree on PYTHONPATH and its features off."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k != "PYTHONPATH"}
    env["PYTHONUNBUFFERED"] = "1"
    if build.kind == FLOOR:
        return env | {"PYTHONPATH": str(REPO_ROOT)}
    if build.kind != OURS:
        return env
    source = str(REPO_ROOT) if build.source is None else build.source
    if source:
        env["PYTHONPATH"] = source
    return env | feature_env(build.features_off) | dict(build.env)


def router_source(build: Build) -> str:
    """Where ``build``'s ``router`` package is imported from (a check that a compare build
    really runs another tree); the error text when it cannot be imported."""
    if build.kind == FLOOR:
        return f"bench.load.floor_app --shape {build.shape}"
    if build.kind != OURS:
        return build.kind
    argv = [*python_argv(build), "-c", "import router; print(router.__file__)"]
    try:
        done = subprocess.run(
            argv, env=router_env(build), capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot run {argv[0]}: {exc}"
    lines = (done.stdout if done.returncode == 0 else done.stderr).strip().splitlines()
    return lines[-1] if lines else f"exit {done.returncode}"


# ---------------------------------------------------------------------------------------------
# The stack of one engine protocol
# ---------------------------------------------------------------------------------------------


@dataclass
class EngineStack:
    """One fake prefill + decode pair and every router build in front of it, all serving."""

    engine: str
    ports: EnginePorts
    prefill: Child
    decode: Child
    direct_extra: dict[str, object]
    routers: dict[str, tuple[Child, int]] = field(default_factory=dict)  # name -> (child, port)
    headers: dict[str, tuple[str, ...]] = field(default_factory=dict)  # name -> its load's
    callers: dict[str, int] = field(default_factory=dict)  # name -> its load's concurrency


def _is_200(response: httpx.Response) -> bool:
    return response.status_code == 200


def _peer_ready(response: httpx.Response) -> bool:
    """A peer router serves before it has registered its workers: ready once its
    ``/readiness`` counts both healthy (sglang-router: ``healthy_workers``; vllm-router:
    ``prefill.healthy`` and ``decode.healthy``)."""
    if response.status_code != 200:
        return False
    data = response.json()
    if "healthy_workers" in data:
        return int(data["healthy_workers"]) >= 2
    return all(int(data.get(role, {}).get("healthy", 0)) >= 1 for role in ("prefill", "decode"))


def _wait_router(build: Build, child: Child, port: int, deadline: float) -> None:
    ours = build.kind in (OURS, FLOOR)  # (a floor serves ``/ready`` as ours does)
    url = f"http://{LOOPBACK}:{port}{'/ready' if ours else '/readiness'}"

    def alive() -> None:
        run.check_alive(child)

    accept = _is_200 if ours else _peer_ready
    if not wait_http_ok(url, deadline, alive=alive, accept=accept, interval_s=0.1):
        raise BenchError(f"{child.name}: not ready at {url} in time\n{child.log_tail()}")


def _start_router(
    build: Build, engine: str, ports: EnginePorts, log_dir: Path
) -> tuple[Child, int]:
    port, metrics_port = free_ports(2)
    child = Child(
        router_argv(build, engine, ports, port, metrics_port),
        name=f"{engine}-{build.name}",
        log_path=log_dir / f"{engine}-{build.name}.log",
        env=router_env(build),
        die_with_parent=True,
        stop_grace_s=run.STOP_GRACE_S,
    )
    return child, port


def _start_fakes(
    stack: contextlib.ExitStack, engine: str, max_tokens: int, log_dir: Path, timeout_s: float
) -> EngineStack:
    ports = EnginePorts(*free_ports(3))
    cfg = run.BenchConfig(engine=engine, tokens=max_tokens, event_tokens=max_tokens)
    prefill_argv = run.fake_argv("prefill", cfg, ports.prefill, ports.bootstrap)
    prefill = stack.enter_context(run.managed(f"{engine}-prefill", prefill_argv, log_dir))
    decode_argv = run.fake_argv("decode", cfg, ports.decode, None)
    decode = stack.enter_context(run.managed(f"{engine}-decode", decode_argv, log_dir))
    deadline = time.monotonic() + timeout_s
    run.wait_ready(prefill, f"{ports.url(ports.prefill)}/health", deadline)
    run.wait_ready(decode, f"{ports.url(ports.decode)}/health", deadline)
    extra = run.direct_extra(cfg, run.Ports(ports.prefill, ports.bootstrap, ports.decode, 0))
    return EngineStack(engine, ports, prefill, decode, extra)


@contextlib.contextmanager
def engine_stack(
    engine: str, builds: Sequence[Build], max_tokens: int, log_dir: Path, startup_timeout: float
) -> Iterator[EngineStack]:
    """The fake pair and every build started (all at once) and ready; everything stopped on
    exit. ``max_tokens``: the longest answer a request may ask for."""
    with contextlib.ExitStack() as stack:
        result = _start_fakes(stack, engine, max_tokens, log_dir, startup_timeout)
        for build in builds:
            child, port = _start_router(build, engine, result.ports, log_dir)
            result.routers[build.name] = (stack.enter_context(child), port)
            result.headers[build.name] = build.headers
            if build.callers is not None:
                result.callers[build.name] = build.callers
        deadline = time.monotonic() + startup_timeout
        for build in builds:
            _wait_router(build, *result.routers[build.name], deadline)
        yield result


# ---------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunBudget:
    """What each load-generator run may send: measured requests, seconds, warmup per user."""

    requests: int
    duration: float
    warmup: int


def measure_run(
    stack: EngineStack, target: str, cell: Cell, repeat: int, budget: RunBudget
) -> RunRecord:
    """One load-generator run against ``target`` (a build's name, or ``direct``); a failed run
    (request errors, a load generator or router failure) comes back as a record that says so.
    Raises ``BenchError`` if a fake engine died: nothing after that could be measured."""
    where = RunRecord(
        stack.engine, target, repeat, cell.tokens, cell.concurrency, cell.stream, ok=False
    )
    router = stack.routers.get(target)
    if router is not None and router[0].exit_code is not None:
        return msgspec.structs.replace(where, failure=f"not run: {target} exited earlier")
    load: LoadResult | None = None
    try:
        argv = target_loadgen_argv(stack, target, cell, budget)
        load = run.run_loadgen(argv, _timeout(cell, budget))
        failure = _failure(load)
    except BenchError as exc:
        failure = f"load generator: {exc}"
    for fake in (stack.prefill, stack.decode):
        run.check_alive(fake)
    if router is not None and router[0].exit_code is not None:
        failure = f"{target} exited with code {router[0].exit_code}\n{router[0].log_tail()}"
    return _record(where, load, failure)


def target_loadgen_argv(
    stack: EngineStack, target: str, cell: Cell, budget: RunBudget
) -> list[str]:
    """The load generator's command line for one run of ``cell`` on ``target`` (a build's
    name, or ``DIRECT``): the build's own callers and headers, if it has any."""
    cfg = run.BenchConfig(requests=budget.requests, duration=budget.duration, warmup=budget.warmup)
    router = stack.routers.get(target)
    if router is None:
        spec = run.RunSpec(DIRECT, cell.concurrency, cell.tokens, cell.stream)
        watch = {"decode": stack.decode.pid}
        return run.loadgen_argv(cfg, stack.ports.decode, spec, watch, stack.direct_extra)
    callers = stack.callers.get(target, cell.concurrency)
    spec = run.RunSpec("router", callers, cell.tokens, cell.stream)
    headers = stack.headers.get(target, ())
    return run.loadgen_argv(cfg, router[1], spec, {"router": router[0].pid}, {}, headers)


def _timeout(cell: Cell, budget: RunBudget) -> float:
    return budget.duration + LOADGEN_SLACK_S + budget.warmup * cell.concurrency * 0.05


def _failure(load: LoadResult) -> str | None:
    if load.errors:
        samples = "; ".join(load.error_samples[:3])
        return f"{load.errors} request errors ({load.completed} completed): {samples}"
    if not load.completed:
        return "no request completed"
    return None


def _record(where: RunRecord, load: LoadResult | None, failure: str | None) -> RunRecord:
    if load is None:
        return msgspec.structs.replace(where, failure=failure)
    cpu_s = load.watched_cpu_s.get("router")
    cpu_us = None if cpu_s is None else 1e6 * cpu_s / max(load.completed, 1)
    return msgspec.structs.replace(
        where,
        ok=failure is None,
        failure=failure,
        router_cpu_us=cpu_us,
        latency_p50_ms=load.latency_ms.p50,
        load=load,
    )
