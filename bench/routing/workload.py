"""Routing policies under realistic workloads: TTFT, throughput, engine cache hits, router cost.

    python -m bench.routing.workload [--quick] [--json PATH] [--policies A,B] [--traces X,Y]

One invocation runs every trace (``bench.routing.traces``: multi-turn chat, shared-prefix groups,
random prompts) against every policy, each on a FRESH ``pd-cluster`` (4 prefills, 2 decodes,
SGLang protocol, cold caches), and prints one table, then the targets with PASS/FAIL.

Policies: ours (``round_robin``; ``least_load``; ``cache_aware`` precise, i.e. the router has
the engines' tokenizer and follows their KV events; ``cache_aware`` approximate, no tokenizer)
and the peer ``sglang-router`` 0.3.2 unmodified (``cache_aware`` and ``round_robin``, installed
by ``scripts/setup-peers.sh`` into ``.venv-peers``), put in front of the same cluster's workers;
pd-cluster's own router keeps serving the bootstrap registry the prefills registered with, and
its ``GET /ready`` names each prefill's URL and bootstrap (namespace) port.

The engines (``pd-worker``) simulate compute: ``--compute-s-per-token`` (default 200 us) for
each UNCACHED prompt token (a rank runs one forward at a time), so prefix-cache hits and
queueing show in TTFT, and the compute dominates the router's own costs (the whole pipeline
costs ~35 ms CPU per request on a 2-core machine). ``--pages`` is sized from each trace's
working set so that a prefill holds about a third of the distinct prefix blocks (never fewer
than ``concurrency`` longest prompts need): spreading a prefix over every prefill evicts. Every
worker gets the same tokenizer (``testkit.tokenizer_dir``),
in every run; only the precise ``cache_aware`` run gives it to the router too (pd-cluster
``--tokenizer``). Router settings pd-cluster has no flag for go through ``--router-arg``.

Clients: streaming requests, at most ``concurrency`` sessions at a time (a conversation's
turns in order). Our router gets a pooled keep-alive client; sglang-router gets a new connection
per request, because it stalls ~44 ms per request on a reused connection (no TCP_NODELAY).

Columns: TTFT and end-to-end p50/p99 (ms), req/s over the run, the engines' prefix-hit ratio
(sum over prefills of the cached / prompt token counters of their ``/metrics``, delta over the
run), P skew (the busiest prefill's computed, i.e. uncached, tokens over the mean: 1.00 is an
even spread), router CPU per request (CPU seconds of the router process tree over the run /
requests; pd-cluster's ``-m router`` child, or the sglang-router process),
the routing decision time p50/p99 (us, interpolated from our router's
``pdr_routing_decision_seconds`` histogram; n/a for peers) and the tokenize time p50
(``pdr_tokenize_seconds``). Anything a component does not report prints as n/a.

Every run is bounded (``--run-deadline`` seconds of load, a per-request timeout) and every child
is stopped: SIGTERM to its process group, SIGKILL after a grace period, then whatever it left.
The exit status is 1 if a run failed, a request failed or a target is FAIL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import httpx
import msgspec

from bench.common.cli import exit_on_failure, finish, sigterm_raises, write_json
from bench.common.cluster import Cluster, started_cluster
from bench.common.cluster import cluster_argv as pd_cluster_argv
from bench.common.cpu import tree_cpu_seconds
from bench.common.process import LOOPBACK, REPO_ROOT, BenchError, Child, free_port
from bench.common.prometheus import (
    bucket_delta,
    histogram_buckets,
    histogram_quantile,
    scrape,
    totals,
)
from bench.common.ready import wait_health, wait_http_ok
from bench.common.stats import Percentiles, percentiles
from bench.common.table import or_na, text_table
from bench.routing.traces import Trace, TraceRequest, sample_text, standard_traces
from testkit.tokenizer_dir import build_tokenizer_dir

__all__ = [
    "BenchSetup",
    "FRESH",
    "Outcome",
    "POLICIES",
    "POOLED",
    "PolicySpec",
    "Report",
    "RunResult",
    "Snapshot",
    "TargetCheck",
    "TraceInfo",
    "WorkloadConfig",
    "check_targets",
    "cluster_argv",
    "prepare",
    "drive",
    "engine_cache_tokens",
    "failed",
    "hit_ratio",
    "main",
    "pages_for",
    "parse_args",
    "peer_argv",
    "prefill_skew",
    "render",
    "run_all",
    "run_one",
    "summarize",
    "take_snapshot",
    "write_json",
]

PEER_PYTHON = REPO_ROOT / ".venv-peers" / "bin" / "python"
PEER_MODULE = "sglang_router.launch_router"
DECISION = "pdr_routing_decision_seconds"
TOKENIZE = "pdr_tokenize_seconds"
POOLED = "keep-alive pool"
FRESH = "new conn per request"
_NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
_MAX_ERROR_SAMPLES = 3
# Engine prefix-cache counters (cached, prompt) per protocol; SGLang also as ``sglang_``.
_CACHE_COUNTERS = (
    ("sglang:cached_tokens_total", "sglang:prompt_tokens_total"),
    ("sglang_cached_tokens_total", "sglang_prompt_tokens_total"),
    ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
)


# --- configuration -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """One row of the comparison per trace: which router, which policy, what it is given."""

    label: str  # what --policies and the table call it
    router: Literal["ours", "sglang-router"]
    policy: str
    decode_policy: str = ""  # ours only
    precise: bool = False  # ours: the router gets the engines' tokenizer

    @property
    def client(self) -> str:
        return POOLED if self.router == "ours" else FRESH


POLICIES = (
    PolicySpec("round_robin", "ours", "round_robin", "round_robin"),
    PolicySpec("least_load", "ours", "least_load", "least_load"),
    PolicySpec("cache_aware", "ours", "cache_aware", "least_load", precise=True),
    PolicySpec("cache_aware_approx", "ours", "cache_aware", "least_load"),
    PolicySpec("sgl_cache_aware", "sglang-router", "cache_aware"),
    PolicySpec("sgl_round_robin", "sglang-router", "round_robin"),
)
TRACE_NAMES = ("multi_turn", "shared_prefix", "random")


@dataclass(frozen=True)
class WorkloadConfig:
    quick: bool = False
    prefills: int = 4
    decodes: int = 2
    # a 2k-token uncached prefill: 400 ms (a 70B-class model on a few GPUs prefills ~5k
    # tokens/s). On a 2-core machine the whole simulated pipeline (client, router, prefill,
    # decode) costs ~35 ms CPU per request, which the compute must dwarf: at 100 us/token a
    # cache-hit multi-turn request computes ~48 ms and the fixed ~35 ms caps its gain.
    compute_s_per_token: float = 200e-6
    decode_s_per_token: float = 1e-3
    page_size: int = 16
    concurrency: int = 8
    run_deadline_s: float = 120.0  # load per run; requests not started by then are skipped
    request_timeout_s: float = 60.0
    ready_timeout_s: float = 60.0
    seed: int = 0
    policies: tuple[str, ...] = tuple(p.label for p in POLICIES)
    traces: tuple[str, ...] = TRACE_NAMES
    json_path: Path | None = None
    router_workers: int = 1  # our router's processes (pd-cluster --router-workers)
    host_sharing: bool = True  # with several: they share load counts and KV predictions
    router_replicas: int = 1  # our router's replicas behind HAProxy (pd-cluster --router-replicas)
    replica_sync: bool = True  # with several: they share their routing state


@dataclass(frozen=True)
class BenchSetup:
    """The tokenizer every worker (and the precise router) uses, and the peer router's venv."""

    peer_python: Path | None
    tokenizer_dir: Path
    chars_per_token: float

    def unavailable(self, spec: PolicySpec) -> str | None:
        """Why ``spec`` cannot run here, or None."""
        if spec.router == "sglang-router" and self.peer_python is None:
            return "no .venv-peers: run scripts/setup-peers.sh"
        return None


