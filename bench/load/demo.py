"""Local PD cluster demo: fake prefill/decode engines on loopback behind a real ``router``.

    python -m bench.load.demo [--engine sglang|vllm-mooncake|vllm-nixl] [--prefill N] [--decode M]
                              [--port 8000] [--once]

Starts every process, waits for the router's ``/ready``, sends one sample request, prints the
URL and a ``curl`` to try, and stops everything on Ctrl-C / SIGTERM (``--once``: right away).
The fake engines stand in for GPU engines until the simulated workers of ``transfer/`` exist.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx

from bench.common.process import free_port
from bench.common.ready import wait_http_ok

__all__ = ["main"]


def _wait_http(url: str, deadline_s: float, what: str) -> None:
    if not wait_http_ok(url, time.monotonic() + deadline_s):
        raise SystemExit(f"demo: {what} did not come up within {deadline_s:.0f}s ({url})")


@contextlib.contextmanager
def _processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _fake(role: str, engine: str, port: int, bootstrap: int | None) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "testkit.fake_engine",
        "--role",
        role,
        "--protocol",
        engine,
        "--port",
        str(port),
        "--token-delay",
        "0.02",
    ]
    return cmd + (["--bootstrap-port", str(bootstrap)] if bootstrap else [])


def _sample(url: str) -> str:
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "Hello!"}],
        "max_tokens": 8,
        "stream": False,
    }
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    response.raise_for_status()
    return json.dumps(response.json()["choices"][0]["message"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench.load.demo", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--engine", default="sglang", choices=["sglang", "vllm-mooncake", "vllm-nixl"]
    )
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--once", action="store_true", help="exit after the sample request")
    args = parser.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with _processes() as procs:
        router_cmd = [
            sys.executable,
            "-m",
            "router",
            "--engine",
            args.engine,
            "--port",
            str(args.port),
            "--health-interval",
            "1",
        ]
        for _ in range(args.prefill):
            port, boot = free_port(), free_port()
            procs.append(subprocess.Popen(_fake("prefill", args.engine, port, boot)))
            router_cmd += ["--prefill", f"http://127.0.0.1:{port}", str(boot)]
        for _ in range(args.decode):
            port = free_port()
            procs.append(subprocess.Popen(_fake("decode", args.engine, port, None)))
            router_cmd += ["--decode", f"http://127.0.0.1:{port}"]
        procs.append(subprocess.Popen(router_cmd))
        url = f"http://127.0.0.1:{args.port}"
        _wait_http(url + "/ready", 30, "the router")
        print(f"\npd-router ({args.engine}, {args.prefill}P{args.decode}D) is ready at {url}")
        print(f"sample answer: {_sample(url)}")
        print(
            f"try: curl -N {url}/v1/chat/completions -H 'content-type: application/json' "
            '-d \'{"model":"fake-model","messages":[{"role":"user","content":'
            '"hi"}],"stream":true}\''
        )
        if args.once:
            return
        print("Ctrl-C to stop.")
        with contextlib.suppress(KeyboardInterrupt):
            while not stop.wait(0.5):
                if any(proc.poll() is not None for proc in procs):
                    raise SystemExit("demo: a process exited unexpectedly")


if __name__ == "__main__":
    main()
