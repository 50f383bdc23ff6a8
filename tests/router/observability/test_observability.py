"""deploy/observability: the Grafana dashboard and the alert rules query series that exist.

The static checks run ``promtool`` on the rules and the scrape config and read the dashboard JSON.
The end-to-end check starts ``pd-cluster`` (router, two prefills, one decode) as a process, a
real Prometheus scraping the router and every engine with the rules loaded, sends a little
traffic (both endpoints, streaming and not, one 400), and then evaluates every dashboard panel
query and every alert expression through Prometheus's HTTP API: a query that errors or returns no
series (a misspelt metric or label, a metric the router does not export, a ratio whose numerator
does not exist while all is well) fails the test, listing each such query.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from router.settings import AdmissionSettings
from testkit.cluster_process import ClusterProcess
from testkit.polling import wait_until
from testkit.prometheus_server import PrometheusServer, ScrapeGroup

OBSERVABILITY = Path(__file__).resolve().parents[3] / "deploy" / "observability"
DASHBOARD = OBSERVABILITY / "grafana-dashboard.json"
RULES = OBSERVABILITY / "prometheus-rules.yaml"
CONFIG = OBSERVABILITY / "prometheus.yml"
PROMTOOL = Path(os.environ.get("PDR_PROMTOOL_BINARY", "/usr/bin/promtool"))
ROUTER_JOB, ENGINE_JOB = "pd-router", "pd-engines"  # prometheus.yml's jobs; the rules name them
# What Grafana substitutes; 1m holds many of the test Prometheus's 1 s scrapes.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}
# The rules' convention: `<query> <op> <number>`, one top-level comparison at the end.
COMPARISON = re.compile(
    r"^(?P<query>.*\S)\s*(?P<op>==|!=|>=|<=|>|<)\s*(?P<number>[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?)\s*$",
    re.DOTALL,
)
REQUIRED_ALERTS = {
    "PDRouterNoHealthyPrefill",
    "PDRouterNoHealthyDecode",
    "PDRouterHigh5xxRatio",
    "PDRouterTTFTP95High",
    "PDRouterKVWaitP95High",
    "PDRouterPDRecompute",
    "PDRouterWorkerUnhealthy",
    "PDRouterUpstreamErrors",
    "PDRouterKVEventsLost",
    "PDRouterRegistryDown",
    "PDRouterEngineLoadStale",
    "PDRouterShedding",
    "PDRouterQueueing",
    "PDRouterWorkerCircuitOpen",
    "PDRouterPairCircuitOpen",
    "PDRouterRoutingDegraded",
}
LOAD_REQUESTS = 24
CLUSTER_READY_S = 30.0
SETTLE_S = 15.0  # after the load: scrapes land, rules evaluate, KV events arrive


# --- static checks ---------------------------------------------------------------------------


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if not os.access(PROMTOOL, os.X_OK):
        pytest.fail(f"promtool not found at {PROMTOOL}: install the Debian package prometheus")
    return subprocess.run(
        [str(PROMTOOL), *args], capture_output=True, text=True, timeout=30, check=False
    )


def test_promtool_accepts_the_rules_and_the_scrape_config() -> None:
    rules = _promtool("check", "rules", str(RULES))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    config = _promtool("check", "config", str(CONFIG))  # rule_files resolve next to it
    assert config.returncode == 0, config.stdout + config.stderr
    assert "1 rule files found" in config.stdout, config.stdout
    jobs = re.findall(r"job_name:\s*(\S+)", CONFIG.read_text())
    assert jobs == [ROUTER_JOB, ENGINE_JOB], jobs


def _dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows and the panels of collapsed rows included."""
    top: list[dict[str, Any]] = dashboard["panels"]
    return [p for panel in top for p in (panel, *panel.get("panels", []))]