def measure_chars_per_token(tokenizer_dir: Path) -> float:
    """Characters per token of the trace text under the engines' tokenizer."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    text = sample_text(random.Random("calibrate"), 4000, 4.0)
    return len(text) / max(1, len(tokenizer.encode(text, add_special_tokens=False).ids))


def prepare(where: Path) -> BenchSetup:
    """Build the tokenizer and find the peer venv."""
    tokenizer = build_tokenizer_dir(where / "tokenizer")
    return BenchSetup(
        peer_python=PEER_PYTHON if PEER_PYTHON.exists() else None,
        tokenizer_dir=tokenizer,
        chars_per_token=measure_chars_per_token(tokenizer),
    )


def pages_for(trace: Trace, cfg: WorkloadConfig, chars_per_token: float) -> int:
    """``--pages`` per worker: a third of the trace's distinct prefix blocks (so spreading
    prefixes over four prefills evicts), but never fewer than ``concurrency`` of its longest
    prompts need at once (a prefill fails a request it has no pages for)."""
    blocks = trace.working_set_chars() / chars_per_token / cfg.page_size
    longest = trace.max_prompt_chars() / chars_per_token / cfg.page_size + 2  # template, tail
    return max(math.ceil(blocks / 3), math.ceil(trace.concurrency * longest), 64)


# --- metrics -----------------------------------------------------------------------------------


def engine_cache_tokens(text: str) -> tuple[float, float] | None:
    """(cached, prompt) prompt-token counters of one engine's ``/metrics``, summed over labels;
    None when it reports neither protocol's counters."""
    summed = totals(text)
    for cached, prompt in _CACHE_COUNTERS:
        if cached in summed and prompt in summed:
            return summed[cached], summed[prompt]
    return None


