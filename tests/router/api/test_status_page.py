"""The router's live status page: its JSON (``/status/data``), the self-contained HTML page
(``/status``), the overload and circuit breaker parts (open breakers, workers backed off as
full, admission in flight / queued vs its limits), and the page itself rendering a running
``pd-cluster`` in headless Chromium."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from registry.engine_api import RankTables
from router.api.status_view import status_snapshot
from router.context import open_context
from router.server.lifecycle import RouterLifecycle
from router.workers import EngineLoad
from testkit.chromium import Chromium, chromium_available
from testkit.cluster_process import ClusterProcess
from testkit.fake_cluster import FakeClusterFactory, settings_for
from testkit.polling import await_until
from testkit.servers import free_port
from tests.router.server.test_workers import supervised

SNAPSHOT_KEYS = {
    "generated_at",
    "routing",
    "engine",
    "policy",
    "ready",
    "workers",
    "pairs",
    "traffic",
    "registry",
    "kv_events",
    "admission",
    "circuits",
    "processes",
    "replicas",
    "sessions",
    "tenants",
}
WORKER_KEYS = {
    *("id", "url", "role", "healthy", "draining", "ejected", "inflight", "dp_size", "ranks"),
    *("full_retry_in_s", "circuit", "models", "adapters"),
}
ADMISSION_KEYS = {
    "inflight",
    "queued",
    "limit",
    "max_queued",
    "queue_timeout_s",
    "queued_by_priority",
    "worker_queue",
}
BREAKER_KEYS = {"state", "reason", "retry_in_s", "open_s", "trial_in_flight"}
DECODE_RANK_KEYS = {"dp_rank", "inflight", "engine"}
PREFILL_RANK_KEYS = DECODE_RANK_KEYS | {"pending_prefill_tokens", "kv_blocks"}
PROMPT = {"prompt": "the status page shows this", "max_tokens": 4}
FAKE_COMPLETION = {"model": "fake-model", **PROMPT}  # testkit's fake engines
SIM_COMPLETION = {"model": "sim-model", **PROMPT}  # pd-cluster's simulated workers


def _requests_in_window(snapshot: dict[str, Any]) -> int:
    return sum(bucket["requests"] for bucket in snapshot["traffic"]["buckets"])


# --- /status/data and /status over HTTP --------------------------------------------------------


def test_status_data_describes_the_cluster(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang", prefill=1, decode=2, dp_size=2)
    with cluster.client() as client:
        assert client.post("/v1/completions", json=FAKE_COMPLETION).status_code == 200
        response = client.get("/status/data")
    assert response.status_code == 200
    assert response.headers["cache-control"] == "no-store"
    data = response.json()
    assert set(data) == SNAPSHOT_KEYS
    assert data["engine"] == "sglang"
    assert data["processes"] is None  # one process: router --workers N lists them
    assert data["policy"] == {"prefill": "round_robin", "decode": "round_robin"}
    assert data["sessions"] == {"entries": 0, "max_entries": 100_000, "ttl_s": 600, "evicted": 0}
    assert data["ready"] is True
    assert abs(data["generated_at"] - time.time()) < 30
    prefill, decodes = data["workers"]["prefill"], data["workers"]["decode"]
    assert [w["url"] for w in prefill] == cluster.prefill_urls
    assert sorted(w["url"] for w in decodes) == sorted(cluster.decode_urls)
    for worker in prefill + decodes:
        assert set(worker) == WORKER_KEYS
        assert worker["healthy"] is True and worker["draining"] is False
        assert worker["circuit"] is None and worker["full_retry_in_s"] is None
    assert prefill[0]["role"] == "prefill" and prefill[0]["dp_size"] == 2
    assert [set(rank) for rank in prefill[0]["ranks"]] == [PREFILL_RANK_KEYS] * 2
    assert [rank["dp_rank"] for rank in prefill[0]["ranks"]] == [0, 1]
    assert all(set(rank) == DECODE_RANK_KEYS for w in decodes for rank in w["ranks"])
    assert data["registry"]["url"] == "memory://" and data["registry"]["ok"] is True
    assert set(data["registry"]) == {"url", "ok", "error", "since"}
    assert isinstance(data["pairs"], list) and isinstance(data["kv_events"], list)
    assert data["traffic"]["bucket_s"] > 0
    assert _requests_in_window(data) >= 1
    assert data["circuits"] == []
    assert data["admission"] == {  # the defaults; the request above has finished
        "inflight": 0,
        "queued": 0,
        "limit": 1024,
        "max_queued": 2048,
        "queue_timeout_s": 30.0,
        "queued_by_priority": {"high": 0, "normal": 0, "low": 0},
        "worker_queue": None,  # no --queue-at-worker-caps
    }
    assert data["tenants"] is None  # no --api-keys


def test_status_page_is_self_contained_html(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang")
    with cluster.client(follow_redirects=False) as client:
        root = client.get("/")
        page = client.get("/status")
    assert root.status_code == 307 and root.headers["location"] == "/status"
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["cache-control"] == "no-store"
    html = page.text
    assert "/status/data" in html and 'data-stat="requests"' in html
    # nothing is loaded from elsewhere: no script/style/image sources, no links out
    assert not re.search(r"<script[^>]*\ssrc\s*=", html, re.I)
    assert not re.search(r"<link[^>]*\shref\s*=", html, re.I)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html, re.I)
    assert not re.search(r"@import|url\(", html, re.I)
    # data only ever enters the DOM as text
    assert "innerHTML" not in html and "insertAdjacentHTML" not in html


_TRIPPED_JS = """(() => {
    const open = document.querySelector('tr[data-worker="%(decode)s"] [data-circuit="open"]');
    const full = document.querySelector('tr[data-worker="%(prefill)s"] [data-full]');
    const rows = [...document.querySelectorAll("#circuits tr[data-circuit]")];
    return Boolean(open && open.textContent.startsWith("circuit open · retry in")
        && full && full.textContent.startsWith("full, retry in")
        && rows.some((r) => r.dataset.circuit === "worker" && r.dataset.state === "open"
                     && r.textContent.includes("%(decode)s"))
        && rows.some((r) => r.dataset.circuit === "full" && r.textContent.includes("%(prefill)s")));
})()"""


async def test_open_breakers_and_full_workers_are_shown(
    make_cluster: FakeClusterFactory, tmp_path: Path
) -> None:
    """A decode answering 500 opens its breaker; a prefill answering 503 (full) is backed off:
    /status/data says which, why and for how long, and the page shows both (Chromium)."""
    cluster = make_cluster(
        "vllm-nixl",
        prefill=2,
        decode=2,
        health={"interval_s": 60.0, "failure_threshold": 2},
        breaker={"open_s": 30.0},
        admission={"capacity_backoff_s": 60.0},
    )
    cluster.decodes[0].config.fail_status = 500
    cluster.prefills[1].config.fail_status = 503
    broken, full = cluster.decode_urls[0], cluster.prefill_urls[1]
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=20) as client:
        for _ in range(6):  # round robin: the broken decode is picked (and fails) twice
            await client.post("/v1/completions", json=FAKE_COMPLETION)
        data = (await client.get("/status/data")).json()
    workers = {w["url"]: w for role in ("prefill", "decode") for w in data["workers"][role]}
    circuit = workers[broken]["circuit"]
    assert circuit["state"] == "open" and 0 < circuit["retry_in_s"] <= 30
    assert "2 requests in a row failed (last: HTTP 500" in circuit["reason"]
    assert workers[broken]["healthy"] is True  # kept away by its breaker, not unhealthy
    assert 0 < workers[full]["full_retry_in_s"] <= 60 and workers[full]["circuit"] is None
    others = [w for url, w in workers.items() if url not in (broken, full)]
    assert [(w["circuit"], w["full_retry_in_s"]) for w in others] == [(None, None)] * 2
    [tripped] = data["circuits"]
    assert set(tripped) == {"scope", "role", "worker"} | BREAKER_KEYS
    assert (tripped["scope"], tripped["role"], tripped["worker"]) == ("worker", "decode", broken)
    if not chromium_available():
        return
    async with Chromium(tmp_path) as browser:
        await browser.navigate(f"{cluster.router_url}/status")
        script = _TRIPPED_JS % {"decode": broken, "prefill": full}
        await browser.wait_for(script, 20, "the open breaker and the full prefill shown")
        assert await browser.evaluate("document.body.dataset.state") == "live"
    cluster.wait_idle()


# --- the snapshot from a live context ----------------------------------------------------------


async def test_snapshot_shows_fresh_engine_readings_only() -> None:
    prefill_url, decode_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    settings = settings_for("sglang", [(prefill_url, None)], [decode_url], load={"interval_s": 0})
    async with open_context(settings, RankTables(), RouterLifecycle()) as ctx:
        decode = ctx.pool.decode[0]
        now = time.monotonic()
        decode.record_engine_load(
            [EngineLoad(3, 1, 0.25)], at=now - 1.0, stale_after=5.0, dispatched=[0]
        )
        shown = status_snapshot(ctx)["workers"]["decode"][0]["ranks"][0]["engine"]
        assert shown["running"] == 3 and shown["waiting"] == 1 and shown["kv_usage"] == 0.25
        assert 1.0 <= shown["age_s"] < 30.0
        decode.record_engine_load(
            [EngineLoad(3, 1, 0.25)], at=now - 10.0, stale_after=5.0, dispatched=[0]
        )
        stale = status_snapshot(ctx)["workers"]["decode"][0]["ranks"][0]["engine"]
        assert stale is None  # an old reading is unknown, as the router treats it
        assert json.loads(json.dumps(status_snapshot(ctx)))["engine"] == "sglang"


async def test_snapshot_shows_admission_against_its_limits_and_open_pair_breakers() -> None:
    prefill_url, decode_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    settings = settings_for(
        "sglang",
        [(prefill_url, None)],
        [decode_url],
        load={"interval_s": 0},
        admission={"max_concurrent_requests": 1, "max_queued_requests": 4, "queue_timeout_s": 9},
        breaker={"pair_failure_threshold": 2},
    )
    async with open_context(settings, RankTables(), RouterLifecycle()) as ctx:
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await ctx.admission.acquire(never)
        waiting = asyncio.create_task(ctx.admission.acquire(never))
        await await_until(lambda: ctx.admission.queued == 1, 5, "one request queued")
        assert status_snapshot(ctx)["admission"] == {
            "inflight": 1,
            "queued": 1,
            "limit": 1,
            "max_queued": 4,
            "queue_timeout_s": 9.0,
            "queued_by_priority": {"high": 0, "normal": 1, "low": 0},
            "worker_queue": None,
        }
        ctx.admission.release()  # the slot passes to the queued request
        await waiting
        ctx.admission.release()
        assert status_snapshot(ctx)["admission"]["inflight"] == 0

        prefill, decode = ctx.pool.prefill[0], ctx.pool.decode[0]
        for _ in range(2):
            ctx.pipeline.circuits.pair_failure(prefill, decode, "kv_timeout")
        [pair] = status_snapshot(ctx)["circuits"]
        assert set(pair) == {"scope", "prefill", "decode"} | BREAKER_KEYS
        assert (pair["scope"], pair["prefill"], pair["decode"]) == ("pair", prefill_url, decode_url)
        assert pair["state"] == "open" and "last: kv_timeout" in pair["reason"]
        shown = status_snapshot(ctx)["workers"]
        assert shown["prefill"][0]["circuit"] is None and shown["decode"][0]["circuit"] is None


async def test_snapshot_says_no_admission_limit_as_null() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    settings = settings_for(
        "sglang", [(url, None)], [url], admission={"max_concurrent_requests": 0}
    )
    async with open_context(settings, RankTables(), RouterLifecycle()) as ctx:
        assert status_snapshot(ctx)["admission"]["limit"] is None


# --- the page in headless Chromium against a running pd-cluster -------------------------------


@pytest.fixture
def pd_cluster(tmp_path: Path) -> Iterator[ClusterProcess]:
    cluster = ClusterProcess(
        tmp_path / "pd-cluster.log",
        *("--prefill", "2", "--decode", "1", "--ready-timeout", "40"),
        *("--", "--pages", "256", "--bytes-per-token", "64"),
    )
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.stop()


def _rows_ready_js(workers: list[tuple[str, str]]) -> str:
    """JS: every (role, url) has a ``[data-worker]`` row of that role whose health is true."""
    return f"""(() => {{
        const rows = [...document.querySelectorAll("tr[data-worker]")];
        return {json.dumps(workers)}.every(([role, url]) => rows.some((row) =>
            row.dataset.worker === url && row.dataset.role === role &&
            row.querySelector("[data-healthy]").dataset.healthy === "true"));
    }})()"""


_REQUESTS_JS = (
    'Number(document.querySelector(\'[data-stat="requests"]\').textContent.replace(/,/g, ""))'
)


async def _complete(client: httpx.AsyncClient, count: int) -> None:
    """``count`` completions through the router, every other one a stream (they have a TTFT)."""
    for index in range(count):
        body = {**SIM_COMPLETION, "stream": index % 2 == 1}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            answer = await response.aread()
            assert response.status_code == 200, answer


@pytest.mark.timeout(120)
@pytest.mark.skipif(not chromium_available(), reason="needs Chromium (scripts/setup-test.sh)")
async def test_status_page_in_headless_chromium(pd_cluster: ClusterProcess, tmp_path: Path) -> None:
    async with httpx.AsyncClient(base_url=pd_cluster.url, timeout=20) as client:
        await _complete(client, 3)
        ready = (await client.get("/ready")).json()
        workers = [(role, w["url"]) for role in ("prefill", "decode") for w in ready[role]]
        assert len(workers) == 3
        async with Chromium(tmp_path) as browser:
            await browser.navigate(f"{pd_cluster.url}/status")
            await browser.wait_for("document.body.dataset.updated", 30, "the first render")
            await browser.wait_for(_rows_ready_js(workers), 20, "every worker shown healthy")
            await browser.wait_for(f"{_REQUESTS_JS} >= 3", 20, "the 3 requests shown")
            before = await browser.evaluate(_REQUESTS_JS)
            stamp = await browser.evaluate("document.body.dataset.updated")
            await _complete(client, 1)  # the page picks it up without a reload
            await browser.wait_for(f"{_REQUESTS_JS} >= {before + 1}", 20, "the new request")
            assert await browser.evaluate("document.body.dataset.updated") != stamp
            assert await browser.evaluate("document.body.dataset.state") == "live"
            # one router process: no process table
            assert await browser.evaluate("document.getElementById('processes-section').hidden")
            png = await browser.screenshot()
            # the router goes away: the page says its data is stale and keeps showing it
            await asyncio.to_thread(pd_cluster.stop)
            await browser.wait_for("document.body.dataset.state === 'stale'", 20, "stale state")
            assert "failed" in await browser.evaluate("document.getElementById('banner').innerText")
            assert await browser.evaluate(f"{_REQUESTS_JS} >= {before + 1}")
            assert await browser.wait_for(_rows_ready_js(workers), 1, "the last rows kept")
    path = tmp_path / "status-page.png"
    path.write_bytes(png)
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    print(f"status page screenshot: {path}")
    if copy_to := os.environ.get("PDR_STATUS_SCREENSHOT"):
        shutil.copyfile(path, copy_to)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not chromium_available(), reason="needs Chromium (scripts/setup-test.sh)")
async def test_status_page_lists_the_router_processes(tmp_path: Path) -> None:
    with supervised() as (url, _):
        async with Chromium(tmp_path) as browser:
            await browser.navigate(f"{url}/status")
            rows = "document.querySelectorAll('tr[data-process]').length === 2"
            await browser.wait_for(rows, 30, "both router processes listed")
            assert not await browser.evaluate("document.getElementById('processes-section').hidden")
