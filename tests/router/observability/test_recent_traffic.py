"""The recent-traffic window (``router.observability.recent_traffic``), and the host's window
summed from several processes' (``router --workers N``)."""

from __future__ import annotations

import msgspec

from router.observability.recent_traffic import RecentTraffic

NOW = 1_000_000.0


def test_the_hosts_window_sums_every_process_and_reads_ttft_from_the_summed_histogram() -> None:
    fast, slow = RecentTraffic(60.0, 5.0), RecentTraffic(60.0, 5.0)
    for _ in range(9):
        fast.record(200, 0.01, now=NOW)  # 10 ms bin
    for _ in range(9):
        slow.record(200, 0.9, now=NOW)  # 1 s bin
    slow.record(503, None, now=NOW - 10.0)
    fast.record(429, None, now=NOW - 10.0)
    # each process's window travels as JSON (its answer on the siblings' socket)
    raws = [msgspec.json.decode(msgspec.json.encode(w.raw())) for w in (fast, slow)]
    buckets = fast.merged(raws, now=NOW)["buckets"]
    assert len(buckets) == 12
    last, earlier = buckets[-1], buckets[-3]
    assert last["requests"] == 18 and last["errors"] == 0
    assert last["ttft_p50_s"] == 0.01 and last["ttft_p95_s"] == 1.0  # one histogram, not two
    assert (earlier["requests"], earlier["errors"], earlier["client_errors"]) == (2, 1, 1)
    assert fast.snapshot(now=NOW)["buckets"][-1]["requests"] == 9  # its own window unchanged


def test_a_malformed_window_is_left_out_of_the_hosts() -> None:
    window = RecentTraffic(60.0, 5.0)
    window.record(200, 0.01, now=NOW)
    index = int(NOW // 5.0)
    bad = [[index, 5, 0, 0, [1, 2]], [index, "x", 0, 0, [0] * 24], "not a bucket"]
    buckets = window.merged([window.raw(), bad, None, {"a": 1}], now=NOW)["buckets"]
    assert buckets[-1]["requests"] == 1
