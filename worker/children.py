"""``pd-cluster``'s child processes: start them (a worker's output to its log file), wait for the
router to answer, supervise them (stop, or restart an exited worker), stop them.

Each child runs in its own session (process group); ``Children.stop`` sends SIGTERM to every group,
then SIGKILL after a grace period. A child that exits is reported by name, with its log's path and
last lines when it has one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = ["Child", "Children", "supervise", "terminating", "wait_ready"]

_LOG_TAIL_LINES = 10


@dataclass(frozen=True, slots=True)
class Child:
    """What a child runs: its name (``router``, ``prefill-0``...), command and log (None: the
    console)."""

    name: str
    argv: list[str]
    log: Path | None


class Children:
    """The child processes, the router first; a worker's output goes to its log file."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self._what: dict[int, Child] = {}  # pid -> what it runs

    def start(self, name: str, args: list[str], log: Path | None = None) -> None:
        """Start ``python -m ARGS`` as ``name``, its output to ``log`` (None: the console)."""
        self.start_command(name, [sys.executable, "-m", *args], log)

    def start_command(self, name: str, argv: list[str], log: Path | None = None) -> None:
        """Start ``argv`` (a program of its own: HAProxy) as ``name``."""
        self.procs.append(self._spawn(Child(name, argv, log)))

    def _spawn(self, child: Child) -> subprocess.Popen[bytes]:
        if child.log is None:
            proc = subprocess.Popen(child.argv, start_new_session=True)
        else:
            with child.log.open("ab") as out:
                proc = subprocess.Popen(
                    child.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
        self._what[proc.pid] = child
        return proc

    def dead(self) -> subprocess.Popen[bytes] | None:
        return next((p for p in self.procs if p.poll() is not None), None)

    def restart(self, proc: subprocess.Popen[bytes]) -> None:
        """Start the exited ``proc``'s command again in its place (its log appended to)."""
        self.procs[self.procs.index(proc)] = self._spawn(self._what[proc.pid])

    def exited(self, proc: subprocess.Popen[bytes]) -> str:
        """``NAME exited with CODE``; for a worker, where its log is and its last lines."""
        child = self._what[proc.pid]
        said = f"{child.name} exited with {proc.returncode}"
        if child.log is None:
            return said
        said += f"; its log: {child.log}"
        with contextlib.suppress(OSError), child.log.open("rb") as log:
            tail = b"".join(deque(log, _LOG_TAIL_LINES)).decode(errors="replace").rstrip()
            said += "".join(f"\n  | {line}" for line in tail.splitlines())
        return said

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


def wait_ready(url: str, children: Children, timeout: float, processes: int = 1) -> None:
    """Until ``url`` answers 200; with ``processes`` > 1 (``router --workers N``, ``url`` its
    ``/ready``) until each of them can route, as ``/status/data`` says: ``/ready`` answers for
    the one process its connection reached (0: however many answer)."""
    deadline = time.monotonic() + timeout
    base = url.removesuffix("/ready")
    while time.monotonic() < deadline:
        dead = children.dead()
        if dead is not None:
            raise SystemExit(f"pd-cluster: {children.exited(dead)}")
        with contextlib.suppress(httpx.HTTPError, ValueError, TypeError, AttributeError):
            if httpx.get(url, timeout=1.0).status_code == 200 and (
                processes == 1 or _every_process_ready(base, processes)
            ):
                return
        time.sleep(0.2)
    raise SystemExit(f"pd-cluster: {url} not ready after {timeout:g} s")


def _every_process_ready(base: str, processes: int) -> bool:
    found = httpx.get(f"{base}/status/data", timeout=2.0).json()["processes"] or []
    return len(found) >= max(processes, 1) and all(p["ready"] for p in found)


@contextlib.contextmanager
def terminating() -> Iterator[None]:
    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def supervise(children: Children, restart_workers: bool) -> subprocess.Popen[bytes]:
    """Return the first child to exit; with ``restart_workers``, a worker (any child but the
    router, the first) is started again instead, at most once a second."""
    while True:
        time.sleep(0.5)
        dead = children.dead()
        if dead is None:
            continue
        if not restart_workers or dead is children.procs[0]:
            return dead
        print(f"pd-cluster: {children.exited(dead)}\npd-cluster: restarting it", flush=True)
        time.sleep(0.5)
        children.restart(dead)