def test_dashboard_is_well_formed() -> None:
    dashboard = _dashboard()
    assert dashboard["schemaVersion"] == 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    # the in-flight panel's limit line defaults to the router's default limit
    limit = variables["admission_limit"]
    assert limit["type"] == "textbox" and limit["description"]
    assert limit["query"] == str(AdmissionSettings().max_concurrent_requests)
    panels = _panels(dashboard)
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"
    rows = [panel["title"] for panel in panels if panel["type"] == "row"]
    assert rows == [
        "Traffic",
        "PD stages",
        "PD health",
        "Workers",
        "Overload and circuit breakers",
        "Engines",
        "Cache routing",
        "Registry",
    ]
    for panel in (p for p in panels if p["type"] != "row"):
        name = f"panel {panel['id']} {panel.get('title')!r}"
        assert panel.get("title") and panel.get("description"), name
        assert panel["fieldConfig"]["defaults"].get("unit"), name
        assert panel["datasource"]["uid"] == "${datasource}", name
        assert panel["targets"], name
        for target in panel["targets"]:
            assert target.get("expr", "").strip(), f"{name} target {target.get('refId')}"
            windows = set(re.findall(r"\[([^\]]*)\]", target["expr"]))
            assert windows <= {"$__rate_interval"}, f"{name}: range windows {windows}"


def _panel_queries() -> list[tuple[str, str]]:
    """(name, query) for every dashboard target, with Grafana's variables and the dashboard's
    own text variables (their default) substituted."""
    dashboard = _dashboard()
    variables = dict(GRAFANA_VARIABLES)
    for variable in dashboard["templating"]["list"]:
        if variable["type"] in ("textbox", "constant"):
            variables["$" + variable["name"]] = variable["query"]
    queries = []
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in variables.items():
                expr = expr.replace(variable, value)
            queries.append((f"panel {panel['title']!r} {target['refId']}", expr))
    return queries


def _alert_query(name: str, expr: str) -> tuple[str, str]:
    """``<query> <op> <number>`` becomes ``(<query>) <op> bool <number>``: 0/1 per series."""
    match = COMPARISON.match(expr)
    assert match, f"alert {name}: expr does not end in `<op> <number>`: {expr}"
    return f"alert {name}", f"({match['query']}) {match['op']} bool {match['number']}"


def _alerts(prometheus: PrometheusServer) -> list[dict[str, Any]]:
    return [rule for rule in prometheus.rules() if rule["type"] == "alerting"]


def test_alert_rules_are_complete() -> None:
    """Loaded by a real Prometheus: every alert has a duration, a severity, a summary and a
    description, and follows the `<query> <op> <number>` convention."""
    with PrometheusServer(rule_files=[RULES]) as prometheus:
        alerts = _alerts(prometheus)
    assert {alert["group"] for alert in alerts} == {"pd-router"}
    assert {alert["name"] for alert in alerts} >= REQUIRED_ALERTS
    for alert in alerts:
        assert alert["duration"] > 0, alert["name"]
        assert alert["labels"].get("severity") in {"critical", "warning"}, alert["name"]
        assert {"summary", "description"} <= alert["annotations"].keys(), alert["name"]
        _alert_query(alert["name"], alert["query"])


# --- a real Prometheus scraping a running pd-cluster -----------------------------------------


@contextlib.contextmanager
def _pd_cluster(tmp_path: Path, engine: str) -> Iterator[str]:
    """``pd-cluster --prefill 2 --decode 1`` as a process; yields the router's URL once ready."""
    cluster = ClusterProcess(
        tmp_path / "pd-cluster.log",
        *("--prefill", "2", "--decode", "1", "--engine", engine),
        *("--ready-timeout", str(CLUSTER_READY_S)),
    )
    try:
        cluster.wait_ready(CLUSTER_READY_S + 5)
        yield cluster.url
    finally:
        cluster.stop()


