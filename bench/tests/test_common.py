"""bench.common: a child's log and stop, health waits, Prometheus samples, text tables."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from bench.common.process import BenchError, Child, free_port, free_ports, start_time
from bench.common.prometheus import totals, value
from bench.common.ready import wait_health, wait_http_ok
from bench.common.table import text_table


def test_a_child_reports_its_ready_line_and_is_stopped_with_what_it_started() -> None:
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
    script += "'import time; time.sleep(60)'], start_new_session=True); "  # out of its group
    script += "print('up at http://x:1', flush=True); time.sleep(60)"
    with Child([sys.executable, "-c", script], ready_prefix="up at ") as child:
        assert child.wait_ready_line(20.0) == "http://x:1"
        child.note_descendants()
        (kid,) = child.known
    assert child.exit_code is not None
    for _ in range(100):  # killed too (then reaped by whoever adopted it)
        if start_time(kid) is None:
            break
        time.sleep(0.05)
    assert start_time(kid) is None


def test_a_child_with_a_log_file(tmp_path: Path) -> None:
    child = Child(
        [sys.executable, "-c", "print('hello')"], name="greeter", log_path=tmp_path / "g.log"
    )
    child.popen.wait(20.0)
    child.stop(grace_s=1.0)
    assert child.log_tail() == "  [greeter] hello"
    assert child.describe("gone") == "greeter: gone (exited with 0); last output:\n    hello"


def test_waits_end_at_the_deadline_or_when_the_child_exits() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert not wait_http_ok(url, time.monotonic() + 0.2)
    with Child([sys.executable, "-c", "pass"]) as child:
        child.popen.wait(20.0)
        with pytest.raises(BenchError, match="exited during start-up"):
            wait_health(child, url, 5.0)
    assert len(set(free_ports(3))) == 3


def test_prometheus_samples_summed_over_labels() -> None:
    registry = CollectorRegistry()
    hits = Counter("hits", "h", ["tier"], registry=registry)
    hits.labels("a").inc(2)
    hits.labels("b").inc(3)
    text = generate_latest(registry).decode()
    assert totals(text)["hits_total"] == 5.0
    assert value(text, "hits_total") == 2.0 and value(text, "nope") is None


def test_text_table_alignment() -> None:
    rows = [["name", "n"], ["a", "10"], ["bbb", "2"]]
    assert text_table(rows) == ["name   n", "----  --", "   a  10", " bbb   2"]
    assert text_table(rows, left=1, strip=True) == ["name   n", "----  --", "a     10", "bbb    2"]