@dataclass(frozen=True)
class Snapshot:
    """Counters read before and after a run (None: not reported)."""

    cache: tuple[tuple[float, float], ...] | None  # (cached, prompt) tokens per prefill
    decision: dict[float, float] | None
    tokenize: dict[float, float] | None
    cpu_s: float | None


def _metrics(client: httpx.Client, url: str) -> str | None:
    with contextlib.suppress(BenchError):
        return scrape(client, url)
    return None


def _engines_cache(
    client: httpx.Client, prefills: Sequence[str]
) -> tuple[tuple[float, float], ...] | None:
    counts = []
    for url in prefills:
        text = _metrics(client, url)
        count = engine_cache_tokens(text) if text is not None else None
        if count is None:
            return None
        counts.append(count)
    return tuple(counts)


def _cpu(pids: Sequence[int]) -> float | None:
    """CPU seconds of the routers' process trees (every replica's); None if one is gone."""
    if not pids:
        return None
    try:
        return sum(tree_cpu_seconds(pid) for pid in pids)
    except OSError:
        return None


def take_snapshot(
    client: httpx.Client,
    prefills: Sequence[str],
    router_url: str | None,
    cpu_pids: Sequence[int],
    *,
    after: bool = False,
) -> Snapshot:
    """The engines' cache counters, our router's histograms (``router_url``), the CPU time.

    The CPU time is read next to the run: last before it, first ``after`` it. Reading the
    router's ``/metrics`` costs it CPU (with ``--workers N`` it merges every process's), which
    is no request's.
    """
    cpu_s = _cpu(cpu_pids) if after else None
    router = _metrics(client, router_url) if router_url else None
    return Snapshot(
        cache=_engines_cache(client, prefills),
        decision=histogram_buckets(router, DECISION) if router else None,
        tokenize=histogram_buckets(router, TOKENIZE) if router else None,
        cpu_s=cpu_s if after else _cpu(cpu_pids),
    )


# --- processes ---------------------------------------------------------------------------------


def worker_args(cfg: WorkloadConfig, setup: BenchSetup, pages: int) -> list[str]:
    """pd-worker arguments for every worker: a light KV (the router's costs are the subject),
    simulated compute, the pool size, and the tokenizer."""
    return [
        "--layers",
        "1",
        "--bytes-per-token",
        "64",
        "--page-size",
        str(cfg.page_size),
        "--pages",
        str(pages),
        "--compute-s-per-token",
        repr(cfg.compute_s_per_token),
        "--decode-s-per-token",
        repr(cfg.decode_s_per_token),
        "--log-level",
        "warning",
        "--tokenizer",
        str(setup.tokenizer_dir),
    ]


def cluster_argv(
    cfg: WorkloadConfig, setup: BenchSetup, spec: PolicySpec, pages: int, port: int
) -> list[str]:
    """pd-cluster's command line: our router's policies (and, precise, the tokenizer) as
    pd-cluster's own flags, its other settings through ``--router-arg``."""
    flags = [
        "--router-arg=--health-interval",  # ready sooner after start
        "--router-arg=0.5",
        "--router-arg=--log-level",
        "--router-arg=warning",
    ]
    if spec.router == "ours":
        flags += ["--prefill-policy", spec.policy, "--decode-policy", spec.decode_policy]
        flags += ["--router-workers", str(cfg.router_workers)]
        flags += ["--router-replicas", str(cfg.router_replicas)]
        flags += [] if cfg.replica_sync else ["--no-replica-sync"]
        if spec.precise:
            flags += ["--tokenizer", str(setup.tokenizer_dir)]
    return pd_cluster_argv(
        prefills=cfg.prefills,
        decodes=cfg.decodes,
        port=port,
        engine="sglang",
        ready_timeout_s=cfg.ready_timeout_s,
        flags=flags,
        worker_args=worker_args(cfg, setup, pages),
    )


