"""Child processes of a benchmark: start a command with a log, find what it started, stop it all.

``Child`` runs a command from the repository root in a session of its own (so its whole process
group can be signalled), stdin closed. Its output (stdout and stderr together) goes either to a
log file or, without one, through a pipe that a thread drains, keeping the last lines and watching
for a ready line. ``stop`` leaves nothing behind: SIGTERM to the group, SIGKILL after a grace
period, then SIGKILL to whatever the group and every descendant seen still hold (a pid is only
killed while its start time still matches, never a reused one).

The ``/proc`` readers (Linux): ``children``, ``cmdline``, ``start_time``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import signal
import socket
import subprocess
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self

__all__ = [
    "LOOPBACK",
    "REPO_ROOT",
    "BenchError",
    "Child",
    "children",
    "cmdline",
    "free_port",
    "free_ports",
    "set_parent_death_signal",
    "start_time",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"
TAIL_LINES = 40  # of a child's output kept in memory (and shown when it fails)
_PR_SET_PDEATHSIG = 1


class BenchError(Exception):
    """The benchmark could not run: a child did not start, exited, or a server did not answer."""


# --- ports -------------------------------------------------------------------------------------


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (all held open until all are chosen)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind((LOOPBACK, 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def free_port() -> int:
    """One free loopback port."""
    return free_ports(1)[0]


# --- /proc -------------------------------------------------------------------------------------


def start_time(pid: int) -> str | None:
    """``pid``'s start time (``/proc/PID/stat`` field 22), None once it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def children(pid: int) -> list[int]:
    """``pid``'s child processes (``/proc/PID/task/TID/children`` of every thread)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as listing:
                found += [int(child) for child in listing.read().split()]
    return found


def cmdline(pid: int) -> list[str]:
    """``pid``'s command line, [] once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as raw:
            return raw.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _live_descendants(pid: int) -> dict[int, str]:
    """``pid``'s live descendants and their start times."""
    found: dict[int, str] = {}
    for child in children(pid):
        started = start_time(child)
        if started is not None:
            found[child] = started
            found.update(_live_descendants(child))
    return found


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _kill_if_same(pid: int, started: str) -> None:
    """SIGKILL ``pid``'s process group and ``pid`` if it is still the process seen earlier."""
    if start_time(pid) != started:
        return
    _signal_group(pid, signal.SIGKILL)  # a child that leads a session of its own
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def set_parent_death_signal() -> None:
    """Runs in the child before exec: get SIGKILL if the benchmark itself is killed (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


# --- the child ---------------------------------------------------------------------------------


class Child:
    """One command, started at once; ``stop`` (or leaving a ``with`` block) ends it and all it
    started.

    ``log_path``: the output goes to that file; otherwise the last ``TAIL_LINES`` lines are kept
    and the first line starting with ``ready_prefix`` is ``ready_line`` (the rest of it).
    ``die_with_parent``: the child gets SIGKILL if the benchmark dies without stopping it.
    ``name`` (in messages): by default the module of ``python -m MODULE``, else the program.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str | None = None,
        log_path: Path | None = None,
        ready_prefix: str | None = None,
        env: Mapping[str, str] | None = None,
        die_with_parent: bool = False,
        stop_grace_s: float = 15.0,
    ) -> None:
        self.argv = list(argv)
        self.name = name or _default_name(self.argv)
        self.log_path = log_path
        self.stop_grace_s = stop_grace_s
        self.ready_line: str | None = None
        self.known: dict[int, str] = {}  # descendants seen: pid -> start time
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._ready_prefix = ready_prefix
        self._ready = threading.Event()
        self._log: IO[bytes] | None = None
        self._drainer: threading.Thread | None = None
        if log_path is not None:
            self._log = log_path.open("wb")
        try:
            self.popen = subprocess.Popen(
                self.argv,
                cwd=REPO_ROOT,
                env=None if env is None else dict(env),
                stdin=subprocess.DEVNULL,
                stdout=self._log if self._log is not None else subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=True,
                preexec_fn=set_parent_death_signal if die_with_parent else None,
            )
        except OSError as exc:
            if self._log is not None:
                self._log.close()
            raise BenchError(f"cannot start {self.name} ({shlex.join(self.argv)}): {exc}") from exc
        if self._log is None:
            self._drainer = threading.Thread(target=self._drain, daemon=True, name="child-output")
            self._drainer.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exit_code(self) -> int | None:
        """None while it runs."""
        return self.popen.poll()

    def _drain(self) -> None:
        assert self.popen.stdout is not None
        prefix = self._ready_prefix
        for line in self.popen.stdout:
            self._tail.append(line.rstrip())
            if prefix is not None and self.ready_line is None and line.startswith(prefix):
                self.ready_line = line[len(prefix) :].strip()
                self._ready.set()
        self.popen.stdout.close()
        self._ready.set()  # end of output: the process is gone (or closed its stdout)

    def wait_ready_line(self, timeout_s: float) -> str:
        """The rest of the ready line; ``BenchError`` if the child exited or took too long."""
        if not self._ready.wait(timeout_s) or self.ready_line is None:
            raise BenchError(self.describe(f"no ready line within {timeout_s:g} s"))
        return self.ready_line

    def tail(self, lines: int = TAIL_LINES) -> list[str]:
        """The last lines of its output ([] when there is no log to read)."""
        if self.log_path is None:
            return list(self._tail)[-lines:]
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return []

    def log_tail(self, lines: int = 25) -> str:
        """The last lines of its output, each marked with its name."""
        if self.log_path is None:
            return "\n".join(f"  [{self.name}] {line}" for line in self.tail(lines))
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
            return "\n".join(f"  [{self.name}] {line}" for line in text)
        return f"  [{self.name}] (no log)"

    def describe(self, problem: str) -> str:
        """``problem``, whether it still runs, and its last output."""
        status = self.exit_code
        state = "running" if status is None else f"exited with {status}"
        lines = "\n".join(f"    {line}" for line in self.tail())
        return f"{self.name}: {problem} ({state}); last output:\n{lines}"

    def note_descendants(self) -> None:
        """Remember the processes this child started (found again at ``stop`` if it crashed)."""
        self.known.update(_live_descendants(self.pid))

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM the group, SIGKILL it after ``grace_s`` (default ``stop_grace_s``); then
        SIGKILL what the group and the descendants seen left behind. Always reaps."""
        grace = self.stop_grace_s if grace_s is None else grace_s
        try:
            self.note_descendants()
            if self.popen.poll() is None:
                _signal_group(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.note_descendants()
                _signal_group(self.pid, signal.SIGKILL)
                self.popen.wait()
            _signal_group(self.pid, signal.SIGKILL)  # stragglers left in its group
            for pid, started in self.known.items():
                _kill_if_same(pid, started)
        finally:
            if self._log is not None:
                self._log.close()
            if self._drainer is not None:
                self._drainer.join(timeout=2.0)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _default_name(argv: Sequence[str]) -> str:
    if len(argv) > 2 and argv[1] == "-m":
        return argv[2]
    return Path(argv[0]).name if argv else "?"
