"""In-process PD clusters of simulated workers behind the real router, for the worker tests.

One standalone registry per prefill (its bootstrap API), prefill and decode ``SimWorker``s sharing
a ``LoopbackNetwork`` (KV really moves between their pools; faults are injected through the
``LoopbackEngine`` knobs), a co-located ``--role both`` worker for the reference output, and the
router, all on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from registry.app import create_registry_app
from registry.settings import RegistrySettings
from router.app import create_app as create_router
from testkit.fake_cluster import settings_for
from testkit.polling import wait_until
from testkit.servers import run_server, run_servers
from transfer.engine.base import TransferEngine
from transfer.engine.fake import LoopbackEngine, LoopbackNetwork
from worker.app import EngineFactory, SimWorker, WorkerConfig, create_app
from worker.kv import PoolShape

__all__ = ["SHAPE", "TRANSFER_TIMEOUT_S", "PDCluster", "Side", "pd_cluster"]

SHAPE = PoolShape(layers=2, page_size=16, bytes_per_token=64, pages=4096)
TRANSFER_TIMEOUT_S = 1.0


@dataclass
class Side:
    """One worker and the transfer engines its lifespan opened."""

    worker: SimWorker
    engines: list[LoopbackEngine] = field(default_factory=list)

    @property
    def engine(self) -> LoopbackEngine:
        return self.engines[-1]

    def open_rooms(self) -> int:
        return self.worker.open_rooms

    def idle(self) -> bool:
        return self.open_rooms() == 0 and all(
            pool.free_pages == pool.shape.pages and pool.quarantined == 0
            for pool in self.worker.pools
        )


@dataclass
class PDCluster:
    engine: str
    router: str
    reference: str
    prefills: list[Side]
    decodes: list[Side]
    registries: list[int]
    registry_servers: list[contextlib.ExitStack]
    worker_urls: list[str]  # prefills, then decodes

    @property
    def sides(self) -> list[Side]:
        return self.prefills + self.decodes

    def wait_idle(self, timeout: float = 5.0) -> None:
        """Every worker has all its pages free, none quarantined, no open room."""
        wait_until(
            lambda: all(side.idle() for side in self.sides),
            timeout,
            f"idle workers: {self.describe()}",
        )

    def describe(self) -> str:
        return ", ".join(
            f"{s.worker.config.role}: {s.worker.pool.free_pages} free, "
            f"{s.worker.pool.quarantined} quarantined, {s.open_rooms()} rooms"
            for s in self.sides
        )


def _factory(engines: list[LoopbackEngine], network: LoopbackNetwork) -> EngineFactory:
    async def factory() -> TransferEngine:
        engine = network.engine()
        engines.append(engine)
        return engine

    return factory


def _sides(
    role: Literal["prefill", "decode"],
    count: int,
    network: LoopbackNetwork,
    registries: Sequence[int],
    **options: Any,
) -> list[Side]:
    sides = []
    for index in range(count):
        registry = f"127.0.0.1:{registries[index]}" if registries else None
        engines: list[LoopbackEngine] = []
        config = WorkerConfig(
            role,
            registry=registry,
            **{"shape": SHAPE, "transfer_timeout_s": TRANSFER_TIMEOUT_S, **options},
        )
        sides.append(Side(SimWorker(config, _factory(engines, network)), engines))
    return sides


@contextlib.contextmanager
def pd_cluster(
    prefill: int = 1,
    decode: int = 1,
    engine: str = "sglang",
    dp: int = 1,
    *,
    prefill_options: dict[str, Any] | None = None,
    decode_options: dict[str, Any] | None = None,
    transfer_timeout_s: float = TRANSFER_TIMEOUT_S,
    **router: Any,
) -> Iterator[PDCluster]:
    """``prefill``P``decode``D, ``dp`` ranks per prefill, behind the router speaking
    ``engine`` (``prefill_options``/``decode_options``: more ``WorkerConfig`` fields for the
    prefills/decodes, e.g. a smaller ``shape``; ``router``: settings overrides); every worker
    gives a transfer ``transfer_timeout_s``."""
    network = LoopbackNetwork()
    with contextlib.ExitStack() as stack:
        own = [stack.enter_context(contextlib.ExitStack()) for _ in range(prefill)]
        registries = [
            s.enter_context(run_server(create_registry_app(RegistrySettings()))) for s in own
        ]
        prefills = _sides(
            "prefill",
            prefill,
            network,
            registries,
            protocol=engine,
            dp_size=dp,
            transfer_timeout_s=transfer_timeout_s,
            **(prefill_options or {}),
        )
        decodes = _sides(
            "decode",
            decode,
            network,
            [],
            transfer_timeout_s=transfer_timeout_s,
            protocol=engine,
            **(decode_options or {}),
        )
        reference = SimWorker(WorkerConfig("both", shape=SHAPE), None)
        ports = stack.enter_context(
            run_servers(
                *(create_app(side.worker) for side in prefills + decodes), create_app(reference)
            )
        )
        pairs = zip(ports[:prefill], registries, strict=True)
        settings = settings_for(
            engine,
            [(f"http://127.0.0.1:{p}", b) for p, b in pairs],
            [f"http://127.0.0.1:{p}" for p in ports[prefill : prefill + decode]],
            **{"health": {"failure_threshold": 1000}, "upstream": {"max_retries": 0}, **router},
        )
        router_url = f"http://127.0.0.1:{stack.enter_context(run_server(create_router(settings)))}"
        wait_until(
            lambda: httpx.get(f"{router_url}/ready").status_code == 200, 10.0, "router ready"
        )
        cluster = PDCluster(
            engine,
            router_url,
            f"http://127.0.0.1:{ports[-1]}",
            prefills,
            decodes,
            registries,
            own,
            [f"http://127.0.0.1:{p}" for p in ports],
        )
        wait_until(
            lambda: all(len(s.engines) == len(s.worker.ranks) for s in cluster.sides),
            5.0,
            "engines open",
        )
        yield cluster
