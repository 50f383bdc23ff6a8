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

The console shows the router's log and pd-cluster's own lines (the ready line and a sample curl,
the worker log directory). Each worker's stdout and stderr, its transfer engine's native log lines
(Mooncake's glog) included, go to ``<log dir>/prefill-<i>.log`` / ``decode-<j>.log`` (``--log-dir``;
default: a new ``pd-cluster-*`` directory under the system's temp directory, kept after exit); a
worker that exits says so on the console with its log's path and last lines.

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
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from worker.children import Children, supervise, terminating, wait_ready
from worker.cluster_replicas import (
    ReplicaLayout,
    add_replica_args,
    haproxy_argv,
    haproxy_config,
    servers_up,
    sync_args,
)

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
    _add_cluster_args(parser)
    _add_passed_on_args(parser)
    args = parser.parse_args(argv)
    args.worker_args, root = _take_storage_dir(args.worker_args)
    if root is not None:
        if args.hicache_storage_dir not in (None, root):
            parser.error("--hicache-storage-dir given twice, with different directories")
        args.hicache_storage_dir = root
    return args


def _add_cluster_args(parser: argparse.ArgumentParser) -> None:
    """The cluster's shape, ports, protocol and start-up."""
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--port", type=int, default=8000, help="router port")
    parser.add_argument(
        "--router-workers",
        default="1",
        metavar="N|auto",
        help="router processes serving the router port (the router's --workers)",
    )
    add_replica_args(parser)
    parser.add_argument("--dp", type=int, default=1, help="DP ranks per prefill")
    parser.add_argument(
        "--engine",
        choices=["sglang", "vllm-mooncake"],
        default="sglang",
        help="PD protocol the router and the workers speak",
    )
    parser.add_argument("--ready-timeout", type=float, default=60.0)
    parser.add_argument(
        "--models",
        type=lambda text: [name for name in text.split(",") if name],
        default=[],
        metavar="A,B",
        help="serve several models: worker i of each role serves model i mod M (needs at least "
        "M prefills and M decodes); the router routes each request to its model's workers",
    )


def _add_passed_on_args(parser: argparse.ArgumentParser) -> None:
    """What goes on to the router and the workers, and where the workers log."""
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
        "--log-dir",
        metavar="DIR",
        help="worker logs (stdout and stderr, the transfer engine's native lines included): "
        "DIR/prefill-<i>.log, DIR/decode-<j>.log (default: a new temporary directory)",
    )
    parser.add_argument(
        "worker_args",
        nargs=argparse.REMAINDER,
        help="after --: extra pd-worker arguments (e.g. --pages 512)",
    )


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


class _Layout:
    """Ports of one cluster: router, prefills (HTTP, namespace, KV events), decodes."""

    def __init__(self, args: argparse.Namespace) -> None:
        taken: set[int] = {args.port}
        self.prefills = [_free_run(1, taken) for _ in range(args.prefill)]
        self.namespaces = [_free_run(1, taken) for _ in range(args.prefill)]
        self.decodes = [_free_run(1, taken) for _ in range(args.decode)]
        self.replicas: ReplicaLayout | None = None
        if args.router_replicas > 1:
            ports = [_free_run(1, taken) for _ in range(args.router_replicas)]
            sync = [_free_run(1, taken) for _ in range(args.router_replicas)]
            self.replicas = ReplicaLayout(ports, sync)
        self.events: list[tuple[int, int] | None] = [
            (_free_run(args.dp, taken), _free_run(args.dp, taken)) if args.kv_events else None
            for _ in self.prefills
        ]


def _router_args(
    args: argparse.Namespace, layout: _Layout, port: int, replica: int = 0
) -> list[str]:
    """A router's command: replica 0 (or the only router) serves the prefills' bootstrap
    namespaces; another replica is given each namespace's port as the prefill's bootstrap port
    (the same ranks, registered with replica 0)."""
    out = ["router", "--engine", args.engine, "--host", _HOST, "--port", str(port)]
    out += ["--advertise-host", _HOST, "--workers", args.router_workers]
    for flag in ("policy", "prefill_policy", "decode_policy", "tokenizer"):
        if getattr(args, flag) is not None:
            out += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    if layout.replicas is not None:
        out += sync_args(layout.replicas, replica, args.replica_sync)
    rows = zip(layout.prefills, layout.namespaces, layout.events, strict=True)
    for i, (prefill, ns_port, events) in enumerate(rows):
        if replica == 0:
            out += ["--bootstrap-namespace", f"p{i}={ns_port}"]
            out += ["--prefill", f"http://{_HOST}:{prefill}", f"ns:p{i}"]
        else:
            out += ["--prefill", f"http://{_HOST}:{prefill}", str(ns_port)]
        if events is not None:
            out += [f"events=tcp://{_HOST}:{events[0]}", f"replay=tcp://{_HOST}:{events[1]}"]
        out += _model_spec(args, i)
    for i, port in enumerate(layout.decodes):
        out += ["--decode", f"http://{_HOST}:{port}", *_model_spec(args, i)]
    return out + list(args.router_arg)


