"""The soak's faults: a schedule, and what each fault does to the running cluster.

Worker faults go through the workers' opt-in fault API (``pd-worker --fault-api``:
``POST /debug/fault``) or signals to a worker's process group (pd-cluster ``--restart-workers``
starts a killed worker again on its ports); etcd is stopped and started again on the same ports
and data dir; the KV-pool-full burst sends prompts bigger than what the pools hold at once;
slowloris connections send a request head one header line per interval and never finish it.
Faults run one after the other, each at its offset from the start (later when the one before ran
long). Each yields a ``FaultRun``: when it started and ended (soak clock) and on what.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import httpx

from bench.soak.cluster import SoakCluster, WorkerProc
from bench.soak.traffic import Outcome, client, long_prompt, send
from testkit.etcd_server import EtcdServer

__all__ = ["FULL", "LABELS", "SHORT", "FaultParams", "FaultRun", "FaultSpec", "run_schedule"]

LABELS = {
    "prefill_5xx": "prefill 5xx",
    "decode_sigkill": "decode SIGKILL mid-stream",
    "prefill_sigstop": "prefill SIGSTOP",
    "etcd_stop": "etcd stopped",
    "slow_decode": "slow decode",
    "kv_burst": "KV-pool-full burst",
    "slowloris": "slowloris",
}


@dataclass(frozen=True)
class FaultSpec:
    kind: str  # a key of LABELS
    at_s: float  # offset from the start of the traffic
    duration_s: float = 0.0


FULL = (
    FaultSpec("prefill_5xx", 10, 5),
    FaultSpec("decode_sigkill", 25),
    FaultSpec("prefill_sigstop", 45, 10),
    FaultSpec("etcd_stop", 70, 15),
    FaultSpec("slow_decode", 95, 10),
    FaultSpec("kv_burst", 115),
    FaultSpec("slowloris", 125, 15),  # past the router's --header-timeout (10 s)
)
SHORT = (
    FaultSpec("prefill_5xx", 2, 1.5),
    FaultSpec("decode_sigkill", 5),
    FaultSpec("prefill_sigstop", 9, 2),
    FaultSpec("kv_burst", 13),
    FaultSpec("slowloris", 15, 2),
)


@dataclass(frozen=True)
class FaultParams:
    model: str = "sim-model"
    deadline_s: float = 60.0
    slow_s_per_token: float = 0.1
    victim_streams: int = 8
    victim_tokens: int = 200
    burst_requests: int = 24
    burst_prompt_chars: int = 3000
    slowloris_connections: int = 100
    slowloris_interval_s: float = 1.0


@dataclass
class FaultRun:
    spec: FaultSpec
    start: float
    end: float
    target: str  # a worker URL, "etcd" or "router"
    note: str = ""
    outcomes: list[Outcome] = field(default_factory=list)  # requests the fault itself sent

    @property
    def label(self) -> str:
        return LABELS[self.spec.kind]


class _Injector:
    def __init__(
        self,
        cluster: SoakCluster,
        etcd: EtcdServer | None,
        params: FaultParams,
        clock: Callable[[], float],
    ) -> None:
        self.cluster = cluster
        self.etcd = etcd
        self.params = params
        self.clock = clock
        self.rng = random.Random(7)

    def _worker(self, role: str, last: bool) -> WorkerProc:
        workers = self.cluster.workers(role)
        if not workers:
            raise RuntimeError(f"no live {role} worker")
        return workers[-1] if last else workers[0]

    async def run(self, spec: FaultSpec) -> FaultRun:
        faults: dict[str, Callable[[FaultSpec], Awaitable[FaultRun]]] = {
            "prefill_5xx": self._prefill_5xx,
            "decode_sigkill": self._decode_sigkill,
            "prefill_sigstop": self._prefill_sigstop,
            "etcd_stop": self._etcd_stop,
            "slow_decode": self._slow_decode,
            "kv_burst": self._kv_burst,
            "slowloris": self._slowloris,
        }
        return await faults[spec.kind](spec)

    async def _fault_api(self, worker: WorkerProc, spec: FaultSpec, body: dict[str, float]) -> None:
        async with httpx.AsyncClient(timeout=5.0) as http:
            (await http.post(f"{worker.url}/debug/fault", json=body)).raise_for_status()
        await asyncio.sleep(spec.duration_s)

    async def _prefill_5xx(self, spec: FaultSpec) -> FaultRun:
        worker = self._worker("prefill", last=False)
        start = self.clock()
        await self._fault_api(worker, spec, {"http_5xx_s": spec.duration_s})
        return FaultRun(spec, start, self.clock(), worker.url)

    async def _slow_decode(self, spec: FaultSpec) -> FaultRun:
        worker = self._worker("decode", last=True)
        start = self.clock()
        extra = self.params.slow_s_per_token
        await self._fault_api(worker, spec, {"slow_s": spec.duration_s, "slow_s_per_token": extra})
        return FaultRun(spec, start, self.clock(), worker.url, f"+{extra:g} s/token")

    async def _decode_sigkill(self, spec: FaultSpec) -> FaultRun:
        """SIGKILL a decode while long streams run on it (``victim_streams`` of them sent to
        the router, killed once the router counts one in flight there, or after 3 s)."""
        worker, p = self._worker("decode", last=False), self.params
        victims = [
            long_prompt(self.rng, p.model, 64, spec.kind, max_tokens=p.victim_tokens, stream=True)
            for _ in range(p.victim_streams)
        ]
        async with client(len(victims)) as http:
            sending = asyncio.gather(
                *(send(http, self.cluster.url, v, p.deadline_s, self.clock) for v in victims)
            )
            busy = await _wait_inflight(http, self.cluster.url, worker.url, 3.0)
            start = self.clock()
            os.killpg(worker.pid, signal.SIGKILL)
            outcomes = await sending
        cut = sum(1 for o in outcomes if not o.ok)
        note = f"{busy} in flight there; {cut} of {len(victims)} long streams ended with an error"
        return FaultRun(spec, start, start, worker.url, note, list(outcomes))

    async def _prefill_sigstop(self, spec: FaultSpec) -> FaultRun:
        worker = self._worker("prefill", last=True)
        start = self.clock()
        os.killpg(worker.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(spec.duration_s)
        finally:
            os.killpg(worker.pid, signal.SIGCONT)
        return FaultRun(spec, start, self.clock(), worker.url)

    async def _etcd_stop(self, spec: FaultSpec) -> FaultRun:
        if self.etcd is None:
            raise RuntimeError("etcd_stop needs the router on etcd")
        start = self.clock()
        await asyncio.to_thread(self.etcd.stop)
        try:
            await asyncio.sleep(spec.duration_s)
        finally:
            await asyncio.to_thread(self.etcd.start)
        return FaultRun(spec, start, self.clock(), "etcd", "restarted on its data dir and ports")

    async def _kv_burst(self, spec: FaultSpec) -> FaultRun:
        p = self.params
        specs = [
            long_prompt(self.rng, p.model, p.burst_prompt_chars, spec.kind)
            for _ in range(p.burst_requests)
        ]
        start = self.clock()
        async with client(len(specs)) as http:
            outcomes = await asyncio.gather(
                *(send(http, self.cluster.url, s, p.deadline_s, self.clock) for s in specs)
            )
        statuses = sorted({o.status for o in outcomes})
        note = f"{len(specs)} x {p.burst_prompt_chars}-token prompts, statuses {statuses}"
        return FaultRun(spec, start, self.clock(), "router", note, list(outcomes))

    async def _slowloris(self, spec: FaultSpec) -> FaultRun:
        p = self.params
        start = self.clock()
        closed = await _slowloris(
            self.cluster.port, p.slowloris_connections, spec.duration_s, p.slowloris_interval_s
        )
        return FaultRun(spec, start, self.clock(), "router", _slowloris_note(closed))


async def _wait_inflight(http: httpx.AsyncClient, router: str, worker: str, limit_s: float) -> int:
    """Poll the router's ``/status/data`` until ``worker`` has requests in flight (their count;
    0 after ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            status = (await http.get(f"{router}/status/data")).json()
            for row in status["workers"]["decode"]:
                if str(row["url"]).rstrip("/") == worker and row["inflight"] > 0:
                    return int(row["inflight"])
        await asyncio.sleep(0.05)
    return 0


