"""Health waits: poll a server's HTTP endpoint until it answers as expected, up to a deadline; a
child's wait ends early, with its last output, when it exits."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import httpx

from bench.common.process import BenchError, Child

__all__ = ["wait_health", "wait_http_ok"]


def _is_200(response: httpx.Response) -> bool:
    return response.status_code == 200


def wait_http_ok(
    url: str,
    deadline: float,
    *,
    alive: Callable[[], object] | None = None,
    accept: Callable[[httpx.Response], bool] = _is_200,
    interval_s: float = 0.05,
) -> bool:
    """Poll ``GET url`` (1 s per try, no proxy from the environment) until ``accept`` takes an
    answer (default: status 200): True; False once ``time.monotonic()`` is past ``deadline``.

    ``alive`` runs before every try: it raises when the server's process is gone (a try that
    fails to connect, or whose answer ``accept`` cannot read, counts as not ready yet).
    """
    with httpx.Client(timeout=1.0, trust_env=False) as client:
        while True:
            if alive is not None:
                alive()
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if accept(client.get(url)):
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(interval_s)


def wait_health(child: Child, url: str, timeout_s: float) -> None:
    """Until ``{url}/health`` answers 200; ``BenchError`` (with the child's last output) when
    ``child`` exits first or ``timeout_s`` runs out."""

    def alive() -> None:
        if child.exit_code is not None:
            raise BenchError(child.describe("exited during start-up"))

    if not wait_http_ok(f"{url}/health", time.monotonic() + timeout_s, alive=alive, interval_s=0.1):
        raise BenchError(child.describe(f"/health not 200 within {timeout_s:g} s"))
