"""Smoke tests of bench/transfer/kv_transfer.py and bench/load/cluster_ttft.py at tiny sizes.

They check that the benchmarks run and report well-formed rows (counts, positive rates, every
target present), never how fast anything is.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.transfer.kv_transfer import (
    CONTROL,
    LIBRARY,
    PATHS,
    KVConfig,
    render,
    run_bench,
    shuffled_runs,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY = KVConfig(
    layers=2,
    tokens=64,
    bytes_per_token=512,
    page_size=16,
    run_pages=2,
    requests=3,
    concurrency=(1, 2),
    overhead_requests=20,
    cap_s=30.0,
)


def test_shuffled_runs_permute_the_pages_in_runs() -> None:
    pages = shuffled_runs(10, 10, 4, random.Random(1))
    assert sorted(pages) == list(range(10, 20))
    starts = [i for i, page in enumerate(pages) if i == 0 or page != pages[i - 1] + 1]
    assert len(starts) <= 3  # runs of 4, 4 and 2 (fewer if two happen to line up)
    assert shuffled_runs(5, 3, 0, random.Random(1)) == [5, 6, 7]


@pytest.mark.timeout(60)
@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
async def test_kv_transfer_rows_are_well_formed() -> None:
    pytest.importorskip("mooncake.engine")
    report = await run_bench(TINY)

    assert [(row.name, row.concurrency) for row in report.throughput] == [
        (name, c) for c in TINY.concurrency for name in PATHS
    ]
    request_bytes = 4 * 4 * 16 * 256  # 4 pages x 4 regions x 16 tokens x 256 bytes
    for row in report.throughput:
        assert len(row.walls_s) == TINY.requests
        assert row.nbytes == request_bytes * row.concurrency
        assert row.entries >= 4  # at least one per region
        assert row.best_gbps >= row.median_gbps > 0
        assert row.cpu_s >= 0

    assert [row.name for row in report.overhead] == [*PATHS, CONTROL]
    for latency in report.overhead:
        assert len(latency.samples_s) == TINY.overhead_requests
        assert 0 < latency.ms.p50 <= latency.ms.p90 <= latency.ms.p99
    one_page = {row.name: row for row in report.overhead}
    assert one_page[LIBRARY].nbytes == 4 * 16 * 256 and one_page[LIBRARY].entries == 4
    assert one_page[CONTROL].nbytes == 0

    text = render(report)
    assert "ratio" in text and "library, 0 pages" in text
    assert len(re.findall(r"^library +[12] ", text, re.MULTILINE)) == 2


@pytest.mark.timeout(90)
@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
def test_cluster_ttft_runs_both_targets() -> None:
    pytest.importorskip("mooncake.engine")
    argv = [
        sys.executable,
        "-m",
        "bench.load.cluster_ttft",
        "--requests",
        "2",
        "--lengths",
        "64",
        "--warmup",
        "1",
        "--",
        "--pages",
        "256",
        "--layers",
        "2",
    ]
    done = subprocess.run(
        argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=80, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = {
        m[0]: m[1:]
        for m in re.findall(r"^\s*64\s+(\w+)\s+(\d+)\s+(\d+)\s+([\d.]+)", done.stdout, re.MULTILINE)
    }
    assert set(rows) == {"baseline", "cluster"}, done.stdout
    for n, errors, ttft_p50 in rows.values():
        assert (int(n), int(errors)) == (2, 0) and float(ttft_p50) > 0
    kv = re.search(r"^\s*64\s+cluster\s.*\s([\d.]+)\s+([\d.]+)$", done.stdout, re.MULTILINE)
    assert kv is not None and float(kv[1]) > 0  # the decode received KV bytes
