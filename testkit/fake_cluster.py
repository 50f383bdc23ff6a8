"""A router in front of protocol fake engines, every one a real uvicorn server on 127.0.0.1.

``fake_cluster_factory(stack)`` returns ``make(engine, prefill=1, decode=1, dp_size=1, ...)``;
everything it starts is stopped when ``stack`` closes. ``settings_for`` builds the router
settings the factory uses, for tests that start the router themselves. ``serve_engine`` serves
one fake engine so that ``engine.kill()`` (``FakeConfig.die_after_answer``) can take it down.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from router import RouterSettings, create_app
from testkit.fake_engine import EngineProtocol, FakeConfig, FakeEngine
from testkit.polling import wait_until
from testkit.servers import TestServer, make_server, run_server, serving

__all__ = [
    "FakeCluster",
    "FakeClusterFactory",
    "fake_cluster_factory",
    "serve_engine",
    "settings_for",
]

ENGINE_START_TIMEOUT_S = 10.0


def _kill_now(servers: list[TestServer]) -> None:
    """On the servers' loop: stop listening, drop every connection, let them exit."""
    for server in servers:
        for listener in server.servers:
            listener.close()  # the port refuses connections from now on
        for connection in list(server.server_state.connections):
            connection.transport.close()  # what was written still goes out, then EOF
        server.should_exit = True


@contextlib.contextmanager
def serve_engine(engine: FakeEngine) -> Iterator[list[int]]:
    """Serve ``engine.app`` and its bootstrap app (if any) on one background event loop, on
    127.0.0.1; yield their ports. ``engine.kill()`` then takes them down as a killed process
    (from any thread): new connections are refused, open ones (a decode's KV read) drop."""
    apps = [engine.app] if engine.bootstrap_app is None else [engine.app, engine.bootstrap_app]
    servers = [make_server(app, host="127.0.0.1", port=0, lifespan="on") for app in apps]
    with serving(servers, ENGINE_START_TIMEOUT_S) as ports:
        loop: asyncio.AbstractEventLoop = servers[0].servers[0].get_loop()

        def kill() -> None:
            loop.call_soon_threadsafe(_kill_now, servers)

        engine.killers.append(kill)
        try:
            yield ports
        finally:
            engine.killers.remove(kill)


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
    declare_models: list[str] | None = None,
    **overrides: Any,
) -> RouterSettings:
    """Router settings for these workers, probing fast; ``overrides`` merge per section;
    ``declare_models``: worker i of each role declares model i mod M (``model=NAME``)."""
    names = declare_models or []

    def models(index: int) -> list[str]:
        return [names[index % len(names)]] if names else []

    values: dict[str, Any] = {
        "engine": engine,
        "prefill": [
            {
                "url": url,
                "bootstrap_port": port,
                "bootstrap_namespace": prefill_namespace,
                "models": models(index),
            }
            for index, (url, port) in enumerate(prefill)
        ],
        "decode": [{"url": url, "models": models(index)} for index, url in enumerate(decode)],
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
    ports = own.enter_context(serve_engine(fake))
    return f"http://127.0.0.1:{ports[0]}", ports[1] if len(ports) > 1 else None


def _serve_decode(
    stack: contextlib.ExitStack,
    servers: dict[tuple[str, int], contextlib.ExitStack],
    index: int,
    fake: FakeEngine,
) -> str:
    own = servers[("decode", index)] = stack.enter_context(contextlib.ExitStack())
    return f"http://127.0.0.1:{own.enter_context(serve_engine(fake))[0]}"