_REFUSED = -1.0


async def _slow_connection(port: int, duration_s: float, interval_s: float) -> float | None:
    """One slowloris connection: seconds until the server closed or answered it, None if it
    stayed open for ``duration_s``, ``_REFUSED`` if it could not connect."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5.0)
    except (OSError, TimeoutError):
        return _REFUSED
    opened = time.monotonic()
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        while (left := duration_s - (time.monotonic() - opened)) > 0:
            await writer.drain()
            try:
                await asyncio.wait_for(reader.read(4096), min(interval_s, left))
            except TimeoutError:
                writer.write(b"X-Slow: a\r\n")
                continue
            return time.monotonic() - opened  # an answer (408?) or EOF: the server gave up
        return None
    except OSError:
        return time.monotonic() - opened
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _slowloris(
    port: int, connections: int, duration_s: float, interval_s: float
) -> list[float | None]:
    return list(
        await asyncio.gather(
            *(_slow_connection(port, duration_s, interval_s) for _ in range(connections))
        )
    )


def _slowloris_note(closed: Sequence[float | None]) -> str:
    refused = sum(1 for c in closed if c == _REFUSED)
    ended = [c for c in closed if c is not None and c != _REFUSED]
    held = sum(1 for c in closed if c is None)
    when = f" (median after {statistics.median(ended):.1f} s)" if ended else ""
    ended_by = f"{len(ended)} closed by the router{when}"
    return f"{len(closed)} conns: {ended_by}, {held} held, {refused} refused"


async def run_schedule(
    cluster: SoakCluster,
    etcd: EtcdServer | None,
    schedule: Sequence[FaultSpec],
    params: FaultParams,
    clock: Callable[[], float],
) -> list[FaultRun]:
    """Run every fault at its offset (soak clock), one after the other."""
    injector = _Injector(cluster, etcd, params, clock)
    runs = []
    for spec in schedule:
        await asyncio.sleep(max(spec.at_s - clock(), 0.0))
        runs.append(await injector.run(spec))
    return runs
