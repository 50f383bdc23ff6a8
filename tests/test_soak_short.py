"""The fault-matrix soak's short version (``python -m bench.soak --short``), in the default suite.

A real ``pd-cluster`` 2P2D (SGLang protocol, ``--restart-workers``, workers with ``--fault-api``)
takes ~300 mixed requests (stream or not, chat or completions) while a compressed schedule
injects a prefill 5xx, a decode SIGKILL during long streams, a prefill SIGSTOP of 2 s, a
KV-pool-full burst and slowloris connections. Every request must end in a complete answer or a
clean error (an OpenAI error JSON or an SSE error event) before its deadline, the router must be
back to its file descriptors with nothing in flight, and every fault must be recovered from.
The soak runs as a subprocess: tests never import ``bench``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FAULTS = {
    "prefill 5xx",
    "decode SIGKILL mid-stream",
    "prefill SIGSTOP",
    "KV-pool-full burst",
    "slowloris",
}


@pytest.mark.slow  # ~40 s: scripts/test-slow (CI runs it)
@pytest.mark.timeout(180)
def test_short_soak_every_request_ends_cleanly_and_every_fault_recovers(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--short", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    report = f"exit {run.returncode}\n{run.stdout[-6000:]}\n{run.stderr[-6000:]}"
    assert out.exists(), report
    result = json.loads(out.read_text())
    (phase,) = result["phases"]
    assert sum(phase["main"].values()) == 300, report
    assert result["targets"]["hung"] == 0, report
    assert result["targets"]["unclean"] == 0, report
    assert phase["fd_leak"] <= 4, report
    assert phase["router_before"]["tasks"] > 0 and phase["task_leak"] <= 0, report
    assert phase["inflight_after"] == 0, report
    rows = {row["fault"]: row for row in phase["faults"]}
    assert set(rows) == FAULTS, report
    assert all(row["recovery_s"] is not None for row in rows.values()), report
    # the faults bit: the burst and the killed decode ended requests with clean errors
    assert phase["fault_requests"]["error"] > 0, report
    assert "503" in phase["statuses"], report
    assert result["met"] and run.returncode == 0, report
