"""A real ``mooncake_master`` for tests: free ports on 127.0.0.1, a temp log dir, start/stop.

    with MooncakeMaster() as master:     # starts, waits until /health says service_ready
        store = MooncakePageStore(master.address)                       # P2PHANDSHAKE metadata
        store = MooncakePageStore(master.address, metadata_server=master.metadata_url)

The master serves its RPC on ``address``, the transfer engine's HTTP metadata on
``metadata_url`` (``--enable_http_metadata_server``) and its admin/metrics (``/health``) on
``admin_url``. The binary is the one the ``mooncake-transfer-engine-non-cuda`` wheel ships in the
``mooncake`` package (``PDR_MOONCAKE_MASTER`` overrides it).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import httpx

from testkit.child_server import ChildServer
from testkit.servers import free_port

__all__ = ["MooncakeMaster", "MooncakeMissing", "master_binary"]

START_TIMEOUT_S = 20.0


class MooncakeMissing(RuntimeError):
    """The ``mooncake_master`` binary is not installed."""


def master_binary() -> Path | None:
    """The ``mooncake_master`` executable, or None where the wheel is not installed."""
    override = os.environ.get("PDR_MOONCAKE_MASTER")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(next(iter(spec.submodule_search_locations))) / "mooncake_master"
    return binary if os.access(binary, os.X_OK) else None


class MooncakeMaster(ChildServer):
    """One ``mooncake_master`` process; ``start`` and ``stop`` may alternate; ``close`` cleans
    up. ``lease_ttl_ms`` is the master's ``--default_kv_lease_ttl`` (how long a read pins an
    object; 0 makes every get fail, so keep it positive)."""

    name = "mooncake_master"
    log_name = "master.log"
    start_timeout_s = START_TIMEOUT_S

    def __init__(self, binary: Path | None = None, *, lease_ttl_ms: int = 5000) -> None:
        super().__init__(Path(tempfile.mkdtemp(prefix="pdr-mooncake-")))
        self.binary = binary if binary is not None else master_binary()
        self.lease_ttl_ms = lease_ttl_ms
        self.rpc_port = free_port()
        self.metadata_port = free_port()
        self.admin_port = free_port()

    @property
    def log_dir(self) -> Path:
        return self.work_dir

    @property
    def address(self) -> str:
        """The master's RPC address, ``127.0.0.1:PORT`` (the clients' ``master_server_addr``)."""
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """The HTTP metadata server's URL, for a client's ``metadata_server``."""
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self) -> None:
        """Start the master and wait until it is ready; raises MooncakeMissing or RuntimeError."""
        if not self.running and (self.binary is None or not os.access(self.binary, os.X_OK)):
            raise MooncakeMissing(
                "mooncake_master not found: pip install mooncake-transfer-engine-non-cuda "
                "(or set PDR_MOONCAKE_MASTER)"
            )
        super().start()

    def _command(self) -> list[str]:
        assert self.binary is not None
        return [
            str(self.binary),
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.rpc_port}",
            "--rpc_thread_num=2",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.metadata_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.admin_port}",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            "--enable_metric_reporting=false",
        ]

    def _ready(self) -> bool:
        try:
            response = httpx.get(self.admin_url + "/health", timeout=1.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200 and response.json().get("service_ready") is True
