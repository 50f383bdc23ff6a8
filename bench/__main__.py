"""``python -m bench``: every benchmark, by suite: its name, its command, what it measures."""

from __future__ import annotations

import ast
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.common.table import text_table

__all__ = ["BENCHMARKS", "SUITES", "Benchmark", "main", "render"]

SUITES = ("load", "routing", "discovery", "kv_tiers", "soak", "transfer")


@dataclass(frozen=True)
class Benchmark:
    name: str  # the module under ``bench.`` that runs it
    what: str

    @property
    def suite(self) -> str:
        return self.name.split(".")[0]

    @property
    def command(self) -> str:
        return f"python -m bench.{self.name}"


BENCHMARKS = (
    Benchmark("load.run", "the router vs a fake decode engine directly: req/s, latency, CPU/req"),
    Benchmark("load.peers", "router CPU/req vs vllm-router, sglang-router; ledger; old build"),
    Benchmark(
        "load.floor_app", "the floors: the router's server alone, a bare PD proxy (load.peers)"
    ),
    Benchmark("load.pipeline_cost", "the router's request path in process, µs/req; old build"),
    Benchmark(
        "load.pipeline_cost_child", "one build's in-process figure (load.pipeline_cost runs it)"
    ),
    Benchmark("load.cluster_ttft", "end-to-end TTFT: pd-cluster 1P1D vs a co-located worker"),
    Benchmark(
        "load.flow_control", "tenants and priorities under overload: TTFT through pd-cluster"
    ),
    Benchmark(
        "load.flow_bound", "no measurement: what any order can do for flow_control (a), simulated"
    ),
    Benchmark("load.clients", "upstream HTTP client cost: httpx, httpx + lean pool, aiohttp"),
    Benchmark("load.loadgen", "the closed-loop HTTP/1.1 load generator (load.run drives it)"),
    Benchmark("load.workers", "router processes (--workers N): req/s, scaling, CPU/req each"),
    Benchmark(
        "load.loadgen_group", "load generators that start together (load.workers drives them)"
    ),
    Benchmark("load.demo", "no measurement: fake engines behind a real router, to try by hand"),
    Benchmark("routing.workload", "routing policies (ours, sglang-router's) on realistic traces"),
    Benchmark("routing.kv_index", "the router's KV block index: bytes per block, match/store time"),
    Benchmark("routing.tokenize_cost", "tokenize time per request, shared prefix seen or cold"),
    Benchmark("discovery.registry", "registry: worker choice, watch propagation, registrations/s"),
    Benchmark("kv_tiers", "tiered KV cache: TTFT per tier, a workload with tiers, disk speed"),
    Benchmark("soak", "fault-matrix soak: recovery, clean outcomes, fd/task/RSS leaks"),
    Benchmark("soak.rss_drift", "the router's RSS under steady traffic; KV pages left once idle"),
    Benchmark("transfer.event_read", "a KV event reader's CPU per batch; old build, floor"),
    Benchmark("transfer.kv_transfer", "the KV transfer library vs raw Mooncake: GB/s, overhead"),
    Benchmark("transfer.engine", "transfer engine: GB/s of pages, one entry per page vs coalesced"),
)


def suite_summary(suite: str) -> str:
    """The one-line docstring of ``bench/SUITE/__init__.py`` (read, not imported)."""
    source = (Path(__file__).parent / suite / "__init__.py").read_text()
    return (ast.get_docstring(ast.parse(source)) or "").split("\n")[0]


def render() -> str:
    """One table, a block of rows per suite under the suite's summary."""
    header, rule, *rows = text_table(
        [["name", "command", "what"], *([b.name, b.command, b.what] for b in BENCHMARKS)],
        left=3,
        strip=True,
    )
    lines = ["pd-router benchmarks (`python -m bench.<name> --help`: each one's options)", ""]
    lines += [f"  {header}", f"  {rule}"]
    for suite in SUITES:
        lines += ["", f"{suite}: {suite_summary(suite)}"]
        lines += [f"  {row}" for b, row in zip(BENCHMARKS, rows, strict=True) if b.suite == suite]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    if list(sys.argv[1:] if argv is None else argv):
        print("usage: python -m bench  (lists the benchmarks; takes no arguments)", file=sys.stderr)
        return 2
    print(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
