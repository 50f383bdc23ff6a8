"""A real Prometheus for tests: a free port on 127.0.0.1, a generated config, a temp TSDB.

    groups = [ScrapeGroup("pd-router", ("127.0.0.1:8000",))]
    with PrometheusServer(groups, rule_files=[RULES_PATH]) as prom:
        prom.query("rate(pdr_requests_total[1m])")  # the /api/v1/query answer, parsed
        prom.rules()  # every loaded rule, as /api/v1/rules reports it

Every target is scraped and every rule evaluated each second, so a test sees its traffic in
Prometheus within a couple of seconds and ``rate()`` over ``1m`` has samples soon after. The
config is written as JSON (which YAML reads) into the temp dir, next to the TSDB; the process runs
in its own process group, which is killed on exit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from testkit.servers import free_port

__all__ = ["PROMETHEUS_BINARY", "PrometheusMissing", "PrometheusServer", "ScrapeGroup"]

PROMETHEUS_BINARY = Path(os.environ.get("PDR_PROMETHEUS_BINARY", "/usr/bin/prometheus"))
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 5.0
INTERVAL = "1s"  # scrape and rule evaluation interval


class PrometheusMissing(RuntimeError):
    """The prometheus binary is not installed."""


@dataclass(frozen=True, slots=True)
class ScrapeGroup:
    """Targets (``host:port``) of one scrape job that share extra labels (e.g. ``role``)."""

    job: str
    targets: tuple[str, ...]
    labels: Mapping[str, str] = field(default_factory=dict)
    metrics_path: str = "/metrics"


class PrometheusServer:
    """One Prometheus process scraping ``groups`` and evaluating ``rule_files``."""

    def __init__(
        self,
        groups: Sequence[ScrapeGroup] = (),
        rule_files: Sequence[Path] = (),
        binary: Path = PROMETHEUS_BINARY,
    ) -> None:
        self.binary = binary
        self.groups = tuple(groups)
        self.rule_files = tuple(path.resolve() for path in rule_files)
        self.port = free_port()
        self.data_dir = Path(tempfile.mkdtemp(prefix="pdr-prometheus-"))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.data_dir / "prometheus.yml"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def config(self) -> dict[str, Any]:
        """The Prometheus configuration this server runs with."""
        jobs: dict[str, list[ScrapeGroup]] = {}
        for group in self.groups:
            jobs.setdefault(group.job, []).append(group)
        return {
            "global": {
                "scrape_interval": INTERVAL,
                "scrape_timeout": INTERVAL,
                "evaluation_interval": INTERVAL,
            },
            "rule_files": [str(path) for path in self.rule_files],
            "scrape_configs": [_job_config(job, groups) for job, groups in jobs.items()],
        }

    def start(self) -> None:
        """Start Prometheus, wait until ``/-/ready``; raises PrometheusMissing or RuntimeError."""
        if self.running:
            return
        if not os.access(self.binary, os.X_OK):
            raise PrometheusMissing(
                f"prometheus binary not found at {self.binary}: install the Debian package "
                "prometheus (or set PDR_PROMETHEUS_BINARY)"
            )
        self.config_path.write_text(json.dumps(self.config(), indent=2))
        with open(self.data_dir / "prometheus.log", "ab") as log:
            self._process = subprocess.Popen(
                self._command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._wait_ready()

    def stop(self) -> None:
        """Stop Prometheus's process group (SIGTERM, then SIGKILL after a grace period)."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def close(self) -> None:
        """Stop Prometheus and delete its config, log and TSDB."""
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def query(self, expr: str, timeout: float = 5.0) -> dict[str, Any]:
        """``GET /api/v1/query`` at the current time: the parsed answer, errors included (a bad
        expression is a 400 whose body says ``"status": "error"``)."""
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=timeout)
        answer: dict[str, Any] = response.json()
        return answer

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule (``/api/v1/rules``), each with its group's name under ``"group"``."""
        response = httpx.get(f"{self.url}/api/v1/rules", timeout=5.0)
        response.raise_for_status()
        return [
            {**rule, "group": group["name"]}
            for group in response.json()["data"]["groups"]
            for rule in group["rules"]
        ]

    def log_tail(self, lines: int = 20) -> str:
        path = self.data_dir / "prometheus.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> PrometheusServer:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _command(self) -> list[str]:
        return [
            str(self.binary),
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.data_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=warn",
        ]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._ready():
            if self._process is None or self._process.poll() is not None:
                raise RuntimeError(f"prometheus exited during start-up:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"prometheus not ready after {START_TIMEOUT_S}s:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False


def _job_config(job: str, groups: Sequence[ScrapeGroup]) -> dict[str, Any]:
    paths = {group.metrics_path for group in groups}
    if len(paths) != 1:
        raise ValueError(f"scrape job {job!r} mixes metrics paths {sorted(paths)}")
    return {
        "job_name": job,
        "metrics_path": paths.pop(),
        "static_configs": [
            {"targets": list(group.targets), "labels": dict(group.labels)} for group in groups
        ],
    }
