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
import signal
import tempfile
from pathlib import Path

import httpx

from testkit.child_server import ChildServer
from testkit.servers import free_port

__all__ = ["ETCD_BINARY", "EtcdMissing", "EtcdServer", "free_port"]

ETCD_BINARY = Path(os.environ.get("PDR_ETCD_BINARY", "/usr/bin/etcd"))
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0


class EtcdMissing(RuntimeError):
    """The etcd binary is not installed."""


class EtcdServer(ChildServer):
    """One etcd process; ``start`` and ``stop`` may alternate freely; ``close`` cleans up."""

    name = "etcd"
    log_name = "etcd.log"
    start_timeout_s = START_TIMEOUT_S
    stop_timeout_s = STOP_TIMEOUT_S

    def __init__(self, binary: Path = ETCD_BINARY) -> None:
        super().__init__(Path(tempfile.mkdtemp(prefix="pdr-etcd-")))
        self.binary = binary
        self.client_port = free_port()
        self.peer_port = free_port()

    @property
    def data_dir(self) -> Path:
        return self.work_dir

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        """The store URL (no prefix): ``etcd://127.0.0.1:PORT``."""
        return f"etcd://127.0.0.1:{self.client_port}"

    def start(self) -> None:
        """Start etcd and wait until it reports healthy; raises EtcdMissing or RuntimeError."""
        if not self.running and not os.access(self.binary, os.X_OK):
            raise EtcdMissing(
                f"etcd binary not found at {self.binary}: run scripts/setup-test.sh "
                "(it installs the Debian package etcd-server)"
            )
        super().start()

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

    def _ready(self) -> bool:
        try:
            response = httpx.get(self.endpoint + "/health", timeout=1.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200 and response.json().get("health") == "true"
