"""What the test helpers that run a server binary as a child share (``testkit.etcd_server``,
``testkit.mooncake_master``): its output in a log file in a work dir, start-up polled until the
server says it is ready (or its log tail in the error), stop (SIGCONT, then SIGTERM, then SIGKILL
after a grace period: a paused child stops too), close (stop and delete the work dir), and use
as a context manager. A subclass names the server and gives its command and readiness check."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from testkit.servers import stop_process

__all__ = ["ChildServer"]


class ChildServer:
    """One server process; ``start`` and ``stop`` may alternate; ``close`` cleans up."""

    name = "server"
    log_name = "server.log"
    start_timeout_s = 15.0
    stop_timeout_s = 5.0

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the server and wait until it is ready; raises RuntimeError when it is not."""
        if self.running:
            return
        with open(self.work_dir / self.log_name, "ab") as log:
            self._process = subprocess.Popen(
                self._command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        self._wait_ready()

    def stop(self) -> None:
        """Stop the server; keeps the work dir."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)  # a paused server would not act on SIGTERM
        stop_process(process, timeout=self.stop_timeout_s)

    def close(self) -> None:
        """Stop the server and delete its work dir."""
        self.stop()
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def log_tail(self, lines: int = 20) -> str:
        path = self.work_dir / self.log_name
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not self._ready():
            if self._process is None or self._process.poll() is not None:
                raise RuntimeError(f"{self.name} exited during start-up:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"{self.name} not ready after {self.start_timeout_s}s:\n{self.log_tail()}"
                )
            time.sleep(0.02)
