"""The soak's faults: a schedule, and what each fault does to the running cluster.

Worker faults go through the workers' opt-in fault API (``pd-worker --fault-api``:
``POST /debug/fault``) or signals to a worker's process group (pd-cluster ``--restart-workers``
starts a killed worker again on its ports). The frozen prefill is one of the two prefills
SIGSTOPped under load: the fault also polls the router's ``/status/data`` for the moment it
takes that prefill out of rotation (``cluster.out_of_rotation``). etcd is stopped and started
again on the same ports and data dir, or (empty etcd) started again on a fresh data dir: the
store comes back without a key. The KV-pool-full burst sends prompts bigger than what the pools
hold at once. The attacks (``bench.soak.attacks``: large bodies, a chunked trailer flood, idle
keep-alive connections, slowloris) come from another source address, under a ``RouterWatch``
(``bench.soak.watch``: the router's peak RSS and ``/health`` latency) while completions on new
connections keep arriving. Faults run one after the other, each at its offset from the start
(later when the one before ran long). Each yields a ``FaultRun``: when it started and ended
(soak clock), on what, and what it measured itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import httpx

from bench.soak import attacks
from bench.soak.cluster import SoakCluster, WorkerProc, out_of_rotation
from bench.soak.traffic import Outcome, client, long_prompt, send
from bench.soak.watch import RouterWatch, fresh_requests
from testkit.etcd_server import EtcdServer

__all__ = [
    "ATTACKS",
    "FULL",
    "LABELS",
    "SHORT",
    "FaultParams",
    "FaultRun",
    "FaultSpec",
    "run_schedule",
]

LABELS = {
    "prefill_5xx": "prefill 5xx",
    "decode_sigkill": "decode SIGKILL mid-stream",
    "prefill_sigstop": "frozen prefill (1 of 2)",
    "etcd_stop": "etcd stopped",
    "etcd_empty": "empty etcd",
    "slow_decode": "slow decode",
    "kv_burst": "KV-pool-full burst",
    "big_bodies": "large bodies",
    "trailer_flood": "chunked trailer flood",
    "conn_flood": "idle keep-alive flood",
    "slowloris": "slowloris",
}
ATTACKS = frozenset({"big_bodies", "trailer_flood", "conn_flood", "slowloris"})
ETCD_FAULTS = frozenset({"etcd_stop", "etcd_empty"})


@dataclass(frozen=True)
class FaultSpec:
    kind: str  # a key of LABELS
    at_s: float  # offset from the start of the traffic
    duration_s: float = 0.0


FULL = (
    FaultSpec("prefill_5xx", 10, 5),
    FaultSpec("decode_sigkill", 25),
    FaultSpec("prefill_sigstop", 45, 15),
    FaultSpec("etcd_stop", 75, 15),
    FaultSpec("slow_decode", 100, 10),
    FaultSpec("kv_burst", 120),
    FaultSpec("trailer_flood", 135, 5),  # before the bodies: RSS they leave would hide its own
    FaultSpec("big_bodies", 150),  # as long as the bodies take
    FaultSpec("conn_flood", 165, 10),
    FaultSpec("slowloris", 185, 15),  # past the router's --header-timeout (10 s)
    FaultSpec("etcd_empty", 210, 5),  # last: a fleet emptied by it fails everything after
)
SHORT = (
    FaultSpec("prefill_sigstop", 3, 6),  # first: nothing else recovering meanwhile
    FaultSpec("prefill_5xx", 13, 1.5),
    FaultSpec("decode_sigkill", 18),
    FaultSpec("kv_burst", 26),
    FaultSpec("trailer_flood", 29, 2),  # before the bodies: RSS they leave would hide its own
    FaultSpec("big_bodies", 32),
    FaultSpec("conn_flood", 36, 3),
    FaultSpec("slowloris", 40, 2),
    FaultSpec("etcd_empty", 43, 1.5),
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
    big_bodies: int = 8
    big_body_bytes: int = 28_000_000  # under the router's --max-body-bytes (32 MiB)
    big_body_pace_s: float = 0.05  # between 1 MiB writes
    trailer_connections: int = 4
    trailer_bytes: int = 256 * 2**20  # per connection, at most
    conn_flood_connections: int = 600  # past the soak router's --max-connections (512)
    slowloris_connections: int = 100
    slowloris_interval_s: float = 1.0
    fresh_every_s: float = 0.2  # a completion on a new connection, during an attack
    body_budget_mib: float = 2048.0  # the router's --max-body-memory (main.py reads it)
    rss_slack_mib: float = 128.0  # RSS bound of an attack: before it + this (+ the budget)


@dataclass
class FaultRun:
    spec: FaultSpec
    start: float
    end: float
    target: str  # a worker URL, "etcd" or "router"
    note: str = ""
    outcomes: list[Outcome] = field(default_factory=list)  # requests the fault itself sent
    measures: dict[str, float] = field(default_factory=dict)  # what the fault measured itself

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
        if spec.kind in ATTACKS:
            return await self._attack(spec)
        faults: dict[str, Callable[[FaultSpec], Awaitable[FaultRun]]] = {
            "prefill_5xx": self._prefill_5xx,
            "decode_sigkill": self._decode_sigkill,
            "prefill_sigstop": self._prefill_sigstop,
            "etcd_stop": self._etcd_stop,
            "etcd_empty": self._etcd_stop,
            "slow_decode": self._slow_decode,
            "kv_burst": self._kv_burst,
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
        """SIGSTOP the last prefill for ``duration_s``; ``detection_s``: until the router's
        ``/status/data`` first showed it out of rotation (absent: never while frozen)."""
        worker = self._worker("prefill", last=True)
        start = self.clock()
        os.killpg(worker.pid, signal.SIGSTOP)
        try:
            seen = await _wait_out(self.cluster.url, worker.url, spec.duration_s)
            await asyncio.sleep(max(spec.duration_s - (time.monotonic() - seen[1]), 0.0))
        finally:
            os.killpg(worker.pid, signal.SIGCONT)
        measures = {} if seen[0] is None else {"detection_s": round(seen[0], 2)}
        return FaultRun(spec, start, self.clock(), worker.url, "", [], measures)

    async def _etcd_stop(self, spec: FaultSpec) -> FaultRun:
        """Stop etcd for ``duration_s``; start it again on its data dir, or (``etcd_empty``) on
        a fresh one: a store without a key, like a new cluster or a wiped prefix."""
        if self.etcd is None:
            raise RuntimeError(f"{spec.kind} needs the router on etcd")
        start = self.clock()
        await asyncio.to_thread(self.etcd.stop)
        try:
            await asyncio.sleep(spec.duration_s)
            if spec.kind == "etcd_empty":
                await asyncio.to_thread(shutil.rmtree, self.etcd.data_dir / "data", True)
        finally:
            await asyncio.to_thread(self.etcd.start)
        fresh = "a fresh data dir (no key)" if spec.kind == "etcd_empty" else "its data dir"
        return FaultRun(spec, start, self.clock(), "etcd", f"restarted on {fresh} and ports")

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

    def _launch(self, spec: FaultSpec, body: bytes) -> Awaitable[attacks.AttackResult]:
        p, port = self.params, self.cluster.port
        if spec.kind == "big_bodies":
            return attacks.big_bodies(port, body, p.big_bodies, p.big_body_pace_s, p.deadline_s)
        if spec.kind == "trailer_flood":
            body = b'{"model": "%s", "prompt": "hi", "max_tokens": 1}' % p.model.encode()
            return attacks.trailer_flood(
                port, body, p.trailer_connections, p.trailer_bytes, spec.duration_s
            )
        if spec.kind == "conn_flood":
            return attacks.conn_flood(port, p.conn_flood_connections, spec.duration_s)
        return attacks.slowloris(
            port, p.slowloris_connections, spec.duration_s, p.slowloris_interval_s
        )

    async def _attack(self, spec: FaultSpec) -> FaultRun:
        """An attack under a ``RouterWatch``, with completions on new connections meanwhile."""
        p, stop = self.params, asyncio.Event()
        big = spec.kind == "big_bodies"
        body = await asyncio.to_thread(attacks.logit_bias_body, p.model, p.big_body_bytes * big)
        async with RouterWatch(self.cluster.router_pid, self.cluster.port) as watch:
            start = self.clock()
            probing = asyncio.create_task(
                fresh_requests(
                    self.cluster.url,
                    stop,
                    every_s=p.fresh_every_s,
                    most=int(p.deadline_s / p.fresh_every_s),
                    model=p.model,
                    deadline_s=p.deadline_s,
                    clock=self.clock,
                )
            )
            try:
                result = await self._launch(spec, body)
            finally:
                stop.set()
                probes = await probing
        end = self.clock()
        measures = watch.result.measures()
        budget = p.body_budget_mib if big else 0.0
        measures["rss_bound_mib"] = measures["rss_base_mib"] + budget + p.rss_slack_mib
        return FaultRun(spec, start, end, "router", result.note, probes, measures | result.measures)


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


async def _wait_out(router: str, worker: str, limit_s: float) -> tuple[float | None, float]:
    """Poll the router's ``/status/data`` until it shows ``worker`` out of rotation: (seconds
    it took or None after ``limit_s``, the monotonic time the poll began)."""
    began = time.monotonic()
    async with httpx.AsyncClient(timeout=1.0) as http:
        while (waited := time.monotonic() - began) < limit_s:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                status = (await http.get(f"{router}/status/data")).json()
                rows = status["workers"]["prefill"]
                if any(str(r["url"]).rstrip("/") == worker and out_of_rotation(r) for r in rows):
                    return waited, began
            await asyncio.sleep(0.1)
    return None, began


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