def _model_of(args: argparse.Namespace, index: int) -> str | None:
    """The model worker ``index`` of its role serves (``--models``), None: the worker's own."""
    return args.models[index % len(args.models)] if args.models else None


def _model_spec(args: argparse.Namespace, index: int) -> list[str]:
    model = _model_of(args, index)
    return [] if model is None else [f"model={model}"]


def _worker_args(args: argparse.Namespace, name: str, index: int) -> list[str]:
    """Flags every worker gets: the protocol, its model (``--models``), the tokenizer, its L3
    directory (``name``: its subdirectory), then the user's after ``--``."""
    out = ["--protocol", args.engine]
    model = _model_of(args, index)
    if model is not None:
        out += ["--model", model]
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
    return out + _worker_args(args, f"prefill-{index}", index)


def _decode_args(args: argparse.Namespace, port: int, index: int) -> list[str]:
    out = ["worker", "--role", "decode", "--port", str(port)]
    return out + _worker_args(args, f"decode-{index}", index)


def _log_dir(args: argparse.Namespace) -> Path:
    """The workers' log directory (``--log-dir``, created; default: a new temporary one)."""
    if args.log_dir is None:
        return Path(tempfile.mkdtemp(prefix="pd-cluster-"))
    path = Path(args.log_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _start(
    args: argparse.Namespace, layout: _Layout, children: Children, router: str, logs: Path
) -> None:
    """The router (or the replicas and HAProxy), then (once it answers) the workers, each
    logging to its file in ``logs``."""
    routers = _start_routers(args, layout, children, router, logs)
    rows = zip(layout.prefills, layout.namespaces, layout.events, strict=True)
    for index, (port, ns_port, events) in enumerate(rows):
        name = f"prefill-{index}"
        children.start(
            name, _prefill_args(args, port, ns_port, events, index), logs / f"{name}.log"
        )
    for index, port in enumerate(layout.decodes):
        name = f"decode-{index}"
        children.start(name, _decode_args(args, port, index), logs / f"{name}.log")
    processes = int(args.router_workers) if args.router_workers.isdigit() else 0  # 0: auto
    for url in routers:
        wait_ready(f"{url}/ready", children, args.ready_timeout, processes)
    if layout.replicas is not None:  # ready: every replica behind the balancer
        _wait_balanced(logs / "haproxy.sock", layout.replicas.count, children, args.ready_timeout)
    dp = f", DP={args.dp}" if args.dp > 1 else ""
    print(f"pd-cluster ready: {router}  ({args.prefill}P{args.decode}D{dp}, {args.engine})")
    model = _model_of(args, 0) or "sim-model"
    print(
        f"  curl {router}/v1/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{model}", "prompt": "Hello", "max_tokens": 16}}\''
    )
    print(f"  worker logs: {logs}", flush=True)


def _wait_balanced(socket_path: Path, count: int, children: Children, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while servers_up(socket_path) < count:
        dead = children.dead()
        if dead is not None:
            raise SystemExit(f"pd-cluster: {children.exited(dead)}")
        if time.monotonic() > deadline:
            raise SystemExit(f"pd-cluster: HAProxy did not see {count} replicas ready in time")
        time.sleep(0.1)


def _start_routers(
    args: argparse.Namespace, layout: _Layout, children: Children, router: str, logs: Path
) -> list[str]:
    """The router, or the replicas (replica 0 on the console, the others logging to
    ``router-<i>.log``) and HAProxy in front of them; the URLs to wait for, ``router`` last."""
    replicas = layout.replicas
    if replicas is None:
        children.start("router", _router_args(args, layout, args.port))
        wait_ready(f"{router}/health", children, args.ready_timeout)
        return [router]
    urls = []
    for index, port in enumerate(replicas.ports):
        log = None if index == 0 else logs / f"router-{index}.log"
        children.start(f"router-{index}", _router_args(args, layout, port, index), log)
        urls.append(f"http://{_HOST}:{port}")
    for url in urls:
        wait_ready(f"{url}/health", children, args.ready_timeout)
    config = logs / "haproxy.cfg"
    config.write_text(haproxy_config(args.port, replicas.ports, logs / "haproxy.sock"))
    children.start_command("haproxy", haproxy_argv(config), logs / "haproxy.log")
    return [*urls, router]


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    if min(args.prefill, args.decode, args.dp, args.router_replicas) < 1:
        raise SystemExit("pd-cluster: --prefill, --decode, --dp and --router-replicas must be >= 1")
    if len(args.models) > min(args.prefill, args.decode):
        raise SystemExit("pd-cluster: --models needs at least one prefill and one decode each")
    layout = _Layout(args)
    children = Children()
    logs = _log_dir(args)
    with terminating():
        try:
            _start(args, layout, children, f"http://{_HOST}:{args.port}", logs)
            dead = supervise(children, args.restart_workers)
            print(f"pd-cluster: {children.exited(dead)}\npd-cluster: stopping", file=sys.stderr)
        except KeyboardInterrupt:
            pass
        else:
            return  # a worker died: its log (printed above) stays
        finally:
            children.stop()
    if args.log_dir is None:  # a clean stop: nobody needs the temporary logs
        shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
    main()
