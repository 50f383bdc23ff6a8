"""The KV page canary of ``bench.soak.rss_drift``: after a short steady run on small pools, the
decodes hold no KV page once idle.

Small decode and prefill pools (128 pages) under 16 users fill up now and then; a decode that
kept the pages of a request given up (the router cancels the decode leg when the prefill leg
fails) until its transfer deadline ran out of pages for good within a few hundred requests.
"""

from __future__ import annotations

import pytest

from bench.soak.rss_drift import idle_line, leaked, measure


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_decodes_hold_no_kv_pages_after_a_short_run() -> None:
    drift = measure(
        "vllm-mooncake",
        requests=3000,
        every=1000,
        users=16,
        warmup=0,
        router_args=["--health-interval", "1"],
        worker_args=["--pages", "128"],
        max_s=150.0,
        idle_s=8.0,
    )
    assert sum(p.requests for p in drift.points[-1:]) == 3000
    assert [d for d in drift.idle if d.role == "decode"], drift.idle
    assert not leaked(drift.idle), "\n".join(idle_line(p) for p in drift.idle)
