"""How many router processes ``--workers auto`` means: the CPUs this process may run on (its
affinity mask), capped by its cgroup's CPU quota (``cpu.max``, cgroup v2; ``cpu.cfs_quota_us``
and ``cpu.cfs_period_us``, v1), rounded up, and by ``MAX_WORKERS``."""

from __future__ import annotations

import math
import os
from pathlib import Path

from router.settings.server import MAX_WORKERS

__all__ = ["process_count", "usable_cores"]

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cgroup_quota(root: Path) -> float | None:
    """CPUs the cgroup's quota allows (None: no quota, or none readable)."""
    try:
        text = (root / "cpu.max").read_text().split()
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        if quota > 0 and period > 0:
            return quota / period
    except (OSError, ValueError):
        pass
    return None


def usable_cores(cgroup_root: Path = _CGROUP_ROOT) -> int:
    """The cores this process may use (at least 1)."""
    cores = len(os.sched_getaffinity(0))
    quota = _cgroup_quota(cgroup_root)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def process_count(workers: str, cgroup_root: Path = _CGROUP_ROOT) -> int:
    """``--workers``' value (``auto`` or 1..MAX_WORKERS) as a count of processes."""
    if workers == "auto":
        return min(usable_cores(cgroup_root), MAX_WORKERS)
    return int(workers)