@contextlib.contextmanager
def started(
    cfg: WorkloadConfig, setup: BenchSetup, spec: PolicySpec, pages: int
) -> Iterator[Cluster]:
    """A fresh pd-cluster; stopped (its whole process tree) on the way out."""
    argv = cluster_argv(cfg, setup, spec, pages, free_port())
    with _host_sharing(cfg.host_sharing), started_cluster(argv, cfg.ready_timeout_s) as cluster:
        yield cluster


@contextlib.contextmanager
def _host_sharing(on: bool) -> Iterator[None]:
    """``PDR_FEATURES__HOST_SHARING`` for the cluster started in the block (no flag has it)."""
    name = "PDR_FEATURES__HOST_SHARING"
    before = os.environ.get(name)
    os.environ[name] = "true" if on else "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def peer_argv(spec: PolicySpec, cluster: Cluster, port: int, metrics_port: int) -> list[str]:
    """sglang-router in PD mode over the cluster's workers (decoders reach the prefills'
    bootstrap APIs, served by pd-cluster's router, through the namespace ports)."""
    argv = [
        str(PEER_PYTHON),
        "-m",
        PEER_MODULE,
        "--pd-disaggregation",
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--policy",
        spec.policy,
        "--prometheus-host",
        LOOPBACK,
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        "warn",
    ]
    for url, bootstrap_port in cluster.prefills:
        argv += ["--prefill", url, str(bootstrap_port)]
    for url in cluster.decodes:
        argv += ["--decode", url]
    return argv


@contextlib.contextmanager
def started_peer(
    cfg: WorkloadConfig, spec: PolicySpec, cluster: Cluster
) -> Iterator[tuple[Child, str]]:
    """sglang-router in front of ``cluster``'s workers, serving, and its URL; always stopped."""
    port = free_port()
    url = f"http://{LOOPBACK}:{port}"
    with Child(peer_argv(spec, cluster, port, free_port())) as child:
        wait_health(child, url, cfg.ready_timeout_s)
        _wait_workers(child, url, len(cluster.prefills) + len(cluster.decodes), cfg.ready_timeout_s)
        yield child, url


def _wait_workers(child: Child, url: str, expected: int, timeout_s: float) -> None:
    """Until sglang-router's ``/readiness`` counts ``expected`` healthy workers (it registers
    them in the background after it starts serving)."""

    def enough(response: httpx.Response) -> bool:
        healthy = response.json().get("healthy_workers", 0) if response.status_code == 200 else 0
        return int(healthy) >= expected

    def alive() -> None:
        if child.exit_code is not None:
            raise BenchError(child.describe(f"not {expected} healthy workers in {timeout_s:g} s"))

    deadline = time.monotonic() + timeout_s
    if not wait_http_ok(f"{url}/readiness", deadline, alive=alive, accept=enough, interval_s=0.1):
        raise BenchError(child.describe(f"not {expected} healthy workers in {timeout_s:g} s"))


# --- load --------------------------------------------------------------------------------------


class RequestFailed(Exception):
    """A request did not produce a well-formed completion stream."""


@dataclass(frozen=True, slots=True)
class Outcome:
    e2e_s: float
    ttft_s: float | None = None
    error: str | None = None


def _has_text(event: Mapping[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> float:
    """Send one streaming request; the seconds to its first text. Raises on a bad stream."""
    started = time.perf_counter()
    ttft: float | None = None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RequestFailed(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = msgspec.json.decode(data)
            if not isinstance(event, dict) or "error" in event:
                raise RequestFailed(f"error event: {data[:200]}")
            if ttft is None and _has_text(event):
                ttft = time.perf_counter() - started
        else:
            raise RequestFailed("the stream ended without [DONE]")
    if ttft is None:
        raise RequestFailed("the stream had no text")
    return ttft


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, request: TraceRequest
) -> Outcome:
    """One streaming request, timed; failures become an ``Outcome`` with ``error`` set."""
    started = time.perf_counter()
    try:
        ttft = await _stream(client, f"{url}{request.path}", request.body(model))
    except (RequestFailed, httpx.HTTPError, msgspec.DecodeError) as exc:
        return Outcome(time.perf_counter() - started, error=f"{type(exc).__name__}: {exc}")
    return Outcome(time.perf_counter() - started, ttft_s=ttft)


def _client(kind: str, concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    keepalive = concurrency if kind == POOLED else 0  # 0: every request opens a connection
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=keepalive)
    transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=_NODELAY)
    return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(timeout_s, connect=5.0))


