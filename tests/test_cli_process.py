"""The ``router`` console script as a real process: serves, then stops cleanly on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx

from bench.fake_engine import FakeEngine
from tests.conftest import wait_until
from tests.servers import free_port, run_server
from tests.test_protocols import COMPLETION


def test_router_process_routes_and_exits_on_sigterm() -> None:
    prefill, decode = FakeEngine("prefill", "vllm-mooncake"), FakeEngine("decode", "vllm-mooncake")
    with (
        run_server(prefill.app) as p_port,
        run_server(prefill.bootstrap_app) as b_port,
        run_server(decode.app) as d_port,
    ):
        port = free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "router", "--prefill", f"http://127.0.0.1:{p_port}",
             str(b_port), "--decode", f"http://127.0.0.1:{d_port}", "--engine",
             "vllm-mooncake", "--port", str(port), "--health-interval", "0.2"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        try:
            url = f"http://127.0.0.1:{port}"

            def ready() -> bool:
                try:
                    return httpx.get(url + "/ready", timeout=1).status_code == 200
                except httpx.TransportError:
                    return False

            wait_until(ready, 15, "the router process to become ready")
            response = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=10)
            assert response.status_code == 200, response.text
            process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=15)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
    # uvicorn shuts down gracefully, then re-raises the signal it caught
    assert process.returncode in (0, -signal.SIGTERM), output
    assert "Application shutdown complete" in output
    assert "Traceback" not in output
