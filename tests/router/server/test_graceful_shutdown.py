"""SIGTERM on a ``router`` process: streams in flight finish within the grace period; past it
they end with a final SSE error event; the process exits 0 either way."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import msgspec

from router import create_app
from testkit.fake_cluster import settings_for
from testkit.fake_engine import FakeConfig, FakeEngine
from testkit.polling import wait_until
from testkit.servers import free_port, http_process, make_server, run_server, serving

STREAM = {"model": "fake-model", "prompt": "hello", "stream": True}


@dataclass
class Stream:
    """One streamed completion read in a thread: its SSE data events as they come."""

    url: str
    body: dict[str, object]
    events: list[str] = field(default_factory=list)
    ended_at: float | None = None
    failure: BaseException | None = None

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._read, daemon=True)
        thread.start()
        return thread

    def _read(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=30) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.failure = exc
        self.ended_at = time.monotonic()


@contextmanager
def router_process(
    config: FakeConfig, grace_s: float
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A ``router`` process (sglang) in front of fake engines streaming per ``config``."""
    prefill = FakeEngine("prefill", "sglang", config=FakeConfig(check_kv=False))
    decode = FakeEngine("decode", "sglang", config=config)
    with run_server(prefill.app) as p_port, run_server(decode.app) as d_port:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "router", "--engine", "sglang", "--port", str(port)]
        argv += [
            "--prefill",
            f"http://127.0.0.1:{p_port}",
            "--decode",
            f"http://127.0.0.1:{d_port}",
        ]
        argv += ["--health-interval", "0.2", "--shutdown-grace", str(grace_s)]
        with http_process(argv, url, path="/ready", timeout=15) as process:
            yield url, process


def test_streams_in_flight_finish_and_the_router_exits_0() -> None:
    config = FakeConfig(tokens=12, token_delay=0.1, check_kv=False)  # 1.2 s per stream
    with router_process(config, grace_s=20) as (url, process):
        streams = [Stream(url + "/v1/completions", STREAM) for _ in range(2)]
        threads = [s.start() for s in streams]
        wait_until(lambda: all(s.events for s in streams), 10, "both streams under way")
        process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(15)
        output, _ = process.communicate(timeout=15)
    assert process.returncode == 0, output
    for stream in streams:
        assert stream.failure is None, stream.failure
        assert stream.events[-1] == "[DONE]"
        assert not any('"error"' in event for event in stream.events)
    assert "Traceback" not in output


def test_streams_past_the_grace_period_end_with_an_error_event() -> None:
    config = FakeConfig(tokens=200, token_delay=0.05, check_kv=False)  # 10 s per stream
    with router_process(config, grace_s=1) as (url, process):
        stream = Stream(url + "/v1/completions", STREAM)
        thread = stream.start()
        wait_until(lambda: bool(stream.events), 10, "the stream under way")
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        thread.join(15)
        output, _ = process.communicate(timeout=15)
    assert stream.failure is None, stream.failure
    assert stream.ended_at is not None and stream.ended_at - signalled < 4.0
    last = msgspec.json.decode(stream.events[-1])
    assert last["error"]["code"] == 503 and "shutting down" in last["error"]["message"]
    assert "[DONE]" not in stream.events
    assert process.returncode == 0, output
    assert "grace period over: ending 1 request(s)" in output


def test_ready_answers_503_once_shutdown_begins() -> None:
    prefill = FakeEngine("prefill", "sglang", config=FakeConfig(check_kv=False))
    decode = FakeEngine("decode", "sglang", config=FakeConfig(check_kv=False))
    with run_server(prefill.app) as p_port, run_server(decode.app) as d_port:
        app = create_app(
            settings_for(
                "sglang", [(f"http://127.0.0.1:{p_port}", None)], [f"http://127.0.0.1:{d_port}"]
            )
        )
        server = make_server(app, host="127.0.0.1", port=0, lifespan="on")
        with serving([server], 10) as (port,), httpx.Client(timeout=5) as client:
            url = f"http://127.0.0.1:{port}/ready"
            wait_until(lambda: client.get(url).status_code == 200, 10, "the router ready")
            loop = server.servers[0].get_loop()
            loop.call_soon_threadsafe(app.lifecycle.begin_shutdown, 60.0)
            wait_until(lambda: client.get(url).status_code == 503, 5, "/ready to answer 503")
            assert client.get(url).json()["status"] == "shutting_down"
