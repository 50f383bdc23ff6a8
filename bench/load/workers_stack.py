"""What ``bench.load.workers`` runs and where: the cores of the router and of its helpers (fake
engines, load generators), how many helpers, the fake engines, and a router of N processes.

Every process is a ``Child`` in a session of its own, killed if the benchmark dies, stopped
(SIGTERM, then SIGKILL after a grace period) when its ``with`` block is left.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.common.process import LOOPBACK, REPO_ROOT, BenchError, Child, free_port, free_ports
from bench.load import run
from bench.load.worker_procs import serving_processes

__all__ = [
    "SPARE_CORES",
    "Fake",
    "Fakes",
    "Placement",
    "Router",
    "auto_fakes",
    "auto_loadgens",
    "placement",
    "router_argv",
    "router_env",
    "running_fakes",
    "running_router",
]

# CPU per request of a fake pair and of the load generator, relative to the router's
# (measured by this benchmark, 16 tokens: fakes ~1.0 non-streaming and ~1.6 streaming, load
# generator ~0.2): what sizes the automatic helper counts.
FAKE_COST, LOADGEN_COST = 1.3, 0.3
HELPER_BUSY = 0.6  # the share of a core each helper process is sized to use
SPARE_CORES = 4  # a pinned layout needs N + this many cores
ENV_DROPPED = ("PDR_SERVER__WORKERS", "PDR_SERVER__WORKER_SOCKETS")


# ---------------------------------------------------------------------------------------------
# Placement and sizes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where N router processes run: ``router`` cores and ``helpers`` cores (fakes and load
    generators), or everything on ``cpus`` unpinned (``router`` empty)."""

    cpus: tuple[int, ...]
    router: tuple[int, ...] = ()
    helpers: tuple[int, ...] = ()

    @property
    def pinned(self) -> bool:
        return bool(self.router)

    @property
    def helper_cpus(self) -> tuple[int, ...]:
        return self.helpers or self.cpus

    def describe(self, n: int) -> str:
        if not self.pinned:
            cores = len(self.cpus)
            return f"unpinned ({cores} cores < N + {SPARE_CORES} = {n + SPARE_CORES})"
        return (
            f"router on cores {_ranges(self.router)}, fakes + loadgens on {_ranges(self.helpers)}"
        )


def _ranges(cpus: Sequence[int]) -> str:
    spans: list[list[int]] = []
    for cpu in sorted(cpus):
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


def placement(n: int, cpus: Sequence[int]) -> Placement:
    """The first N of ``cpus`` for the router when N + ``SPARE_CORES`` fit, else unpinned."""
    ordered = tuple(sorted(cpus))
    if len(ordered) < n + SPARE_CORES:
        return Placement(ordered)
    return Placement(ordered, ordered[:n], ordered[n:])


def auto_fakes(max_n: int, cpus: int) -> int:
    """Fake pairs: enough that none is busier than ``HELPER_BUSY`` at the largest N, at most
    a third of the cores (the pairs' processes: two thirds)."""
    wanted = math.ceil(FAKE_COST * max_n / (2 * HELPER_BUSY))
    return max(1, min(wanted, cpus // 3))


def auto_loadgens(n: int, cpus: int) -> int:
    """Load generators for N: enough that none is busier than ``HELPER_BUSY``, at most a
    quarter of the cores."""
    wanted = math.ceil(LOADGEN_COST * n / HELPER_BUSY)
    return max(1, min(wanted, cpus // 4))


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fake:
    role: str
    child: Child
    port: int
    bootstrap: int | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


@dataclass
class Fakes:
    """F fake prefills and F fake decodes, all serving."""

    members: list[Fake] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        return [fake.child.pid for fake in self.members]

    def router_args(self) -> list[str]:
        args: list[str] = []
        for fake in self.members:
            if fake.role == "prefill":
                args += ["--prefill", fake.url, str(fake.bootstrap)]
            else:
                args += ["--decode", fake.url]
        return args

    def check_alive(self) -> None:
        for fake in self.members:
            run.check_alive(fake.child)


@contextlib.contextmanager
def running_fakes(
    engine: str, tokens: int, count: int, log_dir: Path, timeout_s: float
) -> Iterator[Fakes]:
    """``count`` fake pairs of protocol ``engine`` answering up to ``tokens`` tokens, all
    ready within ``timeout_s``; all stopped on exit."""
    fake_cfg = run.BenchConfig(engine=engine, tokens=tokens, event_tokens=tokens)
    ports = free_ports(3 * count)
    fakes = Fakes()
    with contextlib.ExitStack() as stack:
        for i in range(count):
            http, boot, decode = ports[3 * i : 3 * i + 3]
            prefill_argv = run.fake_argv("prefill", fake_cfg, http, boot)
            child = stack.enter_context(run.managed(f"prefill-{i}", prefill_argv, log_dir))
            fakes.members.append(Fake("prefill", child, http, boot))
            decode_argv = run.fake_argv("decode", fake_cfg, decode, None)
            child = stack.enter_context(run.managed(f"decode-{i}", decode_argv, log_dir))
            fakes.members.append(Fake("decode", child, decode))
        deadline = time.monotonic() + timeout_s
        for fake in fakes.members:
            run.wait_ready(fake.child, f"{fake.url}/health", deadline)
        yield fakes


@dataclass(frozen=True)
class Router:
    child: Child
    port: int
    serving: list[int]


def router_argv(engine: str, fakes: Fakes, port: int, n: int, sockets: str) -> list[str]:
    """Round robin over every fake, no per-source connection cap (every load generator
    connects from 127.0.0.1), ``--workers`` only for N > 1."""
    argv = [sys.executable, "-m", "router", "--engine", engine, *fakes.router_args()]
    argv += ["--host", LOOPBACK, "--port", str(port), "--policy", "round_robin"]
    argv += ["--max-connections-per-source", "0", "--log-level", "warning"]
    return argv + (["--workers", str(n), "--worker-sockets", sockets] if n > 1 else [])


def router_env() -> dict[str, str]:
    """Ours, without a process count from the environment, this checkout on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_DROPPED}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _wait_serving(child: Child, port: int, n: int, deadline: float) -> list[int]:
    while True:
        run.check_alive(child)
        serving = serving_processes(child.pid, port, supervised=n > 1)
        if len(serving) == n:
            return serving
        if time.monotonic() >= deadline:
            raise BenchError(f"{len(serving)} of {n} router processes serve port {port} in time")
        time.sleep(0.1)


@contextlib.contextmanager
def running_router(
    engine: str, fakes: Fakes, n: int, sockets: str, log_dir: Path, timeout_s: float
) -> Iterator[Router]:
    """A router of N processes in front of ``fakes``, ready and every process serving within
    ``timeout_s``; stopped on exit."""
    port = free_port()
    name = f"router-{n}-{sockets}"
    argv = router_argv(engine, fakes, port, n, sockets)
    with Child(
        argv,
        name=name,
        log_path=log_dir / f"{name}.log",
        env=router_env(),
        die_with_parent=True,
        stop_grace_s=run.STOP_GRACE_S,
    ) as child:
        deadline = time.monotonic() + timeout_s
        run.wait_ready(child, f"http://{LOOPBACK}:{port}/ready", deadline)
        yield Router(child, port, _wait_serving(child, port, n, deadline))
