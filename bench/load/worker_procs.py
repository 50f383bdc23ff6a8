"""The processes of ``router --workers N`` as ``/proc`` shows them (Linux): which of them serve
the client port, the CPU time of each, and pinning a process tree to a set of cores.

A serving process is one that holds a listening TCP socket on the client port: its own with
``--worker-sockets reuseport``, the supervisor's inherited one with ``shared``. With N > 1 they
are the supervisor's direct children; with N = 1 the router process itself serves.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

from bench.common.cpu import descendants, process_cpu_seconds, tree_cpu_seconds
from bench.common.process import children

__all__ = [
    "TreeCpu",
    "listening_inodes",
    "pin",
    "pin_tree",
    "processes_cpu",
    "serving_processes",
    "socket_inodes",
    "tree_cpu",
]

_TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
_LISTEN = "0A"  # TCP_LISTEN in the st column of /proc/net/tcp


def listening_inodes(port: int) -> set[int]:
    """The socket inodes listening on TCP ``port`` (any address, IPv4 and IPv6)."""
    found: set[int] = set()
    for table in _TCP_TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if fields[3] == _LISTEN and local_port == port:
                found.add(int(fields[9]))
    return found


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets ``pid`` has open (empty once it is gone)."""
    found: set[int] = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for name in names:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{name}")
            if link.startswith("socket:["):
                found.add(int(link[8:-1]))
    return found


def serving_processes(root: int, port: int, *, supervised: bool) -> list[int]:
    """The pids serving ``port``: ``root``'s direct children that hold a listening socket on
    it when ``supervised`` (N > 1), else ``root`` itself if it holds one; sorted."""
    listening = listening_inodes(port)
    if not supervised:
        return [root] if socket_inodes(root) & listening else []
    return sorted(pid for pid in children(root) if socket_inodes(pid) & listening)


def pin(pid: int, cpus: Collection[int]) -> None:
    """Every thread of ``pid`` to ``cpus`` (what it forks or spawns later inherits it); a
    process or thread that is gone is skipped."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cpus)


def pin_tree(root: int, cpus: Collection[int]) -> None:
    """``root`` and every live descendant to ``cpus``."""
    for pid in (root, *descendants(root)):
        pin(pid, cpus)


class TreeCpu(NamedTuple):
    """CPU seconds at one moment: the whole tree, its root alone, each serving process."""

    tree: float
    root: float
    serving: dict[int, float]


def _cpu_or_zero(pid: int) -> float:
    try:
        return process_cpu_seconds(pid)
    except (OSError, ValueError):
        return 0.0


def processes_cpu(pids: Iterable[int]) -> dict[int, float]:
    """pid -> its own CPU seconds (0.0 for one that is gone)."""
    return {pid: _cpu_or_zero(pid) for pid in pids}


def tree_cpu(root: int, serving: Sequence[int]) -> TreeCpu:
    """The router's CPU now; raises ``OSError`` if ``root`` is gone."""
    return TreeCpu(tree_cpu_seconds(root), process_cpu_seconds(root), processes_cpu(serving))
