"""``pd-cluster``: the router (with its embedded registry) and N prefill + M decode workers.

Each prefill registers its ranks (``--dp`` of them) with the router's registry under its own
namespace, served on a namespace port (``--bootstrap-namespace pI=PORT``): SGLang's ``PUT /route``
(the port is the ``bootstrap_port`` decoders get) or, with ``--engine vllm-mooncake``, vLLM's
``POST /register`` (decoders get ``http://127.0.0.1:PORT`` as ``remote_bootstrap_addr``).
Everything runs on 127.0.0.1 as child processes in one process group per child; Ctrl-C/SIGTERM
stops them all (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import httpx

__all__ = ["main"]

_HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((_HOST, 0))
        return int(sock.getsockname()[1])


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pd-cluster", description="local PD cluster")
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--port", type=int, default=8000, help="router port")
    parser.add_argument("--dp", type=int, default=1, help="DP ranks per prefill")
    parser.add_argument(
        "--engine",
        choices=["sglang", "vllm-mooncake"],
        default="sglang",
        help="PD protocol the router and the workers speak",
    )
    parser.add_argument("--ready-timeout", type=float, default=60.0)
    parser.add_argument(
        "worker_args",
        nargs=argparse.REMAINDER,
        help="after --: extra pd-worker arguments (e.g. --pages 512)",
    )
    return parser.parse_args(argv)


class _Children:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str]) -> None:
        self.procs.append(subprocess.Popen([sys.executable, "-m", *args], start_new_session=True))

    def dead(self) -> subprocess.Popen[bytes] | None:
        return next((p for p in self.procs if p.poll() is not None), None)

    def stop(self, grace_s: float = 5.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _wait(url: str, children: _Children, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = children.dead()
        if dead is not None:
            raise SystemExit(f"pd-cluster: {dead.args!r} exited with {dead.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        time.sleep(0.2)
    raise SystemExit(f"pd-cluster: {url} not ready after {timeout:g} s")


def _router_args(
    args: argparse.Namespace, prefills: list[int], namespaces: list[int], decodes: list[int]
) -> list[str]:
    out = [
        "router",
        "--engine",
        args.engine,
        "--host",
        _HOST,
        "--port",
        str(args.port),
        "--advertise-host",
        _HOST,
    ]
    for i, (port, ns_port) in enumerate(zip(prefills, namespaces, strict=True)):
        out += [
            "--bootstrap-namespace",
            f"p{i}={ns_port}",
            "--prefill",
            f"http://{_HOST}:{port}",
            f"ns:p{i}",
        ]
    for port in decodes:
        out += ["--decode", f"http://{_HOST}:{port}"]
    return out


@contextlib.contextmanager
def _terminating() -> Iterator[None]:
    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    if min(args.prefill, args.decode, args.dp) < 1:
        raise SystemExit("pd-cluster: --prefill, --decode and --dp must be >= 1")
    extra = [a for a in args.worker_args if a != "--"]
    prefills = [_free_port() for _ in range(args.prefill)]
    namespaces = [_free_port() for _ in range(args.prefill)]
    decodes = [_free_port() for _ in range(args.decode)]
    children = _Children()
    router = f"http://{_HOST}:{args.port}"
    with _terminating():
        try:
            children.start(_router_args(args, prefills, namespaces, decodes))
            _wait(f"{router}/health", children, args.ready_timeout)
            for port, ns_port in zip(prefills, namespaces, strict=True):
                children.start(
                    [
                        "worker",
                        "--role",
                        "prefill",
                        "--port",
                        str(port),
                        "--registry",
                        f"{_HOST}:{ns_port}",
                        "--protocol",
                        args.engine,
                        "--dp",
                        str(args.dp),
                        *extra,
                    ]
                )
            for port in decodes:
                children.start(["worker", "--role", "decode", "--port", str(port), *extra])
            _wait(f"{router}/ready", children, args.ready_timeout)
            dp = f", DP={args.dp}" if args.dp > 1 else ""
            print(f"pd-cluster ready: {router}  ({args.prefill}P{args.decode}D{dp}, {args.engine})")
            print(
                f"  curl {router}/v1/completions -H 'Content-Type: application/json' "
                '-d \'{"model": "sim-model", "prompt": "Hello", "max_tokens": 16}\'',
                flush=True,
            )
            while children.dead() is None:
                time.sleep(0.5)
            print("pd-cluster: a child exited; stopping", file=sys.stderr)
        except KeyboardInterrupt:
            pass
        finally:
            children.stop()


if __name__ == "__main__":
    main()
