"""End-to-end TTFT through ``pd-cluster`` (1 prefill + 1 decode) against a co-located worker.

    python -m bench.load.cluster_ttft [--requests 20] [--lengths 1024,4096] [--max-tokens 16]
                                      [--engine sglang] [--cap 120] [-- PD-WORKER ARGS...]

Two targets, started as subprocesses in the same invocation, both on 127.0.0.1:

* ``cluster``: ``python -m worker.cluster --prefill 1 --decode 1 --engine E -- ARGS`` (the router
  with its registry, a prefill and a decode worker; the KV moves over Mooncake TCP);
* ``baseline``: ``python -m worker --role both ARGS``, the same simulated model computing the KV
  and decoding locally, without disaggregation.

``ARGS`` (after ``--``) go to every worker alike, e.g. ``-- --layers 32 --bytes-per-token 8192``.
For each prompt length (the toy tokenizer is one token per byte, so an N-character ASCII prompt is
N tokens), after ``--warmup`` unrecorded requests per target, ``--requests`` streaming
``/v1/completions`` requests per target alternate between the two (sequential, one at a time;
fewer once ``--cap`` seconds have passed). TTFT is the time to the first SSE event whose text is
not empty; ``total`` the time to the end of the stream. ``kv MiB`` and ``xfer ms`` average the
``kv_bytes_received`` and ``kv_transfer_s`` that the decode reports in the final usage chunk.

Every child runs in its own session and is always stopped: SIGTERM (pd-cluster then stops its own
children), SIGKILL after a grace period, and any of pd-cluster's children still alive after that
are killed too. The exit status is 1 if a request failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import string
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.common.cli import exit_on_failure, positive_ints, sigterm_raises
from bench.common.cluster import cluster_argv, start_cluster
from bench.common.process import LOOPBACK, BenchError, Child, free_port
from bench.common.ready import wait_health
from bench.common.stats import Percentiles, percentiles
from bench.common.table import text_table

__all__ = [
    "RequestFailed",
    "Sample",
    "TTFTConfig",
    "TTFTRow",
    "main",
    "one_request",
    "render",
    "run_bench",
]

REQUEST_TIMEOUT_S = 120.0
TARGETS = ("baseline", "cluster")


class RequestFailed(Exception):
    """One request did not produce a well-formed completion stream."""


@dataclass(frozen=True)
class TTFTConfig:
    requests: int = 20
    lengths: tuple[int, ...] = (1024, 4096)
    max_tokens: int = 16
    engine: str = "sglang"
    worker_args: tuple[str, ...] = ()
    warmup: int = 2
    cap_s: float = 120.0  # per prompt length
    ready_timeout_s: float = 90.0
    seed: int = 0


@dataclass(frozen=True)
class Sample:
    ttft_s: float
    total_s: float
    kv_bytes: int
    kv_transfer_s: float


@dataclass(frozen=True)
class TTFTRow:
    target: str
    tokens: int
    samples: tuple[Sample, ...]
    errors: tuple[str, ...]

    @property
    def ttft_ms(self) -> Percentiles:
        return percentiles([s.ttft_s for s in self.samples])

    @property
    def total_ms(self) -> Percentiles:
        return percentiles([s.total_s for s in self.samples])

    @property
    def kv_mib(self) -> float:
        return _mean([s.kv_bytes for s in self.samples]) / 2**20

    @property
    def kv_transfer_ms(self) -> float:
        return _mean([s.kv_transfer_s for s in self.samples]) * 1e3


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


# --- targets -----------------------------------------------------------------------------------


def _cluster_argv(cfg: TTFTConfig, port: int) -> list[str]:
    return cluster_argv(
        prefills=1,
        decodes=1,
        port=port,
        engine=cfg.engine,
        ready_timeout_s=cfg.ready_timeout_s,
        worker_args=cfg.worker_args,
    )


def _baseline_argv(cfg: TTFTConfig, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "worker",
        "--role",
        "both",
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        *cfg.worker_args,
    ]


@contextlib.contextmanager
def _started(cfg: TTFTConfig, target: str) -> Iterator[tuple[Child, str]]:
    """Start ``target``, wait until it serves, yield it and its URL; always stop it."""
    port = free_port()
    if target == "cluster":
        child, url = start_cluster(_cluster_argv(cfg, port), cfg.ready_timeout_s)
        with child:
            yield child, url
        return
    url = f"http://{LOOPBACK}:{port}"
    with Child(_baseline_argv(cfg, port)) as child:
        wait_health(child, url, cfg.ready_timeout_s)
        yield child, url


# --- requests ----------------------------------------------------------------------------------


def _model(client: httpx.Client, url: str) -> str:
    models = client.get(f"{url}/v1/models").raise_for_status().json()
    return str(models["data"][0]["id"])


def _events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON payloads of an SSE completion stream, up to ``[DONE]``."""
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if not isinstance(event, dict) or "error" in event:
            raise RequestFailed(f"error event: {data[:300]}")
        yield event


