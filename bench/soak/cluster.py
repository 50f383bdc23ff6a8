"""The soak's ``pd-cluster``: its processes (found in ``/proc``), their resources, a monitor.

``SoakCluster`` starts ``python -m worker.cluster --restart-workers`` (``bench.common.cluster``:
its own session, always stopped), finds the router and every worker among its children by their
command lines, and reads the router's open file descriptors, RSS and threads from ``/proc``.
``Monitor`` samples, every ``interval`` s, the router's ``/status/data`` (worker health, which
workers it keeps traffic away from, open breakers, readiness, registry state) and each worker's
``GET /debug/fault`` (its boot id and count of completions answered 200), for the recovery times.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.common.cluster import cluster_argv, router_pid, start_cluster
from bench.common.process import BenchError, children, cmdline, free_port

__all__ = [
    "Monitor",
    "ProcStats",
    "Sample",
    "SoakCluster",
    "WorkerProc",
    "inflight",
    "out_of_rotation",
    "proc_stats",
]

_HOST = "127.0.0.1"


@dataclass(frozen=True)
class WorkerProc:
    pid: int
    role: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{_HOST}:{self.port}"


@dataclass(frozen=True)
class ProcStats:
    fds: int
    rss_kib: int
    threads: int
    tasks: int = -1  # asyncio tasks in the router's loop (its /metrics); -1: not read


def proc_stats(pid: int) -> ProcStats:
    fields: dict[str, str] = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return ProcStats(
        len(os.listdir(f"/proc/{pid}/fd")),
        int(fields["VmRSS"].split()[0]),
        int(fields["Threads"]),
    )


def _flag(argv: Sequence[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


class SoakCluster:
    """One running ``pd-cluster`` with the fault API on every worker."""

    def __init__(
        self,
        engine: str,
        prefill: int,
        decode: int,
        router_args: Sequence[str],
        worker_args: Sequence[str],
        ready_timeout_s: float = 90.0,
    ) -> None:
        self.port = free_port()
        self.url = f"http://{_HOST}:{self.port}"
        argv = cluster_argv(
            prefills=prefill,
            decodes=decode,
            port=self.port,
            engine=engine,
            ready_timeout_s=ready_timeout_s,
            flags=["--restart-workers", *(f"--router-arg={arg}" for arg in router_args)],
            worker_args=["--fault-api", *worker_args],
        )
        self.child, _url = start_cluster(argv, ready_timeout_s)
        pid = router_pid(self.child.pid)
        if pid is None:
            self.child.stop()
            raise BenchError(self.child.describe("no router process among pd-cluster's children"))
        self.router_pid = pid

    def workers(self, role: str | None = None) -> list[WorkerProc]:
        """The live workers (``role``: only those), ordered by port."""
        found = []
        for pid in children(self.child.pid):
            argv = cmdline(pid)
            if argv[1:3] != ["-m", "worker"]:
                continue
            kind, port = _flag(argv, "--role"), _flag(argv, "--port")
            if kind is not None and port is not None and role in (None, kind):
                found.append(WorkerProc(pid, kind, int(port)))
        return sorted(found, key=lambda w: w.port)

    def alive(self) -> bool:
        return self.child.exit_code is None

    def router_stats(self) -> ProcStats:
        return proc_stats(self.router_pid)

    def stop(self) -> None:
        self.child.note_descendants()
        self.child.stop()


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the soak's t0
    registry_ok: bool | None  # None: /status/data did not answer
    healthy: dict[str, bool]  # worker URL -> the router's view
    inflight: int  # requests in flight at the router, all workers
    served: dict[int, tuple[str, int] | None]  # worker port -> (boot id, served_ok) | no answer
    roles: dict[str, str] = field(default_factory=dict)  # worker URL -> prefill | decode
    out: frozenset[str] = frozenset()  # worker URLs out of rotation (``out_of_rotation``)
    decode_breakers: frozenset[str] = frozenset()  # decodes whose own breaker is not closed
    ready: bool | None = None  # a usable prefill and decode (what /ready says); None: no answer


@dataclass
class Monitor:
    """Samples the router's and the workers' state until stopped."""

    cluster: SoakCluster
    clock: Callable[[], float]
    interval: float = 0.25
    samples: list[Sample] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        timeout = httpx.Timeout(max(self.interval * 2, 0.5))
        async with httpx.AsyncClient(timeout=timeout) as http:
            while not stop.is_set():
                started = time.monotonic()
                self.samples.append(await self._sample(http))
                self.cluster.child.note_descendants()  # restarted workers, for the final stop
                with contextlib.suppress(TimeoutError):
                    left = self.interval - (time.monotonic() - started)
                    await asyncio.wait_for(stop.wait(), max(left, 0.01))

    async def _sample(self, http: httpx.AsyncClient) -> Sample:
        t = self.clock()
        workers = self.cluster.workers()
        ports = sorted({w.port for w in workers} | self._known_ports())
        status, *served = await asyncio.gather(
            _get_json(http, f"{self.cluster.url}/status/data"),
            *(_get_json(http, f"http://{_HOST}:{port}/debug/fault") for port in ports),
        )
        rows = [] if status is None else _rows(status)
        return Sample(
            t,
            None if status is None else bool(status["registry"]["ok"]),
            {_url(w): bool(w["healthy"]) for w in rows},
            0 if status is None else inflight(status),
            {
                port: None if state is None else (str(state["boot_id"]), int(state["served_ok"]))
                for port, state in zip(ports, served, strict=True)
            },
            {_url(w): str(w["role"]) for w in rows},
            frozenset(_url(w) for w in rows if out_of_rotation(w)),
            frozenset(_url(w) for w in rows if w["role"] == "decode" and w.get("circuit")),
            None if status is None else bool(status["ready"]),
        )

    def _known_ports(self) -> set[int]:
        return {port for sample in self.samples[:1] for port in sample.served}


async def _get_json(http: httpx.AsyncClient, url: str) -> Any:
    try:
        response = await http.get(url)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _rows(status: dict[str, Any]) -> list[dict[str, Any]]:
    return list(status["workers"]["prefill"]) + list(status["workers"]["decode"])


def _url(row: dict[str, Any]) -> str:
    return str(row["url"]).rstrip("/")


def out_of_rotation(row: dict[str, Any]) -> bool:
    """Whether the router keeps normal traffic away from this ``/status/data`` worker row: not
    healthy, ejected by outlier detection (a truthy ``ejected``, if the router reports it) or its
    own breaker open (half-open lets one trial through: not counted)."""
    circuit = row.get("circuit") or {}
    return not row["healthy"] or bool(row.get("ejected")) or circuit.get("state") == "open"


def inflight(status: dict[str, Any]) -> int:
    """Requests in flight at the router (its ``/status/data``), over every worker."""
    workers = status["workers"]["prefill"] + status["workers"]["decode"]
    return sum(int(w["inflight"]) for w in workers)
