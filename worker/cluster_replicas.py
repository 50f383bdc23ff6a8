"""``pd-cluster --router-replicas N``: N router replicas behind a real L4 balancer (HAProxy,
round robin per connection, Debian's ``haproxy``) on the cluster's port, sharing their routing
state (``router --replica-listen``; ``--no-replica-sync``: each on its own counts, to measure
what the sharing prevents).

Replica 0 is the one the prefills register with (its bootstrap namespace ports); the others are
given each prefill's namespace port as its bootstrap port, so their decoders reach the same
registered ranks, and they follow the same KV event streams.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "ReplicaLayout",
    "add_replica_args",
    "haproxy_argv",
    "haproxy_config",
    "servers_up",
    "sync_args",
]

HAPROXY = "haproxy"


def add_replica_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--router-replicas",
        type=int,
        default=1,
        metavar="N",
        help="router replicas behind HAProxy (round robin) on --port, sharing their routing "
        "state (needs the haproxy command)",
    )
    parser.add_argument(
        "--no-replica-sync",
        dest="replica_sync",
        action="store_false",
        help="with --router-replicas: each replica routes on its own counts",
    )


@dataclass
class ReplicaLayout:
    """Each replica's client port and sync port, and the replicas' shared token."""

    ports: list[int]
    sync_ports: list[int]
    token: str = field(default_factory=lambda: secrets.token_hex(16))

    @property
    def count(self) -> int:
        return len(self.ports)


def sync_args(layout: ReplicaLayout, index: int, enabled: bool) -> list[str]:
    """Replica ``index``'s flags of the sync (none when it is off)."""
    if not enabled:
        return []
    out = ["--replica-id", f"r{index}", "--replica-token", layout.token]
    out += ["--replica-listen", f"127.0.0.1:{layout.sync_ports[index]}"]
    for other, port in enumerate(layout.sync_ports):
        if other != index:
            out += ["--replica-peer", f"127.0.0.1:{port}"]
    return out


def haproxy_config(port: int, router_ports: list[int], stats_socket: Path) -> str:
    """Round robin over the replicas per connection (L4), each checked every second with its
    ``/ready`` (a replica that starts again gets connections only once it can route, as a
    Kubernetes readiness probe does it); a connection a dead replica refuses goes to another
    (``redispatch``), so only the requests it was serving fail with it."""
    servers = "".join(
        f"  server r{i} 127.0.0.1:{p} check inter 500ms rise 1 fall 2\n"
        for i, p in enumerate(router_ports)
    )
    return (
        f"global\n  maxconn 4096\n  stats socket {stats_socket} mode 600 level user\n"
        "defaults\n  mode tcp\n  timeout connect 5s\n  timeout client 1h\n  timeout server 1h\n"
        "  retries 3\n  option redispatch\n"
        f"frontend routers\n  bind 127.0.0.1:{port}\n  default_backend replicas\n"
        "backend replicas\n  balance roundrobin\n"
        "  option httpchk GET /ready\n  http-check expect status 200\n"
        f"{servers}"
    )


def servers_up(stats_socket: Path) -> int:
    """How many replicas HAProxy sends connections to now (its stats socket's ``show stat``);
    0 when it does not answer yet."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2)
            sock.connect(str(stats_socket))
            sock.sendall(b"show stat\n")
            data = b"".join(iter(lambda: sock.recv(65536), b""))
    except OSError:
        return 0
    lines = data.decode(errors="replace").splitlines()
    if not lines or not lines[0].startswith("# "):
        return 0
    header = lines[0][2:].split(",")
    rows = [dict(zip(header, line.split(","), strict=False)) for line in lines[1:] if line]
    return sum(
        1
        for row in rows
        if row.get("pxname") == "replicas"
        and row.get("svname", "").startswith("r")
        and row.get("status") == "UP"
    )


def haproxy_argv(config: Path) -> list[str]:
    """HAProxy in the foreground on ``config``; SystemExit when it is not installed."""
    found = shutil.which(HAPROXY) or shutil.which(HAPROXY, path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise SystemExit(
            "pd-cluster: --router-replicas needs haproxy (Debian: apt-get install haproxy)"
        )
    return [found, "-db", "-f", str(config)]
