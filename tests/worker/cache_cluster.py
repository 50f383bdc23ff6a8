"""A 1P1D cluster of simulated workers behind the real router, every worker configured alike.

Like ``testkit.worker_cluster`` (a standalone registry as the prefill's bootstrap API, a shared
``LoopbackNetwork``, a co-located reference worker, the router; all on 127.0.0.1), but the decode
and the reference get the same protocol, tokenizer and pool shape as the prefill, which the
prefix-cache tests need (the decode's token ids must match the prefill's), and the prefill may
publish KV events. Also: free port runs for per-rank event ports.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from registry.app import create_registry_app
from registry.settings import RegistrySettings
from router.app import create_app as create_router
from testkit.fake_cluster import settings_for
from testkit.polling import wait_until
from testkit.servers import free_port, run_server, run_servers
from transfer.engine.base import TransferEngine
from transfer.engine.fake import LoopbackNetwork
from worker.app import EngineFactory, SimWorker, WorkerConfig, create_app
from worker.kv import PoolShape
from worker.kv_events import KVEventsConfig

SHAPE = PoolShape(layers=2, page_size=16, bytes_per_token=64, pages=512)


@dataclass
class CacheCluster:
    router: str
    bootstrap: int  # the prefill's bootstrap API (a standalone registry) port
    prefill_url: str
    decode_url: str
    reference: str
    prefill: SimWorker
    decode: SimWorker

    def idle(self) -> bool:
        """No room open, no page referenced (cached pages may stay) on either side."""
        return all(
            w.open_rooms == 0 and all(p.free_pages == p.shape.pages for p in w.pools)
            for w in (self.prefill, self.decode)
        )


def _factory(network: LoopbackNetwork) -> EngineFactory:
    async def factory() -> TransferEngine:
        return network.engine()

    return factory


def free_port_run(count: int) -> int:
    """A port P with P .. P+count-1 free on 127.0.0.1 a moment ago (bounded tries)."""
    for _ in range(50):
        base = free_port()
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise AssertionError(f"no run of {count} free ports")


def events_config(port: int = 0, replay: int = 0) -> KVEventsConfig:
    return KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay}",
    )


@contextlib.contextmanager
def cache_cluster(
    engine: str = "sglang",
    *,
    dp: int = 1,
    prefill: dict[str, Any] | None = None,
    common: dict[str, Any] | None = None,
    transfer_timeout_s: float = 5.0,
    router_settings: dict[str, Any] | None = None,
) -> Iterator[CacheCluster]:
    """1P1D speaking ``engine``; ``common``: ``WorkerConfig`` fields for every worker,
    ``prefill``: more for the prefill only (its ``dp`` ranks, KV events, compute time);
    ``router_settings``: more router settings, by section."""
    network = LoopbackNetwork()
    shared = {"shape": SHAPE, "protocol": engine, **(common or {})}
    with contextlib.ExitStack() as stack:
        boot = stack.enter_context(run_server(create_registry_app(RegistrySettings())))
        prefill_worker = SimWorker(
            WorkerConfig(
                "prefill",
                registry=f"127.0.0.1:{boot}",
                dp_size=dp,
                transfer_timeout_s=transfer_timeout_s,
                **{**shared, **(prefill or {})},
            ),
            _factory(network),
        )
        decode = SimWorker(
            WorkerConfig("decode", transfer_timeout_s=transfer_timeout_s, **shared),
            _factory(network),
        )
        reference = SimWorker(WorkerConfig("both", **shared), None)
        ports = stack.enter_context(
            run_servers(create_app(prefill_worker), create_app(decode), create_app(reference))
        )
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        settings = settings_for(
            engine,
            [(urls[0], boot)],
            [urls[1]],
            **{
                "health": {"failure_threshold": 1000},
                "upstream": {"max_retries": 0},
                **(router_settings or {}),
            },
        )
        router = f"http://127.0.0.1:{stack.enter_context(run_server(create_router(settings)))}"
        wait_until(lambda: httpx.get(f"{router}/ready").status_code == 200, 10.0, "router ready")
        yield CacheCluster(router, boot, urls[0], urls[1], urls[2], prefill_worker, decode)
