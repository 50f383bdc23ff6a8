"""``pd-cluster`` (``python -m worker.cluster``) as a benchmark's child: its command line, started
up to its ready line, its worker layout from the router's ``GET /ready``, its router process,
always stopped (its whole process tree: ``bench.common.process.Child``)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import httpx

from bench.common.process import BenchError, Child, children, cmdline
from bench.common.ready import wait_health

__all__ = [
    "READY",
    "Cluster",
    "cluster_argv",
    "layout",
    "router_pid",
    "router_pids",
    "start_cluster",
    "started_cluster",
]

READY = "pd-cluster ready: "  # then the router's URL


@dataclass(frozen=True)
class Cluster:
    child: Child
    url: str
    prefills: tuple[tuple[str, int], ...]  # (URL, bootstrap port)
    decodes: tuple[str, ...]
    model: str
    router_pids: tuple[int, ...] = ()  # every router child: the replicas, with --router-replicas


def cluster_argv(
    *,
    prefills: int,
    decodes: int,
    port: int,
    engine: str,
    ready_timeout_s: float,
    flags: Sequence[str] = (),
    worker_args: Sequence[str] = (),
) -> list[str]:
    """``python -m worker.cluster`` of that shape, with more of pd-cluster's own ``flags``, and
    ``worker_args`` for every worker (after ``--``)."""
    return [
        sys.executable,
        "-m",
        "worker.cluster",
        "--prefill",
        str(prefills),
        "--decode",
        str(decodes),
        "--port",
        str(port),
        "--engine",
        engine,
        "--ready-timeout",
        str(ready_timeout_s),
        *flags,
        "--",
        *worker_args,
    ]


def start_cluster(argv: Sequence[str], ready_timeout_s: float) -> tuple[Child, str]:
    """pd-cluster started from ``argv`` and its router's URL, once it printed its ready line
    (``ready_timeout_s`` is pd-cluster's own ``--ready-timeout``); stopped if it never does."""
    child = Child(argv, ready_prefix=READY)
    try:
        url = child.wait_ready_line(ready_timeout_s + 10.0).split()[0]
        child.note_descendants()
    except BaseException:
        child.stop()
        raise
    return child, url


def router_pid(cluster_pid: int) -> int | None:
    """The (first) child of pd-cluster's that runs ``python -m router``."""
    pids = router_pids(cluster_pid)
    return pids[0] if pids else None


def router_pids(cluster_pid: int) -> tuple[int, ...]:
    """pd-cluster's children that run ``python -m router`` (one per replica)."""
    return tuple(pid for pid in children(cluster_pid) if cmdline(pid)[1:3] == ["-m", "router"])


def layout(url: str) -> tuple[tuple[tuple[str, int], ...], tuple[str, ...], str]:
    """(prefills as (URL, bootstrap port), decode URLs, the model) from the router at ``url``."""
    with httpx.Client(timeout=5.0) as client:
        ready = client.get(f"{url}/ready").raise_for_status().json()
        models = client.get(f"{url}/v1/models").raise_for_status().json()
    prefills = tuple((str(w["url"]), int(w["bootstrap_port"])) for w in ready["prefill"])
    return prefills, tuple(str(w["url"]) for w in ready["decode"]), str(models["data"][0]["id"])


@contextlib.contextmanager
def started_cluster(
    argv: Sequence[str], ready_timeout_s: float, *, every_worker: bool = False
) -> Iterator[Cluster]:
    """pd-cluster started from ``argv``, serving (``every_worker``: each worker's ``/health``
    answers too, where ``/ready`` needs one of each role); stopped on the way out."""
    child, url = start_cluster(argv, ready_timeout_s)
    with child:
        try:
            prefills, decodes, model = layout(url)
        except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
            raise BenchError(child.describe(f"no worker layout from /ready: {exc}")) from exc
        if every_worker:
            for worker in [*(prefill for prefill, _port in prefills), *decodes]:
                wait_health(child, worker, ready_timeout_s)
        yield Cluster(child, url, prefills, decodes, model, router_pids(child.pid))
