"""Flow control under overload through ``pd-cluster`` (issue 25 item 6, figures (a) and (b)).

    python -m bench.load.flow_control [--engine sglang] [--duration 60] [--alone 30]
        [--max-concurrent 0] [--queue-timeout 10] [--priority-aging 30] [--prefill-cap 1]
        [--reserve 0] [--json OUT] [-- PD-WORKER ARGS...]

pd-cluster (``--prefills`` prefill workers, 4, and 1 decode; 127.0.0.1; stopped at the end) runs the
router with ``--api-keys`` (four tenants of weight 1: ``tenant-a``, ``tenant-b``,
``interactive``, ``batch``), ``--max-concurrent-requests C`` (0: no limit, the default) and
``--max-inflight-per-prefill N --queue-at-worker-caps`` (``--prefill-cap N``, 1; 0: neither),
in front of simulated workers whose requests take a known time (``--compute-s-per-token``,
``--decode-s-per-token``) and that never refuse. Each prefill computes one prompt at a time, so
with a cap of 1 it holds one leg and the requests beyond wait in the router's worker queue,
ordered as the admission queue (priority, tenants' turns), instead of first come first served at
the prefills. The capacity is the smaller of the slots' (``C / service time``) and the prefills'
places' (``prefills x N / TTFT``), from a few unloaded requests measured first. Each request asks
for ``--max-tokens`` (16) +- ``--spread`` (50%) tokens, uniform, as real outputs differ in
length: with one length for all, the requests admitted together at the onset would end
together, and the next ones be admitted together, forever, in waves that queue at the prefills.

All load is open loop (one request every ``1 / rate`` s per stream, streaming completions; TTFT
is the time to the first SSE event with text):

The loaded phases are reported whole and without their first ``--warmup`` s (20: the onset,
when the places free at the start are taken at once and the prefills work off that burst).

* (a) fairness: tenant B alone at ``--b-load`` (0.4) of capacity, within its share (half:
  equal weights); then B again while tenant A floods at ``--flood`` (10) times its share for
  ``--duration`` s. Target: B's TTFT p99 within 1.5x of alone, none of B's requests refused.
  (B at its whole share would be as loaded as the fleet: its own requests would queue behind
  each other as soon as the capacity under load dips below the unloaded measurement.)
* (b) priority: interactive (``X-Priority: -1``) alone at ``--interactive`` (0.25) of capacity;
  then with batch (``X-Priority: 1``) flooding so that the total offered is ``--overload`` (2)
  times capacity, for ``--duration`` s. Targets: interactive TTFT p99 within 2x of unloaded;
  batch completes requests in every 10-s window (no starvation).

Exit status 1 when a target is missed or the cluster failed.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

from bench.common.cli import exit_on_failure, finish, sigterm_raises
from bench.common.cluster import cluster_argv, start_cluster
from bench.common.process import BenchError, Child, free_port
from bench.load.flow_load import Outcome, Stream, run_phase
from bench.load.flow_report import (
    FlowReport,
    StreamSummary,
    fairness_verdict,
    priority_verdict,
    render,
    starvation_verdict,
    summarize,
    throughput,
    windows,
)

__all__ = ["FlowConfig", "keys_file_text", "main", "parse_args", "router_flags", "run_bench"]

KEYS = {
    "tenant-a": "sk-bench-tenant-a-0123456789",
    "tenant-b": "sk-bench-tenant-b-0123456789",
    "interactive": "sk-bench-interactive-0123456789",
    "batch": "sk-bench-batch-0123456789",
}
DEFAULT_WORKER_ARGS = (
    "--compute-s-per-token", "0.0002", "--decode-s-per-token", "0.2",
    "--layers", "1", "--bytes-per-token", "64", "--pages", "8192",
)  # fmt: skip
WINDOW_S = 10.0
TWO_TENANTS_SHARE = 0.5  # of capacity: tenant A's and tenant B's, of equal weights
STEADY = "{phase}, sent after {s:g} s"  # the loaded phases' steady state


@dataclass(frozen=True)
class FlowConfig:
    engine: str = "sglang"
    duration_s: float = 60.0  # each loaded phase
    alone_s: float = 30.0  # each unloaded phase
    calibrate_s: float = 8.0
    calibrate_rate: float = 1.0
    warmup_s: float = 20.0  # of each loaded phase: its onset, reported apart
    prefills: int = 4
    max_concurrent: int = 0  # admission slots (0: no limit; the prefills' places bound it)
    queue_timeout_s: float = 10.0
    priority_aging_s: float = 30.0
    prefill_cap: int = 1  # legs per prefill at once; the rest wait in the router (0: none)
    reserve: int = 0  # places held back from a tenant over its share (--worker-queue-reserve)
    b_load: float = 0.4  # B's offered rate, of capacity (its share is half)
    flood: float = 10.0  # A's offered rate, of its share (half of capacity)
    interactive: float = 0.25  # interactive's offered rate, of capacity
    overload: float = 2.0  # interactive + batch, of capacity
    prompt_tokens: int = 1024
    max_tokens: int = 16
    spread: float = 0.5  # each request's max_tokens: max_tokens * (1 +- spread), uniform
    worker_args: tuple[str, ...] = DEFAULT_WORKER_ARGS
    ready_timeout_s: float = 90.0
    json_out: Path | None = None


def keys_file_text() -> str:
    """The keys file (YAML): the four tenants, weight 1 each, no limits."""
    lines = ["tenants:"]
    for tenant, key in KEYS.items():
        lines += [f"  {tenant}:", f"    keys: [{key}]", "    weight: 1"]
    return "\n".join(lines) + "\n"


def router_flags(cfg: FlowConfig, keys_path: Path) -> list[str]:
    """pd-cluster's ``--router-arg`` flags: keys, the slots, the queue's timeout and aging."""
    router = [
        "--api-keys", str(keys_path),
        "--max-concurrent-requests", str(cfg.max_concurrent),
        "--queue-timeout", f"{cfg.queue_timeout_s:g}",
        "--priority-aging", f"{cfg.priority_aging_s:g}",
    ]  # fmt: skip
    if cfg.prefill_cap:  # the second stage: the router orders what the prefills would queue
        router += ["--max-inflight-per-prefill", str(cfg.prefill_cap), "--queue-at-worker-caps"]
        router += ["--worker-queue-reserve", str(cfg.reserve)]
    return [f"--router-arg={arg}" for arg in router]


@contextlib.contextmanager
def _cluster(cfg: FlowConfig) -> Iterator[_Served]:
    with tempfile.TemporaryDirectory(prefix="pd-flow-") as where:
        keys = Path(where) / "keys.yaml"
        keys.write_text(keys_file_text())
        child, url = _start(cfg, keys, Path(where) / "logs")
        with child:
            yield _Served(child, url, _model(child, url))


def _start(cfg: FlowConfig, keys: Path, logs: Path) -> tuple[Child, str]:
    """pd-cluster started; a second try when the first did not start (a port another process
    took between pd-cluster's pick and its bind: this machine runs other jobs)."""

    def argv(attempt: int) -> list[str]:
        return cluster_argv(
            prefills=cfg.prefills,
            decodes=1,
            port=free_port(),
            engine=cfg.engine,
            ready_timeout_s=cfg.ready_timeout_s,
            flags=[*router_flags(cfg, keys), "--log-dir", str(logs / str(attempt))],
            worker_args=cfg.worker_args,
        )

    try:
        return start_cluster(argv(0), cfg.ready_timeout_s)
    except BenchError as exc:
        print(f"flow_control: pd-cluster did not start, again: {exc}", file=sys.stderr)
    return start_cluster(argv(1), cfg.ready_timeout_s)


@dataclass(frozen=True)
class _Served:
    child: Child
    url: str
    model: str


def _model(child: Child, url: str) -> str:
    """The served model, asked with a key (``/v1/models`` needs one with ``--api-keys``)."""
    headers = {"Authorization": f"Bearer {KEYS['tenant-b']}"}
    try:
        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=10.0)
        return str(models.raise_for_status().json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise BenchError(child.describe(f"no model from /v1/models: {exc}")) from exc


@dataclass
class _Bench:
    cfg: FlowConfig
    cluster: _Served
    service_s: float = 0.0
    prefill_s: float = 0.0

    def phase(self, streams: Sequence[Stream], duration_s: float, seed: int) -> list[Outcome]:
        if self.cluster.child.exit_code is not None:
            raise BenchError(self.cluster.child.describe("exited during the benchmark"))
        drain_s = self.cfg.queue_timeout_s + 3 * max(self.service_s, 1.0) + 10.0
        return run_phase(
            self.cluster.url,
            self.cluster.model,
            streams,
            duration_s=duration_s,
            drain_s=drain_s,
            prompt_tokens=self.cfg.prompt_tokens,
            max_tokens=self.cfg.max_tokens,
            spread=self.cfg.spread,
            seed=seed,
        )

    def calibrate(self) -> tuple[float, str]:
        """The unloaded service time (s per request, send to end of stream) and TTFT (how long
        a request holds a prefill's place); the capacity, and what bounds it: the slots
        (C / service time) or, with ``--prefill-cap``, the prefills' places (prefills x cap /
        TTFT), whichever is smaller."""
        stream = Stream("calibrate", KEYS["tenant-b"], self.cfg.calibrate_rate)
        outcomes = self.phase([stream], self.cfg.calibrate_s, seed=1)
        spans = [o.done_s - o.sent_s for o in outcomes if o.done_s is not None]
        if not spans or len(spans) < len(outcomes):
            raise BenchError(f"calibration: {len(spans)} of {len(outcomes)} requests completed")
        self.service_s = sum(spans) / len(spans)
        ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
        self.prefill_s = sum(ttfts) / len(ttfts) if ttfts else self.service_s
        cfg = self.cfg
        # --max-concurrent 0: no admission limit, the prefills' places are the capacity
        slots = cfg.max_concurrent / self.service_s if cfg.max_concurrent else math.inf
        note = f"= {cfg.max_concurrent} slots / {self.service_s:.2f} s per request"
        if cfg.prefill_cap:
            places = cfg.prefills * cfg.prefill_cap / self.prefill_s
            if places < slots:
                return places, (
                    f"= {cfg.prefills} prefills x {cfg.prefill_cap} / {self.prefill_s:.3f} s TTFT;"
                    f" the slots would allow {slots:.2f}"
                )
        return slots, note


def _fairness(bench: _Bench, capacity: float) -> tuple[list[StreamSummary], float]:
    cfg = bench.cfg
    b_rate = cfg.b_load * capacity
    a_rate = cfg.flood * TWO_TENANTS_SHARE * capacity
    b = Stream("B", KEYS["tenant-b"], b_rate)
    alone = bench.phase([b], cfg.alone_s, seed=10)
    flood = bench.phase([b, Stream("A", KEYS["tenant-a"], a_rate)], cfg.duration_s, seed=20)
    steady = [o for o in flood if o.sent_s >= cfg.warmup_s]
    summaries = [
        summarize(alone, "B", "(a) B alone", b_rate),
        summarize(flood, "B", "(a) A flooding", b_rate),
        summarize(steady, "B", STEADY.format(phase="(a) A flooding", s=cfg.warmup_s), b_rate),
        summarize(flood, "A", "(a) A flooding", a_rate),
    ]
    return summaries, throughput(flood, cfg.duration_s, skip_s=bench.service_s * 2)


def _priority(bench: _Bench, capacity: float) -> tuple[list[StreamSummary], list[int], float]:
    cfg = bench.cfg
    i_rate = cfg.interactive * capacity
    batch_rate = (cfg.overload - cfg.interactive) * capacity
    interactive = Stream("interactive", KEYS["interactive"], i_rate, priority=-1)
    unloaded = bench.phase([interactive], cfg.alone_s, seed=30)
    batch = Stream("batch", KEYS["batch"], batch_rate, priority=1)
    loaded = bench.phase([interactive, batch], cfg.duration_s, seed=40)
    steady = [o for o in loaded if o.sent_s >= cfg.warmup_s]
    summaries = [
        summarize(unloaded, "interactive", "(b) unloaded", i_rate),
        summarize(loaded, "interactive", "(b) 2x capacity", i_rate),
        summarize(
            steady, "interactive", STEADY.format(phase="(b) 2x capacity", s=cfg.warmup_s), i_rate
        ),
        summarize(loaded, "batch", "(b) 2x capacity", batch_rate),
    ]
    batch_windows = windows(loaded, "batch", WINDOW_S, cfg.duration_s)
    return summaries, batch_windows, throughput(loaded, cfg.duration_s, bench.service_s * 2)


def run_bench(cfg: FlowConfig) -> FlowReport:
    """Start pd-cluster, calibrate, run (a) and (b), stop it (whatever happens)."""
    with sigterm_raises(), _cluster(cfg) as cluster:
        bench = _Bench(cfg, cluster)
        capacity, capacity_note = bench.calibrate()
        fair, flood_rps = _fairness(bench, capacity)
        prio, batch_windows, overload_rps = _priority(bench, capacity)
    summaries = [*fair, *prio]

    def find(phase: str, label: str) -> StreamSummary | None:
        return next((s for s in summaries if s.phase == phase and s.label == label), None)

    flooded = STEADY.format(phase="(a) A flooding", s=cfg.warmup_s)
    loaded = STEADY.format(phase="(b) 2x capacity", s=cfg.warmup_s)
    verdicts = [
        fairness_verdict(find("(a) B alone", "B"), find("(a) A flooding", "B")),
        fairness_verdict(find("(a) B alone", "B"), find(flooded, "B"), steady=True),
        priority_verdict(
            find("(b) unloaded", "interactive"), find("(b) 2x capacity", "interactive")
        ),
        priority_verdict(
            find("(b) unloaded", "interactive"), find(loaded, "interactive"), steady=True
        ),
        starvation_verdict(batch_windows, WINDOW_S),
    ]
    config = {k: v for k, v in asdict(cfg).items() if k != "json_out"}
    return FlowReport(
        config,
        capacity,
        bench.service_s,
        summaries,
        batch_windows,
        flood_rps,
        overload_rps,
        verdicts,
        bench.prefill_s,
        capacity_note,
    )


def parse_args(argv: Sequence[str] | None = None) -> FlowConfig:
    p = argparse.ArgumentParser(
        prog="python -m bench.load.flow_control", description=(__doc__ or "").split("\n")[0]
    )
    defaults = FlowConfig()
    p.add_argument("--engine", default=defaults.engine, help="pd-cluster --engine")
    p.add_argument("--duration", type=float, default=defaults.duration_s, help="loaded phases, s")
    p.add_argument("--alone", type=float, default=defaults.alone_s, help="unloaded phases, s")
    p.add_argument("--calibrate", type=float, default=defaults.calibrate_s, help="s")
    p.add_argument("--warmup", type=float, default=defaults.warmup_s, help="onset left out, s")
    p.add_argument("--prefills", type=int, default=defaults.prefills)
    p.add_argument("--max-concurrent", type=int, default=defaults.max_concurrent)
    p.add_argument("--queue-timeout", type=float, default=defaults.queue_timeout_s)
    p.add_argument("--priority-aging", type=float, default=defaults.priority_aging_s)
    p.add_argument(
        "--prefill-cap",
        type=int,
        default=defaults.prefill_cap,
        help="router --max-inflight-per-prefill with --queue-at-worker-caps (0: neither)",
    )
    p.add_argument("--reserve", type=int, default=defaults.reserve, help="held-back places")
    p.add_argument("--flood", type=float, default=defaults.flood, help="A's rate / its share")
    p.add_argument("--b-load", type=float, default=defaults.b_load, help="B's rate / capacity")
    p.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens)
    p.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    p.add_argument(
        "--spread", type=float, default=defaults.spread, help="max_tokens drawn +- this fraction"
    )
    p.add_argument("--json", type=Path, default=None, metavar="OUT")
    p.add_argument("worker_args", nargs=argparse.REMAINDER, help="after --: pd-worker args")
    args = p.parse_args(argv)
    for name in ("duration", "alone", "calibrate", "queue_timeout", "flood", "b_load"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.max_concurrent < 0 or not (args.max_concurrent or args.prefill_cap):
        p.error("--max-concurrent must be positive (or 0, no limit, with a --prefill-cap)")
    for name in ("prefills", "prompt_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.spread < 1:
        p.error("--spread must be at least 0 and below 1")
    if not 0 <= args.warmup < args.duration:
        p.error("--warmup must be at least 0 and less than --duration")
    if args.prefill_cap < 0:
        p.error("--prefill-cap must be 0 (off) or positive")
    if args.reserve < 0 or (args.reserve and not args.prefill_cap):
        p.error("--reserve must be 0 (off) or positive, with a --prefill-cap")
    if args.priority_aging < 0:
        p.error("--priority-aging must be 0 (off) or positive")
    extra = args.worker_args[1:] if args.worker_args[:1] == ["--"] else args.worker_args
    return replace(
        defaults,
        engine=args.engine,
        duration_s=args.duration,
        alone_s=args.alone,
        calibrate_s=args.calibrate,
        warmup_s=args.warmup,
        prefills=args.prefills,
        max_concurrent=args.max_concurrent,
        queue_timeout_s=args.queue_timeout,
        priority_aging_s=args.priority_aging,
        prefill_cap=args.prefill_cap,
        reserve=args.reserve,
        flood=args.flood,
        b_load=args.b_load,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        spread=args.spread,
        worker_args=tuple(extra) or defaults.worker_args,
        json_out=args.json,
    )


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_args(argv)
    with exit_on_failure("flow_control", "the cluster was stopped"):
        report = run_bench(cfg)
    failed = not all(v.passed for v in report.verdicts)
    finish(render(report), report, cfg.json_out, failed)


if __name__ == "__main__":
    main()
