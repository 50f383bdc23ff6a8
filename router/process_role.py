"""One router process's place among the processes of ``router --workers N``.

The supervisor (``router.server.supervisor``) starts each serving process with its role in the
environment variable ``ROLE_ENV`` (JSON, read once at start and removed from the environment):
which process it is, where its siblings answer (``run_dir``: one Unix socket each, mode 0600
in a 0700 directory), the supervisor's registry store when the router's own is in memory, and
either the inherited listening socket (``--worker-sockets shared``) or the port to bind with
SO_REUSEPORT. Without that variable the process is a router on its own (``None``).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import MutableMapping
from dataclasses import asdict, dataclass
from typing import Protocol

__all__ = ["JOIN_WAIT_S", "ROLE_ENV", "ProcessRole", "until_ready"]

ROLE_ENV = "PD_ROUTER_PROCESS"
JOIN_WAIT_S = 10.0  # a process joins the port once it can route, or after this long anyway
_READY_POLL_S = 0.05


class _Routable(Protocol):
    def ready(self) -> bool: ...


async def until_ready(pool: _Routable, timeout_s: float) -> None:
    """Until ``pool`` has a healthy prefill and decode, or ``timeout_s`` passed: a process of
    ``router --workers N`` starts listening only then, so that a client is never sent to a
    process that would answer 503 while its siblings serve (at the first start, with no worker
    up yet, no process listens for up to ``timeout_s``)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pool.ready() and asyncio.get_running_loop().time() < deadline:  # noqa: ASYNC110 - start-up only; readiness has no event
        await asyncio.sleep(_READY_POLL_S)


@dataclass(frozen=True, slots=True)
class ProcessRole:
    """A serving process of a supervised router."""

    index: int  # 0 .. count - 1
    count: int
    supervisor_pid: int
    run_dir: str
    port: int  # the client port (the supervisor resolved a port 0)
    listen_fd: int | None = None  # --worker-sockets shared: the supervisor's listening socket
    registry_url: str | None = None  # the supervisor's store (the router's own: memory://)
    registry_token: str | None = None

    def socket_path(self, index: int) -> str:
        """Where process ``index`` answers its siblings (``router.observability.siblings``)."""
        return os.path.join(self.run_dir, f"p{index}.sock")

    def up_path(self, index: int) -> str:
        """A file process ``index`` writes once it serves (the supervisor's sign that it came
        up: one that exits before is not restarted)."""
        return os.path.join(self.run_dir, f"p{index}.up")

    def sibling_paths(self) -> list[str]:
        """Every other process's socket."""
        return [self.socket_path(i) for i in range(self.count) if i != self.index]

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def take_from(cls, environ: MutableMapping[str, str]) -> ProcessRole | None:
        """The role in ``environ`` (removed from it, so that nothing this process starts
        inherits it), or None: a router on its own."""
        text = environ.pop(ROLE_ENV, None)
        if text is None:
            return None
        return cls(**json.loads(text))