async def drive(
    trace: Trace, url: str, model: str, client_kind: str, cfg: WorkloadConfig
) -> tuple[list[Outcome], float]:
    """Run ``trace`` against ``url``: ``trace.concurrency`` sessions at a time, each session's
    requests in order; nothing starts after ``cfg.run_deadline_s``. (outcomes, wall seconds)."""
    sessions = iter(trace.sessions)
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + cfg.run_deadline_s

    async def user(client: httpx.AsyncClient) -> None:
        for session in sessions:  # shared: each user takes the next session in arrival order
            for request in session:
                if time.monotonic() > deadline:
                    return
                outcomes.append(await one_request(client, url, model, request))

    started = time.monotonic()
    async with _client(client_kind, trace.concurrency, cfg.request_timeout_s) as client:
        users = asyncio.gather(*(user(client) for _ in range(trace.concurrency)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(users, cfg.run_deadline_s + cfg.request_timeout_s + 5.0)
    return outcomes, time.monotonic() - started


# --- one run -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunResult:
    trace: str
    policy: str
    router: str
    client: str
    pages: int
    requests: int  # in the trace
    completed: int = 0
    errors: int = 0
    wall_s: float = 0.0
    ttft_ms: Percentiles = field(default_factory=lambda: Percentiles(0.0, 0.0, 0.0))
    e2e_ms: Percentiles = field(default_factory=lambda: Percentiles(0.0, 0.0, 0.0))
    req_per_s: float = 0.0
    hit_ratio: float | None = None
    prefill_skew: float | None = None  # busiest prefill's computed tokens / the mean
    router_cpu_ms_per_req: float | None = None
    decision_us: tuple[float, float] | None = None  # p50, p99
    tokenize_us_p50: float | None = None
    error_samples: tuple[str, ...] = ()
    not_run: str | None = None  # why the run did not happen
    failed: bool = False  # it was meant to run and could not

    @property
    def skipped_requests(self) -> int:
        return self.requests - self.completed - self.errors if self.not_run is None else 0


def _deltas(
    before: tuple[tuple[float, float], ...] | None, after: tuple[tuple[float, float], ...] | None
) -> list[tuple[float, float]] | None:
    """Per prefill (cached, prompt) tokens over the run."""
    if before is None or after is None or len(before) != len(after):
        return None
    return [(a[0] - b[0], a[1] - b[1]) for b, a in zip(before, after, strict=True)]


def hit_ratio(deltas: Sequence[tuple[float, float]] | None) -> float | None:
    """Cached / prompt tokens, summed over the prefills."""
    prompt = sum(p for _c, p in deltas or ())
    return None if deltas is None or prompt <= 0 else sum(c for c, _p in deltas) / prompt


def prefill_skew(deltas: Sequence[tuple[float, float]] | None) -> float | None:
    """The busiest prefill's uncached (computed) tokens over the mean: 1.0 is an even spread."""
    computed = [p - c for c, p in deltas or ()]
    mean = sum(computed) / len(computed) if computed else 0.0
    return None if mean <= 0 else max(computed) / mean


def _quantile_us(
    before: dict[float, float] | None, after: dict[float, float] | None, q: float
) -> float | None:
    if after is None:
        return None
    value = histogram_quantile(bucket_delta(before, after), q)
    return None if value is None else value * 1e6


def summarize(
    base: RunResult, outcomes: Sequence[Outcome], wall_s: float, before: Snapshot, after: Snapshot
) -> RunResult:
    """``base`` filled in with what the run measured."""
    good = [o for o in outcomes if o.error is None]
    bad = [o.error for o in outcomes if o.error is not None]
    cpu = None
    if before.cpu_s is not None and after.cpu_s is not None and outcomes:
        cpu = (after.cpu_s - before.cpu_s) / len(outcomes) * 1e3
    p50 = _quantile_us(before.decision, after.decision, 0.50)
    p99 = _quantile_us(before.decision, after.decision, 0.99)
    return replace(
        base,
        completed=len(good),
        errors=len(bad),
        wall_s=wall_s,
        ttft_ms=percentiles([o.ttft_s for o in good if o.ttft_s is not None]),
        e2e_ms=percentiles([o.e2e_s for o in good]),
        req_per_s=len(good) / wall_s if wall_s > 0 else 0.0,
        hit_ratio=hit_ratio(_deltas(before.cache, after.cache)),
        prefill_skew=prefill_skew(_deltas(before.cache, after.cache)),
        router_cpu_ms_per_req=cpu,
        decision_us=(p50, p99) if p50 is not None and p99 is not None else None,
        tokenize_us_p50=_quantile_us(before.tokenize, after.tokenize, 0.50),
        error_samples=tuple(bad[:_MAX_ERROR_SAMPLES]),
    )


def _measure(
    cfg: WorkloadConfig,
    trace: Trace,
    base: RunResult,
    cluster: Cluster,
    url: str,
    pids: Sequence[int],
) -> RunResult:
    router_metrics = cluster.url if base.router == "ours" else None
    prefills = [prefill for prefill, _port in cluster.prefills]
    with httpx.Client(timeout=5.0) as client:
        before = take_snapshot(client, prefills, router_metrics, pids)
        outcomes, wall_s = asyncio.run(drive(trace, url, cluster.model, base.client, cfg))
        after = take_snapshot(client, prefills, router_metrics, pids, after=True)
    return summarize(base, outcomes, wall_s, before, after)


def run_one(
    cfg: WorkloadConfig, setup: BenchSetup, trace: Trace, spec: PolicySpec, pages: int
) -> RunResult:
    """``trace`` through ``spec`` on a fresh cluster (a failed start is a failed row)."""
    base = RunResult(trace.name, spec.label, spec.router, spec.client, pages, trace.requests)
    try:
        with started(cfg, setup, spec, pages) as cluster:
            if spec.router == "ours":
                return _measure(cfg, trace, base, cluster, cluster.url, cluster.router_pids)
            with started_peer(cfg, spec, cluster) as (peer, url):
                return _measure(cfg, trace, base, cluster, url, (peer.pid,))
    except BenchError as exc:
        return replace(base, not_run=f"failed: {exc}", failed=True)


def _progress(done: int, total: int, result: RunResult, elapsed_s: float) -> None:
    if result.not_run is not None:
        what = result.not_run.splitlines()[0]
    else:
        what = (
            f"{result.completed} ok, {result.errors} errors, TTFT p50 "
            f"{result.ttft_ms.p50:.1f} ms, {result.req_per_s:.1f} req/s"
        )
    line = f"[{done}/{total}] {result.trace} x {result.policy}: {what} ({elapsed_s:.0f} s)"
    print(line, file=sys.stderr, flush=True)


# --- all runs, targets, output -----------------------------------------------------------------


@dataclass(frozen=True)
class TraceInfo:
    name: str
    description: str
    requests: int
    pages: int


@dataclass(frozen=True)
class Report:
    config: WorkloadConfig
    tokenizer: str
    chars_per_token: float
    traces: tuple[TraceInfo, ...]
    runs: tuple[RunResult, ...]
    targets: tuple[TargetCheck, ...]
    wall_s: float


@dataclass(frozen=True)
class TargetCheck:
    description: str
    value: float | None
    bound: float | None
    passed: bool | None  # None: n/a (a run is missing)

    @property
    def verdict(self) -> str:
        return "n/a" if self.passed is None else "PASS" if self.passed else "FAIL"


def _row(runs: Sequence[RunResult], trace: str, policy: str) -> RunResult | None:
    for run in runs:
        if run.trace == trace and run.policy == policy and run.not_run is None and run.completed:
            return run
    return None


def _check(
    description: str, value: float | None, bound: float | None, lower_is_better: bool, strict: bool
) -> TargetCheck:
    if value is None or bound is None:
        return TargetCheck(description, value, bound, None)
    if lower_is_better:
        passed = value < bound if strict else value <= bound
    else:
        passed = value > bound if strict else value >= bound
    return TargetCheck(description, value, bound, passed)


def check_targets(runs: Sequence[RunResult]) -> tuple[TargetCheck, ...]:
    """The issue's targets: on multi-turn and shared-prefix, cache_aware (precise) TTFT p50 at
    most half of round_robin's and below sglang-router cache_aware's; on random prompts its
    throughput at least 0.95x least_load's."""

    def ttft(trace: str, policy: str, factor: float = 1.0) -> float | None:
        run = _row(runs, trace, policy)
        return None if run is None else run.ttft_ms.p50 * factor

    checks = []
    for trace in ("multi_turn", "shared_prefix"):
        ours = ttft(trace, "cache_aware")
        checks += [
            _check(
                f"{trace}: TTFT p50 (ms) cache_aware <= 0.5 x round_robin",
                ours,
                ttft(trace, "round_robin", 0.5),
                lower_is_better=True,
                strict=False,
            ),
            _check(
                f"{trace}: TTFT p50 (ms) cache_aware < sglang-router cache_aware",
                ours,
                ttft(trace, "sgl_cache_aware"),
                lower_is_better=True,
                strict=True,
            ),
        ]
    ours_run, least = _row(runs, "random", "cache_aware"), _row(runs, "random", "least_load")
    checks.append(
        _check(
            "random: req/s cache_aware >= 0.95 x least_load",
            None if ours_run is None else ours_run.req_per_s,
            None if least is None else least.req_per_s * 0.95,
            lower_is_better=False,
            strict=False,
        )
    )
    return tuple(checks)


def selected(cfg: WorkloadConfig, traces: Sequence[Trace]) -> tuple[list[Trace], list[PolicySpec]]:
    return (
        [t for t in traces if t.name in cfg.traces],
        [p for p in POLICIES if p.label in cfg.policies],
    )


def run_all(cfg: WorkloadConfig) -> Report:
    """Every selected trace x policy, each on a fresh cluster; children stopped whatever
    happens (SIGTERM raises ``KeyboardInterrupt`` here, so every ``finally`` runs)."""
    started = time.monotonic()
    with sigterm_raises(), tempfile.TemporaryDirectory(prefix="routing-workload-") as tmp:
        setup = prepare(Path(tmp))
        all_traces = standard_traces(
            quick=cfg.quick,
            chars_per_token=setup.chars_per_token,
            seed=cfg.seed,
            concurrency=cfg.concurrency,
        )
        traces, specs = selected(cfg, all_traces)
        infos = []
        runs: list[RunResult] = []
        for trace in traces:
            pages = pages_for(trace, cfg, setup.chars_per_token)
            infos.append(TraceInfo(trace.name, trace.description, trace.requests, pages))
            for spec in specs:
                reason = setup.unavailable(spec)
                if reason is None:
                    result = run_one(cfg, setup, trace, spec, pages)
                else:
                    base = RunResult(trace.name, spec.label, spec.router, spec.client, pages, 0)
                    result = replace(base, requests=trace.requests, not_run=f"skipped: {reason}")
                runs.append(result)
                _progress(len(runs), len(traces) * len(specs), result, time.monotonic() - started)
    return Report(
        cfg,
        "testkit tokenizer",
        setup.chars_per_token,
        tuple(infos),
        tuple(runs),
        check_targets(runs),
        time.monotonic() - started,
    )


HEADER = (
    "trace",
    "router",
    "policy",
    "client",
    "n",
    "err",
    "TTFT p50",
    "p99",
    "e2e p50",
    "p99",
    "req/s",
    "hit %",
    "P skew",
    "CPU ms/req",
    "decide p50 us",
    "p99 us",
    "tokenize p50 us",
)


def _cells(run: RunResult) -> list[str]:
    head = [run.trace, run.router, run.policy, run.client]
    if run.not_run is not None:
        return [*head, "-", "-", *(["-"] * (len(HEADER) - 6))]
    decision = run.decision_us or (None, None)
    return [
        *head,
        str(run.completed),
        str(run.errors),
        f"{run.ttft_ms.p50:.1f}",
        f"{run.ttft_ms.p99:.1f}",
        f"{run.e2e_ms.p50:.1f}",
        f"{run.e2e_ms.p99:.1f}",
        f"{run.req_per_s:.1f}",
        or_na(None if run.hit_ratio is None else run.hit_ratio * 100),
        or_na(run.prefill_skew, ".2f"),
        or_na(run.router_cpu_ms_per_req, ".2f"),
        or_na(decision[0]),
        or_na(decision[1]),
        or_na(run.tokenize_us_p50),
    ]


def render(report: Report) -> str:
    """The one table, its legend, the targets and what did not run."""
    cfg = report.config
    head = [
        f"routing_workload{' --quick' if cfg.quick else ''}: pd-cluster {cfg.prefills}P"
        f"{cfg.decodes}D --engine sglang, fresh cluster per run; pd-worker "
        f"--compute-s-per-token {cfg.compute_s_per_token:g} (uncached tokens) "
        f"--decode-s-per-token {cfg.decode_s_per_token:g} --page-size {cfg.page_size}; "
        f"{report.tokenizer} ({report.chars_per_token:.2f} chars/token); streaming, "
        f"{cfg.concurrency} concurrent sessions; {LOOPBACK}; {report.wall_s:.0f} s in all",
        *(
            f"  {t.name}: {t.description}; {t.requests} requests; --pages {t.pages}"
            for t in report.traces
        ),
    ]
    table = "\n".join(
        text_table([list(HEADER), *(_cells(run) for run in report.runs)], left=4, strip=True)
    )
    legend = (
        "times in ms unless marked; hit % = engines' cached / prompt tokens over the run; P skew "
        "= the busiest prefill's computed (uncached) tokens / the mean (1.00: even); CPU = "
        "router process tree; decide/tokenize = our router's histograms (n/a: not reported). "
        f"Clients: ours '{POOLED}'; sglang-router '{FRESH}' (it stalls ~44 ms per request on "
        "a reused connection: no TCP_NODELAY)."
    )
    targets = [
        f"  {t.verdict:4}  {t.description}: {or_na(t.value)} vs {or_na(t.bound)}"
        for t in report.targets
    ]
    notes = [
        f"  {run.trace} x {run.policy}: {line}"
        for run in report.runs
        for line in (
            ([run.not_run.splitlines()[0]] if run.not_run else [])
            + list(run.error_samples)
            + (
                [f"{run.skipped_requests} requests not started by the deadline"]
                if run.skipped_requests > 0
                else []
            )
        )
    ]
    return "\n".join(
        [
            *head,
            "",
            table,
            "",
            legend,
            "",
            "targets:",
            *targets,
            *(["", "notes:", *notes] if notes else []),
        ]
    )


def parse_args(argv: Sequence[str] | None = None) -> WorkloadConfig:
    parser = argparse.ArgumentParser(
        prog="bench.routing.workload", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="smaller traces (~3 minutes)")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    parser.add_argument(
        "--policies",
        default=",".join(p.label for p in POLICIES),
        help="comma-separated subset of: " + ", ".join(p.label for p in POLICIES),
    )
    parser.add_argument(
        "--traces",
        default=",".join(TRACE_NAMES),
        help="comma-separated subset of: " + ", ".join(TRACE_NAMES),
    )
    parser.add_argument(
        "--compute-s-per-token", type=float, default=WorkloadConfig.compute_s_per_token
    )
    parser.add_argument(
        "--decode-s-per-token", type=float, default=WorkloadConfig.decode_s_per_token
    )
    parser.add_argument("--concurrency", type=int, default=WorkloadConfig.concurrency)
    parser.add_argument(
        "--run-deadline", type=float, help="seconds of load per run (default 120, --quick 40)"
    )
    parser.add_argument("--seed", type=int, default=WorkloadConfig.seed)
    parser.add_argument(
        "--router-workers", type=int, default=1, help="our router's processes (--workers N)"
    )
    parser.add_argument(
        "--no-host-sharing",
        dest="host_sharing",
        action="store_false",
        help="its processes route on their own counts (to show what sharing prevents)",
    )
    parser.add_argument(
        "--router-replicas",
        type=int,
        default=1,
        help="our router's replicas behind HAProxy, sharing their routing state",
    )
    parser.add_argument(
        "--no-replica-sync",
        dest="replica_sync",
        action="store_false",
        help="the replicas route on their own counts (to show what the sync prevents)",
    )
    args = parser.parse_args(argv)
    policies = tuple(p for p in args.policies.split(",") if p)
    traces = tuple(t for t in args.traces.split(",") if t)
    unknown = (set(policies) - {p.label for p in POLICIES}) | (set(traces) - set(TRACE_NAMES))
    if unknown:
        parser.error(f"unknown policy or trace: {', '.join(sorted(unknown))}")
    if args.concurrency < 1:
        parser.error("--concurrency needs a value >= 1")
    deadline = args.run_deadline or (40.0 if args.quick else WorkloadConfig.run_deadline_s)
    return WorkloadConfig(
        quick=args.quick,
        compute_s_per_token=args.compute_s_per_token,
        decode_s_per_token=args.decode_s_per_token,
        concurrency=args.concurrency,
        run_deadline_s=deadline,
        seed=args.seed,
        policies=policies,
        traces=traces,
        json_path=args.json,
        router_workers=args.router_workers,
        host_sharing=args.host_sharing,
        router_replicas=args.router_replicas,
        replica_sync=args.replica_sync,
    )


def failed(report: Report) -> bool:
    """A run failed to start, a request failed, or a target is FAIL."""
    return any(run.failed or run.errors for run in report.runs) or any(
        t.passed is False for t in report.targets
    )


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_args(argv)
    with exit_on_failure("routing_workload", "every child was stopped"):
        report = run_all(cfg)
    finish(render(report), report, cfg.json_path, failed(report))


if __name__ == "__main__":
    main()