def one_request(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> Sample:
    """One streaming completion; raises ``RequestFailed`` (or an ``httpx.HTTPError``)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    started = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RequestFailed(f"HTTP {response.status_code}: {response.read()[:300]!r}")
        for event in _events(response):
            if ttft is None and any(c.get("text") for c in event.get("choices") or ()):
                ttft = time.perf_counter() - started
            usage = event.get("usage") or usage
    total = time.perf_counter() - started
    if ttft is None:
        raise RequestFailed("the stream ended without any text")
    return Sample(
        ttft, total, int(usage.get("kv_bytes_received", 0)), float(usage.get("kv_transfer_s", 0.0))
    )


@dataclass
class _Target:
    name: str
    child: Child
    url: str
    model: str
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def send(self, client: httpx.Client, prompt: str, max_tokens: int, record: bool) -> None:
        if self.child.exit_code is not None:
            raise BenchError(self.child.describe("exited during the benchmark"))
        try:
            sample = one_request(client, self.url, self.model, prompt, max_tokens)
        except (RequestFailed, httpx.HTTPError, ValueError) as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return
        if record:
            self.samples.append(sample)


def _prompt(rng: random.Random, tokens: int) -> str:
    """``tokens`` ASCII characters (one token each), different for every request."""
    return "".join(rng.choices(string.ascii_lowercase + " ", k=tokens))


def measure_length(
    client: httpx.Client, targets: Sequence[_Target], tokens: int, cfg: TTFTConfig
) -> list[TTFTRow]:
    """Warm-up, then ``cfg.requests`` requests per target, alternating, for ``tokens``-token
    prompts (fewer once ``cfg.cap_s`` has passed); one row per target."""
    rng = random.Random(cfg.seed + tokens)
    for target in targets:
        target.samples, target.errors = [], []
    for _ in range(cfg.warmup):
        for target in targets:
            target.send(client, _prompt(rng, tokens), cfg.max_tokens, record=False)
    deadline = time.monotonic() + cfg.cap_s
    for _ in range(cfg.requests):
        for target in targets:
            target.send(client, _prompt(rng, tokens), cfg.max_tokens, record=True)
        if time.monotonic() > deadline:
            break
    return [TTFTRow(t.name, tokens, tuple(t.samples), tuple(t.errors)) for t in targets]


def run_bench(cfg: TTFTConfig) -> list[TTFTRow]:
    """Start both targets, measure every prompt length, stop both (whatever happens)."""
    rows: list[TTFTRow] = []
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=5.0)
    with (
        sigterm_raises(),
        contextlib.ExitStack() as stack,
        httpx.Client(timeout=timeout) as client,
    ):
        targets = []
        for name in TARGETS:
            child, url = stack.enter_context(_started(cfg, name))
            targets.append(_Target(name, child, url, _model(client, url)))
        for tokens in cfg.lengths:
            rows += measure_length(client, targets, tokens, cfg)
    return rows


# --- output ------------------------------------------------------------------------------------


def _cells(row: TTFTRow, base: TTFTRow) -> list[str]:
    ttft, total = row.ttft_ms, row.total_ms
    ratio = ttft.p50 / base.ttft_ms.p50 if row.samples and base.samples else float("nan")
    return [
        str(row.tokens),
        row.target,
        str(len(row.samples)),
        str(len(row.errors)),
        f"{ttft.p50:.1f}",
        f"{ttft.p90:.1f}",
        f"{ttft.p99:.1f}",
        f"{ratio:.2f}",
        f"{total.p50:.1f}",
        f"{total.p99:.1f}",
        f"{row.kv_mib:.2f}",
        f"{row.kv_transfer_ms:.1f}",
    ]


HEADER = [
    "tokens",
    "target",
    "n",
    "errors",
    "TTFT p50",
    "p90",
    "p99",
    "ratio p50",
    "total p50",
    "p99",
    "kv MiB",
    "xfer ms",
]


def render(cfg: TTFTConfig, rows: Sequence[TTFTRow]) -> str:
    bases = {row.tokens: row for row in rows if row.target == "baseline"}
    table = "\n".join(text_table([HEADER, *(_cells(row, bases[row.tokens]) for row in rows)]))
    args = " ".join(cfg.worker_args) or "(defaults)"
    head = (
        f"cluster_ttft: pd-cluster 1P1D (--engine {cfg.engine}) vs co-located worker "
        f"(--role both); worker args: {args}; max_tokens {cfg.max_tokens}; stream; "
        f"sequential, alternating; {LOOPBACK}"
    )
    legend = (
        "times in ms; ratio p50 = TTFT p50 / baseline TTFT p50; kv MiB and xfer ms: mean "
        "kv_bytes_received and kv_transfer_s from the final usage chunk"
    )
    errors = [f"  {row.target} {row.tokens}: {err}" for row in rows for err in row.errors[:3]]
    return "\n".join([head, "", table, "", legend, *(["", "errors:", *errors] if errors else [])])


def parse_args(argv: Sequence[str] | None = None) -> TTFTConfig:
    parser = argparse.ArgumentParser(
        prog="bench.load.cluster_ttft", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=TTFTConfig.requests,
        help="recorded requests per target and prompt length",
    )
    parser.add_argument(
        "--lengths",
        type=positive_ints,
        default=TTFTConfig.lengths,
        help="comma-separated prompt lengths in tokens",
    )
    parser.add_argument("--max-tokens", type=int, default=TTFTConfig.max_tokens)
    parser.add_argument("--engine", default=TTFTConfig.engine, help="pd-cluster --engine")
    parser.add_argument("--warmup", type=int, default=TTFTConfig.warmup)
    parser.add_argument(
        "--cap",
        type=float,
        default=TTFTConfig.cap_s,
        help="seconds per prompt length after which requests stop",
    )
    parser.add_argument("--ready-timeout", type=float, default=TTFTConfig.ready_timeout_s)
    parser.add_argument(
        "worker_args",
        nargs=argparse.REMAINDER,
        help="after --: pd-worker arguments for every worker (cluster and "
        "baseline), e.g. -- --layers 32 --bytes-per-token 8192",
    )
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests needs a value >= 1")
    extra = args.worker_args[1:] if args.worker_args[:1] == ["--"] else args.worker_args
    return TTFTConfig(
        requests=args.requests,
        lengths=args.lengths,
        max_tokens=args.max_tokens,
        engine=args.engine,
        worker_args=tuple(extra),
        warmup=args.warmup,
        cap_s=args.cap,
        ready_timeout_s=args.ready_timeout,
    )


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_args(argv)
    with exit_on_failure("cluster_ttft", "every target was stopped"):
        rows = run_bench(cfg)
    print(render(cfg, rows), flush=True)
    if any(row.errors for row in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
