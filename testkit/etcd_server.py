"""A real one-member etcd for tests: free ports on 127.0.0.1, a temp data dir, start/stop/restart.

    with EtcdServer() as etcd:           # starts, waits until /health says true
        store = open_store(etcd.url + "/my-prefix")
        etcd.stop()                      # clients see connection loss from now on
        etcd.start()                     # same ports and data dir: clients can reconnect
        etcd.pause(); etcd.resume()      # SIGSTOP/SIGCONT: a hung etcd, connections kept open

The ports are chosen once, so a store opened before ``stop()`` reaches the restarted server. The
heartbeat and election timeouts are shortened so that a lone member elects itself in milliseconds
and etcd's minimum lease TTL is 1 s (with etcd's defaults a ttl of 1 becomes 2 s).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx

from testkit.servers import free_port

__all__ = ["ETCD_BINARY", "EtcdMissing", "EtcdServer", "free_port"]

ETCD_BINARY = Path(os.environ.get("PDR_ETCD_BINARY", "/usr/bin/etcd"))
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0


class EtcdMissing(RuntimeError):
    """The etcd binary is not installed."""


class EtcdServer:
    """One etcd process; ``start`` and ``stop`` may alternate freely; ``close`` cleans up."""

    def __init__(self, binary: Path = ETCD_BINARY) -> None:
        self.binary = binary
        self.client_port = free_port()
        self.peer_port = free_port()
        self.data_dir = Path(tempfile.mkdtemp(prefix="pdr-etcd-"))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        """The store URL (no prefix): ``etcd://127.0.0.1:PORT``."""
        return f"etcd://127.0.0.1:{self.client_port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start etcd and wait until it reports healthy; raises EtcdMissing or RuntimeError."""
        if self.running:
            return
        if not os.access(self.binary, os.X_OK):
            raise EtcdMissing(
                f"etcd binary not found at {self.binary}: run scripts/setup.sh "
                "(it installs the Debian package etcd-server)"
            )
        with open(self.data_dir / "etcd.log", "ab") as log:
            self._process = subprocess.Popen(
                self._command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        self._wait_healthy()

    def stop(self) -> None:
        """Stop etcd (SIGTERM, then SIGKILL after a grace period); keeps the data dir."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGCONT)  # a paused etcd would not act on SIGTERM
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def pause(self) -> None:
        """Freeze etcd (SIGSTOP): connections stay open but nothing answers, like a hung server."""
        if self._process is not None:
            self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._process is not None:
            self._process.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop etcd and delete its data dir."""
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def log_tail(self, lines: int = 20) -> str:
        path = self.data_dir / "etcd.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> EtcdServer:
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
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            str(self.binary),
            "--name",
            "pdr-test",
            "--data-dir",
            str(self.data_dir / "data"),
            "--listen-client-urls",
            self.endpoint,
            "--advertise-client-urls",
            self.endpoint,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"pdr-test={peer}",
            "--heartbeat-interval",
            "10",
            "--election-timeout",
            "100",
            "--logger",
            "zap",
            "--log-level",
            "warn",
        ]

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._healthy():
            if self._process is None or self._process.poll() is not None:
                raise RuntimeError(f"etcd exited during start-up:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"etcd not healthy after {START_TIMEOUT_S}s:\n{self.log_tail()}")
            time.sleep(0.02)

    def _healthy(self) -> bool:
        try:
            response = httpx.get(self.endpoint + "/health", timeout=1.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200 and response.json().get("health") == "true"
