"""A router in front of protocol fake engines, every one a real uvicorn server on 127.0.0.1.

``fake_cluster_factory(stack)`` returns ``make(engine, prefill=1, decode=1, dp_size=1, ...)``;
everything it starts is stopped when ``stack`` closes. ``settings_for`` builds the router
settings the factory uses, for tests that start the router themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from router import RouterSettings, create_app
from testkit.fake_engine import EngineProtocol, FakeConfig, FakeEngine
from testkit.polling import wait_until
from testkit.servers import run_server

__all__ = ["FakeCluster", "FakeClusterFactory", "fake_cluster_factory", "settings_for"]


@dataclass
class FakeCluster:
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


def settings_for(
    engine: str,
    prefill: list[tuple[str, int | None]],
    decode: list[str],
    *,
    prefill_namespace: str | None = None,
    **overrides: Any,
) -> RouterSettings:
    """Router settings for these workers, probing fast; ``overrides`` merge per section."""
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


FakeClusterFactory = Callable[..., FakeCluster]


def fake_cluster_factory(stack: contextlib.ExitStack) -> FakeClusterFactory:
    """``make(engine, prefill=1, decode=1, dp_size=1, config=..., **router_overrides)``."""

    def make(
        engine: EngineProtocol,
        *,
        prefill: int = 1,
        decode: int = 1,
        dp_size: int = 1,
        config: Callable[[], FakeConfig] | None = None,
        ready: bool = True,
        prefill_namespace: str | None = None,
        **overrides: Any,
    ) -> FakeCluster:
        new_config = config or (lambda: FakeConfig(kv_timeout=20.0))
        prefills = [
            FakeEngine("prefill", engine, dp_size=dp_size, config=new_config())
            for _ in range(prefill)
        ]
        decodes = [FakeEngine("decode", engine, config=new_config()) for _ in range(decode)]
        servers: dict[tuple[str, int], contextlib.ExitStack] = {}
        prefill_addrs = [
            _serve_prefill(stack, servers, index, fake) for index, fake in enumerate(prefills)
        ]
        decode_urls = [
            _serve_decode(stack, servers, index, fake) for index, fake in enumerate(decodes)
        ]
        if prefill_namespace is not None:  # the prefill registers with the router instead
            prefill_addrs = [(url, None) for url, _ in prefill_addrs]
        settings = settings_for(
            engine, prefill_addrs, decode_urls, prefill_namespace=prefill_namespace, **overrides
        )
        router_port = stack.enter_context(run_server(create_app(settings)))
        cluster = FakeCluster(
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

    return make


def _serve_prefill(
    stack: contextlib.ExitStack,
    servers: dict[tuple[str, int], contextlib.ExitStack],
    index: int,
    fake: FakeEngine,
) -> tuple[str, int | None]:
    own = servers[("prefill", index)] = stack.enter_context(contextlib.ExitStack())
    port = own.enter_context(run_server(fake.app))
    boot = (
        own.enter_context(run_server(fake.bootstrap_app))
        if fake.bootstrap_app is not None
        else None
    )
    return f"http://127.0.0.1:{port}", boot


def _serve_decode(
    stack: contextlib.ExitStack,
    servers: dict[tuple[str, int], contextlib.ExitStack],
    index: int,
    fake: FakeEngine,
) -> str:
    own = servers[("decode", index)] = stack.enter_context(contextlib.ExitStack())
    return f"http://127.0.0.1:{own.enter_context(run_server(fake.app))}"
