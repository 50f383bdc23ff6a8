"""CPU-time accounting of local processes, read from Linux ``/proc``.

A process's CPU time is utime + stime from ``/proc/<pid>/stat``, plus cutime + cstime (children
it has already reaped), plus the same for every live descendant, so a server that forks workers
is charged for all of them. Values are in seconds.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["cpu_delta", "cpu_snapshot", "descendants", "process_cpu_seconds", "tree_cpu_seconds"]

_PROC = Path("/proc")
# Indices into the fields that follow "pid (comm) " in /proc/<pid>/stat (field 3 is index 0).
_PPID = 1
_UTIME = 11
_CSTIME = 14


def _stat_fields(pid: int) -> list[str]:
    """Fields 3.. of ``/proc/<pid>/stat``; raises ``OSError`` if the process is gone."""
    raw = (_PROC / str(pid) / "stat").read_text()
    # comm may contain spaces and parentheses: split after the last ')'.
    return raw[raw.rindex(")") + 2 :].split()


def process_cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime of one process, in seconds."""
    fields = _stat_fields(pid)
    ticks = sum(int(value) for value in fields[_UTIME : _CSTIME + 1])
    return ticks / os.sysconf("SC_CLK_TCK")


def _parent_map() -> dict[int, list[int]]:
    """ppid -> child pids for every process currently visible in /proc."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int(_stat_fields(int(entry.name))[_PPID])
        except (OSError, ValueError, IndexError):
            continue  # the process exited while we were scanning
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (not including ``pid`` itself)."""
    children = _parent_map()
    found: list[int] = []
    frontier = [pid]
    while frontier:
        kids = children.get(frontier.pop(), [])
        found.extend(kids)
        frontier.extend(kids)
    return found


def _safe_cpu(pids: Iterable[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            total += process_cpu_seconds(pid)
        except (OSError, ValueError):
            continue  # exited between listing and reading; its time moved to the parent
    return total


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and all its live descendants; raises ``OSError`` if pid is gone."""
    return process_cpu_seconds(pid) + _safe_cpu(descendants(pid))


def cpu_snapshot(pids: Mapping[str, int]) -> dict[str, float]:
    """name -> tree CPU seconds for each named pid."""
    return {name: tree_cpu_seconds(pid) for name, pid in pids.items()}


def cpu_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Per-name difference ``after - before`` (names missing from either side are dropped)."""
    return {name: after[name] - before[name] for name in before if name in after}
