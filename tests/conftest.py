"""Fixtures: fake engines and the router, each a real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from bench.fake_engine import EngineProtocol, FakeConfig, FakeEngine
from router import RouterSettings, create_app
from tests.servers import run_server


@dataclass
class Cluster:
    """A router in front of fake prefill and decode engines."""

    engine: str
    router_url: str
    prefills: list[FakeEngine]
    decodes: list[FakeEngine]
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    servers: dict[tuple[str, int], contextlib.ExitStack] = field(default_factory=dict)

    def stop(self, role: str, index: int) -> None:
        """Stop one fake engine's servers: its port refuses connections from now on."""
        self.servers.pop((role, index)).close()

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.router_url, timeout=30, **kwargs)

    def ready_body(self) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(self.router_url + "/ready", timeout=5).json()
        return body

    def wait_ready(self, timeout: float = 10.0) -> None:
        wait_until(
            lambda: httpx.get(self.router_url + "/ready", timeout=5).status_code == 200,
            timeout,
            "router /ready",
        )

    def wait_idle(self, timeout: float = 5.0) -> None:
        """Every worker's in-flight counter at the router is back to zero."""

        def idle() -> bool:
            body = self.ready_body()
            return all(w["inflight"] == 0 for w in body["prefill"] + body["decode"])

        wait_until(idle, timeout, "in-flight counters back to zero")


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` every 10 ms until it holds; fail the test naming ``what``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


async def await_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """``wait_until`` for async tests: polls every 10 ms without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


def settings_for(
    engine: str,
    prefill: list[tuple[str, int | None]],
    decode: list[str],
    *,
    prefill_namespace: str | None = None,
    **overrides: Any,
) -> RouterSettings:
    values: dict[str, Any] = {
        "engine": engine,
        "prefill": [
            {"url": url, "bootstrap_port": port, "bootstrap_namespace": prefill_namespace}
            for url, port in prefill
        ],
        "decode": [{"url": url} for url in decode],
        "health": {"interval_s": 0.2, "timeout_s": 1.0},
        "upstream": {"connect_timeout_s": 2.0},
    }
    for section, value in overrides.items():
        if isinstance(value, dict):
            values.setdefault(section, {}).update(value)
        else:
            values[section] = value
    return RouterSettings(**values)


ClusterFactory = Callable[..., Cluster]


@pytest.fixture
def make_cluster() -> Iterator[ClusterFactory]:
    """``make_cluster(engine, prefill=1, decode=1, dp_size=1, config=..., **router_overrides)``."""
    with contextlib.ExitStack() as stack:

        def factory(
            engine: EngineProtocol,
            *,
            prefill: int = 1,
            decode: int = 1,
            dp_size: int = 1,
            config: Callable[[], FakeConfig] | None = None,
            ready: bool = True,
            prefill_namespace: str | None = None,
            **overrides: Any,
        ) -> Cluster:
            new_config = config or (lambda: FakeConfig(kv_timeout=20.0))
            prefills = [
                FakeEngine("prefill", engine, dp_size=dp_size, config=new_config())
                for _ in range(prefill)
            ]
            decodes = [FakeEngine("decode", engine, config=new_config()) for _ in range(decode)]
            servers: dict[tuple[str, int], contextlib.ExitStack] = {}
            prefill_addrs: list[tuple[str, int | None]] = []
            for index, fake in enumerate(prefills):
                own = servers[("prefill", index)] = stack.enter_context(contextlib.ExitStack())
                port = own.enter_context(run_server(fake.app))
                boot = (
                    own.enter_context(run_server(fake.bootstrap_app))
                    if fake.bootstrap_app is not None
                    else None
                )
                prefill_addrs.append((f"http://127.0.0.1:{port}", boot))
            decode_urls = []
            for index, fake in enumerate(decodes):
                own = servers[("decode", index)] = stack.enter_context(contextlib.ExitStack())
                decode_urls.append(f"http://127.0.0.1:{own.enter_context(run_server(fake.app))}")
            if prefill_namespace is not None:  # the prefill registers with the router instead
                prefill_addrs = [(url, None) for url, _ in prefill_addrs]
            settings = settings_for(
                engine, prefill_addrs, decode_urls, prefill_namespace=prefill_namespace, **overrides
            )
            router_port = stack.enter_context(run_server(create_app(settings)))
            cluster = Cluster(
                engine,
                f"http://127.0.0.1:{router_port}",
                prefills,
                decodes,
                [url for url, _ in prefill_addrs],
                decode_urls,
                servers,
            )
            if ready:
                cluster.wait_ready()
            return cluster

        yield factory
