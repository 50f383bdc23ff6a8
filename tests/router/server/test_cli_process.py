"""The ``router`` console script as a real process: serves, then stops cleanly on SIGTERM."""

from __future__ import annotations

import signal
import sys

import httpx

from testkit.fake_engine import FakeEngine
from testkit.servers import free_port, http_process, run_server
from tests.router.pipeline.test_protocols import COMPLETION


def test_router_process_routes_and_exits_on_sigterm() -> None:
    prefill, decode = FakeEngine("prefill", "vllm-mooncake"), FakeEngine("decode", "vllm-mooncake")
    with (
        run_server(prefill.app) as p_port,
        run_server(prefill.bootstrap_app) as b_port,
        run_server(decode.app) as d_port,
    ):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [
            sys.executable,
            "-m",
            "router",
            "--prefill",
            f"http://127.0.0.1:{p_port}",
            str(b_port),
            "--decode",
            f"http://127.0.0.1:{d_port}",
            "--engine",
            "vllm-mooncake",
            "--port",
            str(port),
            "--health-interval",
            "0.2",
        ]
        with http_process(argv, url, path="/ready", timeout=15) as process:
            response = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=10)
            assert response.status_code == 200, response.text
            process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=15)
    assert process.returncode == 0, output  # a graceful stop is a clean exit
    assert "Application shutdown complete" in output
    assert "Traceback" not in output
