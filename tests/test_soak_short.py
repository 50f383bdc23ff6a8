"""The fault-matrix soak's short version (``python -m bench.soak --short``), in the slow suite.

A real ``pd-cluster`` 2P2D (SGLang protocol, ``--restart-workers``, workers with ``--fault-api``),
the router on a real etcd with a 256 MiB body memory budget and 512 connections at most, takes
600 mixed requests (stream or not, chat or completions; more while faults run late) while a
compressed schedule injects: one of the two prefills frozen (SIGSTOP, 6 s), a prefill 5xx, a
decode SIGKILL during long streams, a KV-pool-full burst, a chunked trailer flood, 8 large
(28 MB ``logit_bias``) bodies, 600 idle
keep-alive connections from 3 other addresses, slowloris connections, and etcd restarted empty.
Every request must end in a complete answer or a clean error (an OpenAI error JSON or an SSE
error event) before its deadline, the router must be back to its file descriptors with nothing in
flight, every fault must be recovered from, and every targeted row met (``bench.soak.rows``): the
frozen prefill out of rotation within 3 s, no failed request after that and no decode breaker
opened; no failed request and every worker listed while etcd comes back empty; the burst queued,
not rejected; under each attack the router's peak RSS within its bound, ``/health`` within
100 ms and no failed request of anyone else. The soak runs as a subprocess: tests never import
``bench``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
FROZEN = "frozen prefill (1 of 2)"
EMPTY_ETCD = "empty etcd"
BURST = "KV-pool-full burst"
ATTACKS = {"large bodies", "chunked trailer flood", "idle keep-alive flood", "slowloris"}
FAULTS = {FROZEN, EMPTY_ETCD, BURST, "prefill 5xx", "decode SIGKILL mid-stream"} | ATTACKS


def _soak(out: Path) -> tuple[dict[str, Any], int, str]:
    run = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--short", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    report = f"exit {run.returncode}\n{run.stdout[-8000:]}\n{run.stderr[-6000:]}"
    assert out.exists(), report
    return json.loads(out.read_text()), run.returncode, report


@pytest.mark.slow  # ~65 s: scripts/test-slow (CI runs it)
@pytest.mark.timeout(180)
def test_short_soak_every_request_ends_cleanly_and_every_row_is_met(tmp_path: Path) -> None:
    result, returncode, report = _soak(tmp_path / "soak.json")
    (phase,) = result["phases"]
    assert 600 <= sum(phase["main"].values()) <= 1200, report  # more while faults ran late
    targets = result["targets"]
    assert targets["hung"] == 0 and targets["unclean"] == 0, report
    assert phase["fd_leak"] <= 4, report
    assert phase["router_before"]["tasks"] > 0 and phase["task_leak"] <= 0, report
    assert phase["inflight_after"] == 0, report
    rows = {row["fault"]: row for row in phase["faults"]}
    assert set(rows) == FAULTS, report
    assert all(row["recovery_s"] is not None for row in rows.values()), report
    frozen = rows[FROZEN]["measures"]
    assert frozen.get("detection_s", 99.0) <= 3.0 and frozen["decode_breakers"] == 0, report
    assert rows[EMPTY_ETCD]["measures"]["workers_listed_min"] == 4, report
    assert rows[BURST]["measures"]["burst_rejected"] == 0, report
    for name in ATTACKS:
        measures = rows[name]["measures"]
        assert measures["rss_peak_mib"] <= measures["rss_bound_mib"], report
        assert measures["health_max_ms"] <= 100 and measures["health_failed"] == 0, report
    # the attacks bit: the budget refused bodies, the trailers and connections were sent
    assert "429" in rows["large bodies"]["note"], report
    assert rows["chunked trailer flood"]["measures"]["attacker_trailer_mib"] > 0, report
    assert rows["idle keep-alive flood"]["measures"]["attacker_opened"] > 0, report
    targeted = [row for row in rows.values() if row["errors_after_window"] is not None]
    assert len(targeted) == 3 + len(ATTACKS), report
    assert all(row["errors_after_window"] == 0 and row["met"] for row in targeted), report
    assert targets["errors_after_window"] == 0 and targets["rows_missed"] == 0, report
    assert result["met"] and returncode == 0, report
