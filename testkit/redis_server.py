"""A real Redis for tests: a free port on 127.0.0.1, a temp work dir, nothing saved to disk.

    with RedisServer() as redis:         # starts, waits until it answers PING
        limiter = TenantLimiter(limits, redis.url)
        redis.stop()                     # clients see connection loss from now on
        redis.start()                    # same port (empty: nothing is persisted)

The tenant limits' shared storage (``router.tenancy``) is tested against it.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

from testkit.child_server import ChildServer
from testkit.servers import free_port

__all__ = ["REDIS_BINARY", "RedisMissing", "RedisServer"]

REDIS_BINARY = Path(os.environ.get("PDR_REDIS_BINARY", "/usr/bin/redis-server"))


class RedisMissing(RuntimeError):
    """The redis-server binary is not installed."""


class RedisServer(ChildServer):
    """One redis-server process; ``start`` and ``stop`` may alternate; ``close`` cleans up."""

    name = "redis"
    log_name = "redis.log"

    def __init__(self, binary: Path = REDIS_BINARY) -> None:
        super().__init__(Path(tempfile.mkdtemp(prefix="pdr-redis-")))
        self.binary = binary
        self.port = free_port()

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT``, what ``TenantLimiter`` takes as its storage."""
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start redis-server and wait until it answers; raises RedisMissing or RuntimeError."""
        if not self.running and not os.access(self.binary, os.X_OK):
            raise RedisMissing(
                f"redis-server not found at {self.binary}: run scripts/setup-test.sh "
                "(it installs the Debian package redis-server)"
            )
        super().start()

    def _command(self) -> list[str]:
        return [
            str(self.binary),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.work_dir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ]

    def _ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(64).startswith(b"+PONG")
        except OSError:
            return False
