"""``pd-cluster``: the router (with its embedded registry) and N prefill + M decode workers.

Each prefill registers its ranks (``--dp`` of them) with the router's registry under its own
namespace, served on a namespace port (``--bootstrap-namespace pI=PORT``): SGLang's ``PUT /route``
(the port is the ``bootstrap_port`` decoders get) or, with ``--engine vllm-mooncake``, vLLM's
``POST /register`` (decoders get ``http://127.0.0.1:PORT`` as ``remote_bootstrap_addr``).
Everything runs on 127.0.0.1 as child processes in one process group per child; Ctrl-C/SIGTERM
stops them all (SIGTERM, then SIGKILL after a grace period), and so does any child exiting, unless
``--restart-workers`` (soak tests) starts an exited worker again on its ports.

Every prefill publishes KV cache events (unless ``--no-kv-events``): prefill ``i`` gets a free
event port and replay port for its rank 0 (rank ``r`` uses port + ``r``, all checked free), its
``--kv-events-config`` says so, and the router's ``--prefill URL ns:pI events=... replay=...``
names them. ``--policy``/``--prefill-policy``/``--decode-policy`` and ``--tokenizer`` go to the
router (``--tokenizer`` to every worker too); any other router flag goes through one
``--router-arg=FLAG`` each (e.g. ``--router-arg=--load-interval --router-arg=0.5``); worker flags
go after ``--``.

``--hicache-storage-dir DIR`` (given to pd-cluster, or among the worker flags after ``--``) gives
each worker its own L3 directory, ``DIR/prefill-<i>`` and ``DIR/decode-<j>``: the same on every
start, so a restarted cluster serves what its workers stored before (the workers also need
``--hicache-host-pages`` and ``--hicache-storage-backend file`` after ``--``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
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
_POLICIES = ["round_robin", "least_load", "power_of_two", "cache_aware"]
_PORT_TRIES = 50


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((_HOST, 0))
        return int(sock.getsockname()[1])


def _free_run(count: int, taken: set[int]) -> int:
    """A port P with P .. P+count-1 all free now (and none in ``taken``); adds them to it."""
    for _ in range(_PORT_TRIES):
        base = _free_port()
        run = set(range(base, base + count))
        if run & taken or base + count > 65536:
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in sorted(run):
                    sock = stack.enter_context(socket.socket())
                    sock.bind((_HOST, port))
            except OSError:
                continue
        taken |= run
        return base
    raise SystemExit(f"pd-cluster: no run of {count} free ports after {_PORT_TRIES} tries")


def _kv_events_config(events: int, replay: int) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://{_HOST}:{events}",
            "replay_endpoint": f"tcp://{_HOST}:{replay}",
        }
    )


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
    parser.add_argument("--policy", choices=_POLICIES, help="router policy for both roles")
    parser.add_argument("--prefill-policy", choices=_POLICIES, help="router policy for prefill")
    parser.add_argument("--decode-policy", choices=_POLICIES, help="router policy for decode")
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="Hugging Face tokenizer directory for every worker and the router",
    )
    parser.add_argument(
        "--no-kv-events",
        dest="kv_events",
        action="store_false",
        help="prefills publish no KV cache events (default: they do, to the router)",
    )
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more router argument, written --router-arg=ARG (repeat; e.g. "
        "--router-arg=--load-interval --router-arg=0.5)",
    )
    parser.add_argument(
        "--restart-workers",
        action="store_true",
        help="start a worker that exited again, same command and ports (soak tests; default: "
        "any child exiting stops the cluster)",
    )
    parser.add_argument(
        "--hicache-storage-dir",
        metavar="DIR",
        help="L3 root: worker flag --hicache-storage-dir DIR/prefill-<i> or DIR/decode-<j>, "
        "stable across restarts",
    )
    parser.add_argument(
        "worker_args",
        nargs=argparse.REMAINDER,
        help="after --: extra pd-worker arguments (e.g. --pages 512)",
    )
    args = parser.parse_args(argv)
    args.worker_args, root = _take_storage_dir(args.worker_args)
    if root is not None:
        if args.hicache_storage_dir not in (None, root):
            parser.error("--hicache-storage-dir given twice, with different directories")
        args.hicache_storage_dir = root
    return args


_STORAGE_DIR = "--hicache-storage-dir"


def _take_storage_dir(worker_args: list[str]) -> tuple[list[str], str | None]:
    """``worker_args`` without ``--hicache-storage-dir DIR`` (or ``=DIR``), and that DIR."""
    rest: list[str] = []
    root = None
    items = iter(worker_args)
    for item in items:
        if item == _STORAGE_DIR:
            root = next(items, None)
        elif item.startswith(_STORAGE_DIR + "="):
            root = item.split("=", 1)[1]
        else:
            rest.append(item)
    return rest, root


class _Children:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str]) -> None:
        self.procs.append(subprocess.Popen([sys.executable, "-m", *args], start_new_session=True))

    def dead(self) -> subprocess.Popen[bytes] | None:
        return next((p for p in self.procs if p.poll() is not None), None)

    def restart(self, proc: subprocess.Popen[bytes]) -> None:
        """Start the exited ``proc``'s command again in its place."""
        self.procs[self.procs.index(proc)] = subprocess.Popen(proc.args, start_new_session=True)

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


