"""``pd-cluster`` as a process on a free 127.0.0.1 port, for tests that need the real command.

``ClusterProcess(log_path, *args)`` starts ``python -m worker.cluster --port PORT ARGS`` in its
own session; ``wait_ready()`` polls the router's ``/ready`` with a deadline (failing at once with
the log when the process dies); ``stop()`` sends SIGTERM (pd-cluster stops its children), then
SIGKILLs whatever is left, its children's sessions included. Idempotent.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from testkit.polling import wait_until
from testkit.servers import free_port

__all__ = ["ClusterProcess"]


def _children(pid: int) -> list[int]:
    out = subprocess.run(
        ["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True
    ).stdout
    return [int(p) for p, pp in (line.split() for line in out.splitlines()) if int(pp) == pid]


class ClusterProcess:
    def __init__(self, log_path: Path, *args: str) -> None:
        self.log_path = log_path
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "worker.cluster", "--port", str(port), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.children: list[int] = []

    def wait_ready(self, timeout_s: float = 45.0) -> None:
        def ready() -> bool:
            assert self.proc.poll() is None, self.log_path.read_text()
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{self.url}/ready", timeout=1).status_code == 200
            return False

        wait_until(ready, timeout_s, "pd-cluster ready", interval=0.1)
        self.children = _children(self.proc.pid)

    def stop(self) -> None:
        proc = self.proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in self.children:  # each child is its own process group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