def _scrape_groups(router_url: str) -> list[ScrapeGroup]:
    """The router and every engine it knows (from ``GET /ready``), as prometheus.yml groups them."""
    status = httpx.get(f"{router_url}/ready", timeout=5).json()

    def hosts(role: str) -> tuple[str, ...]:
        return tuple(str(urlsplit(worker["url"]).netloc) for worker in status[role])

    return [
        ScrapeGroup(ROUTER_JOB, (str(urlsplit(router_url).netloc),)),
        ScrapeGroup(ENGINE_JOB, hosts("prefill"), {"role": "prefill"}),
        ScrapeGroup(ENGINE_JOB, hosts("decode"), {"role": "decode"}),
    ]


def _body(i: int, path: str) -> dict[str, Any]:
    """A shared long prefix (prefix-cache hits) and a distinct tail; every third one plain, the
    streams alternately with ``stream_options.include_usage``."""
    prompt = "You are a terse assistant. " * 8 + f"Question {i}: count to {i}."
    body: dict[str, Any] = {"model": "sim-model", "max_tokens": 6}
    if path == "/v1/completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    if i % 3:
        body["stream"] = True
        if i % 2:
            body["stream_options"] = {"include_usage": True}
    return body


def _send_load(router_url: str) -> None:
    with httpx.Client(base_url=router_url, timeout=20.0) as client:
        for i in range(LOAD_REQUESTS):
            path = ("/v1/completions", "/v1/chat/completions")[i % 2]
            body = _body(i, path)
            with client.stream("POST", path, json=body) as response:
                text = response.read().decode()
            assert response.status_code == 200, text
            assert ("data: [DONE]" if body.get("stream") else '"choices"') in text, text
        rejected = client.post("/v1/completions", json={"prompt": "no model"})
        assert rejected.status_code == 400, rejected.text


def _count(prometheus: PrometheusServer, expr: str) -> float:
    result = prometheus.query(expr)["data"]["result"]
    return float(result[0]["value"][1]) if result else 0.0


def _failing(prometheus: PrometheusServer, queries: list[tuple[str, str]]) -> list[str]:
    failures = []
    for name, expr in queries:
        answer = prometheus.query(expr)
        if answer.get("status") != "success":
            failures.append(f"{name}: error {answer.get('error')!r}: {expr}")
        elif not answer["data"]["result"]:
            failures.append(f"{name}: no series: {expr}")
    return failures


@pytest.mark.slow  # ~20 s each: scripts/test-slow (CI runs it)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine", ["vllm-mooncake", "sglang"])
def test_every_panel_and_alert_query_returns_series(tmp_path: Path, engine: str) -> None:
    with _pd_cluster(tmp_path, engine) as router_url:
        groups = _scrape_groups(router_url)
        targets = sum(len(group.targets) for group in groups)
        with PrometheusServer(groups, rule_files=[RULES]) as prometheus:
            wait_until(
                lambda: _count(prometheus, "count(up == 1)") == targets,
                15.0,
                f"all {targets} targets scraped",
                interval=0.2,
            )
            _send_load(router_url)
            # two scrapes of every target after the load: each series has >= 2 samples
            # since, so rate() over 1m answers
            after = time.time() + 1.5
            wait_until(
                lambda: _count(prometheus, "min(timestamp(up))") > after,
                15.0,
                "two scrapes after the load",
                interval=0.2,
            )
            queries = _panel_queries() + [
                _alert_query(alert["name"], alert["query"]) for alert in _alerts(prometheus)
            ]
            deadline = time.monotonic() + SETTLE_S
            while (failures := _failing(prometheus, queries)) and time.monotonic() < deadline:
                time.sleep(0.5)  # poll: late series (KV events, load readings) may still land
            broken = [
                f"alert {rule['name']}: {rule.get('lastError')}"
                for rule in _alerts(prometheus)
                if rule.get("health") == "err"
            ]
    assert not failures, f"{len(failures)} of {len(queries)} queries failed:\n" + "\n".join(
        failures
    )
    assert not broken, "\n".join(broken)