class _Layout:
    """Ports of one cluster: router, prefills (HTTP, namespace, KV events), decodes."""

    def __init__(self, args: argparse.Namespace) -> None:
        taken: set[int] = {args.port}
        self.prefills = [_free_run(1, taken) for _ in range(args.prefill)]
        self.namespaces = [_free_run(1, taken) for _ in range(args.prefill)]
        self.decodes = [_free_run(1, taken) for _ in range(args.decode)]
        self.events: list[tuple[int, int] | None] = [
            (_free_run(args.dp, taken), _free_run(args.dp, taken)) if args.kv_events else None
            for _ in self.prefills
        ]


def _router_args(args: argparse.Namespace, layout: _Layout) -> list[str]:
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
    for flag in ("policy", "prefill_policy", "decode_policy", "tokenizer"):
        if getattr(args, flag) is not None:
            out += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    rows = zip(layout.prefills, layout.namespaces, layout.events, strict=True)
    for i, (port, ns_port, events) in enumerate(rows):
        out += ["--bootstrap-namespace", f"p{i}={ns_port}"]
        out += ["--prefill", f"http://{_HOST}:{port}", f"ns:p{i}"]
        if events is not None:
            out += [f"events=tcp://{_HOST}:{events[0]}", f"replay=tcp://{_HOST}:{events[1]}"]
    for port in layout.decodes:
        out += ["--decode", f"http://{_HOST}:{port}"]
    return out + list(args.router_arg)


def _worker_args(args: argparse.Namespace, name: str) -> list[str]:
    """Flags every worker gets: the protocol, the tokenizer, its L3 directory (``name``: its
    subdirectory), then the user's after ``--``."""
    out = ["--protocol", args.engine]
    if args.tokenizer is not None:
        out += ["--tokenizer", args.tokenizer]
    if args.hicache_storage_dir is not None:
        out += [_STORAGE_DIR, os.path.join(args.hicache_storage_dir, name)]
    return out + [a for a in args.worker_args if a != "--"]


def _prefill_args(
    args: argparse.Namespace,
    port: int,
    ns_port: int,
    events: tuple[int, int] | None,
    index: int = 0,
) -> list[str]:
    out = ["worker", "--role", "prefill", "--port", str(port)]
    out += ["--registry", f"{_HOST}:{ns_port}", "--dp", str(args.dp)]
    if events is not None:
        out += ["--kv-events-config", _kv_events_config(*events)]
    return out + _worker_args(args, f"prefill-{index}")


def _decode_args(args: argparse.Namespace, port: int, index: int) -> list[str]:
    out = ["worker", "--role", "decode", "--port", str(port)]
    return out + _worker_args(args, f"decode-{index}")


@contextlib.contextmanager
def _terminating() -> Iterator[None]:
    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _supervise(children: _Children, restart_workers: bool) -> None:
    """Return when a child exits; with ``restart_workers``, a worker (any child but the router,
    the first) is started again instead, at most once a second."""
    while True:
        time.sleep(0.5)
        dead = children.dead()
        if dead is None:
            continue
        if not restart_workers or dead is children.procs[0]:
            return
        print(f"pd-cluster: {dead.args!r} exited with {dead.returncode}; restarting", flush=True)
        time.sleep(0.5)
        children.restart(dead)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    if min(args.prefill, args.decode, args.dp) < 1:
        raise SystemExit("pd-cluster: --prefill, --decode and --dp must be >= 1")
    layout = _Layout(args)
    children = _Children()
    router = f"http://{_HOST}:{args.port}"
    with _terminating():
        try:
            children.start(_router_args(args, layout))
            _wait(f"{router}/health", children, args.ready_timeout)
            rows = zip(layout.prefills, layout.namespaces, layout.events, strict=True)
            for index, (port, ns_port, events) in enumerate(rows):
                children.start(_prefill_args(args, port, ns_port, events, index))
            for index, port in enumerate(layout.decodes):
                children.start(_decode_args(args, port, index))
            _wait(f"{router}/ready", children, args.ready_timeout)
            dp = f", DP={args.dp}" if args.dp > 1 else ""
            print(f"pd-cluster ready: {router}  ({args.prefill}P{args.decode}D{dp}, {args.engine})")
            print(
                f"  curl {router}/v1/completions -H 'Content-Type: application/json' "
                '-d \'{"model": "sim-model", "prompt": "Hello", "max_tokens": 16}\'',
                flush=True,
            )
            _supervise(children, args.restart_workers)
            print("pd-cluster: a child exited; stopping", file=sys.stderr)
        except KeyboardInterrupt:
            pass
        finally:
            children.stop()


if __name__ == "__main__":
    main()
