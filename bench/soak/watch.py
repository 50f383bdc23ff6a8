"""What an attack does to the router while it runs: its peak RSS, ``/health`` latency, new clients.

``RouterWatch`` (``async with``) samples the router's VmRSS from ``/proc`` every ``interval_s``
in a thread, and times ``GET /health`` on a new connection from 127.0.0.1 every ``interval_s`` in
a process of its own (``bench.common.health_probe``: the soak's event loop is busy with the traffic
and the attack, and a probe timed in this process would measure its GIL), until the block ends
or ``max_s``. The peak RSS is also the router's VmHWM, reset when the watch starts
(``/proc/PID/clear_refs``, where allowed). ``fresh_requests`` sends small mixed completions
meanwhile, each on a new connection: a client that arrives during the attack must be served like
any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

import httpx

from bench.common.health_probe import FAILED
from bench.common.process import REPO_ROOT
from bench.soak.traffic import Outcome, mixed_request, send

__all__ = ["PROBE_TAG", "RouterWatch", "WatchResult", "fresh_requests"]

PROBE_TAG = "probe"  # the tag of ``fresh_requests``' outcomes
_STOP_S = 5.0  # for the probe process to go once told to


def _status_kib(pid: int, key: str) -> int:
    """A ``/proc/PID/status`` memory line (``VmRSS``, ``VmHWM``) in KiB; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _reset_peak(pid: int) -> None:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/clear_refs", "w") as refs:
        refs.write("5")  # VmHWM := VmRSS


@dataclass
class WatchResult:
    base_rss_kib: int = 0  # when the watch started
    peak_rss_kib: int = 0
    health_ms: list[float] = field(default_factory=list)  # the probes that answered 200
    health_failed: int = 0

    def measures(self) -> dict[str, float]:
        return {
            "rss_base_mib": round(self.base_rss_kib / 1024, 1),
            "rss_peak_mib": round(self.peak_rss_kib / 1024, 1),
            "health_max_ms": round(max(self.health_ms, default=0.0), 1),
            "health_probes": len(self.health_ms) + self.health_failed,
            "health_failed": self.health_failed,
        }

    def add_probes(self, lines: list[str]) -> None:
        for line in lines:
            if line.strip() == FAILED:
                self.health_failed += 1
            else:
                with contextlib.suppress(ValueError):
                    self.health_ms.append(float(line))


class RouterWatch:
    """``async with RouterWatch(pid, port) as watch: ...`` then ``watch.result``."""

    def __init__(
        self,
        pid: int,
        port: int,
        *,
        interval_s: float = 0.05,
        timeout_s: float = 2.0,
        max_s: float = 120.0,
    ) -> None:
        self.pid = pid
        self.port = port
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_s = max_s
        self.result = WatchResult()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="router-rss", daemon=True)
        self._probe: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> Self:
        """Starts the probe process and returns once it answered its first probe."""
        argv = [sys.executable, "-m", "bench.common.health_probe", str(self.port)]
        argv += ["--every", str(self.interval_s), "--timeout", str(self.timeout_s)]
        argv += ["--max-seconds", str(self.max_s)]
        self._probe = await asyncio.create_subprocess_exec(
            *argv, cwd=REPO_ROOT, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE
        )
        assert self._probe.stdout is not None
        try:
            await asyncio.wait_for(self._probe.stdout.readline(), _STOP_S * 4)  # a first probe
        except BaseException:
            await self._stop_probe()
            raise
        _reset_peak(self.pid)
        self.result.base_rss_kib = self.result.peak_rss_kib = _status_kib(self.pid, "VmRSS")
        self._thread.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self.result.add_probes((await self._stop_probe()).decode().splitlines())
        await asyncio.to_thread(self._thread.join, self.interval_s * 4 + 1)
        self._peak(_status_kib(self.pid, "VmHWM"))

    async def _stop_probe(self) -> bytes:
        """What the probe process printed after its first line (that one ran before the
        attack)."""
        probe = self._probe
        if probe is None or probe.stdout is None:
            return b""
        with contextlib.suppress(ProcessLookupError):
            probe.terminate()
        try:
            out = await asyncio.wait_for(probe.stdout.read(), _STOP_S)
        except TimeoutError:
            out = b""
            with contextlib.suppress(ProcessLookupError):
                probe.kill()
        await probe.wait()
        return out

    def _peak(self, kib: int) -> None:
        self.result.peak_rss_kib = max(self.result.peak_rss_kib, kib)

    def _sample(self) -> None:
        deadline = time.monotonic() + self.max_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            self._peak(_status_kib(self.pid, "VmRSS"))
            self._stop.wait(self.interval_s)


async def fresh_requests(
    url: str,
    stop: asyncio.Event,
    *,
    every_s: float,
    most: int,
    model: str,
    deadline_s: float,
    clock: Callable[[], float],
) -> list[Outcome]:
    """A small mixed completion every ``every_s``, each on a new connection, until ``stop`` (at
    most ``most``); their outcomes, tagged ``PROBE_TAG``."""
    rng = random.Random(11)
    limits = httpx.Limits(max_connections=most, max_keepalive_connections=0)
    timeout = httpx.Timeout(None, connect=10.0)
    sending: list[asyncio.Task[Outcome]] = []
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        while not stop.is_set() and len(sending) < most:
            spec = dataclasses.replace(mixed_request(rng, model), tag=PROBE_TAG)
            sending.append(asyncio.create_task(send(http, url, spec, deadline_s, clock)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
        return list(await asyncio.gather(*sending))
