"""The lifespan-owned context: everything a request needs, built once, closed on shutdown."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from router.adapters import build_adapter
from router.health import HealthProber
from router.pipeline import Pipeline
from router.policies import build_policy
from router.settings import RouterSettings
from router.upstream import UpstreamClient, build_upstream
from router.workers import Role, Worker, WorkerPool

__all__ = ["AppContext", "open_context"]


@dataclass(frozen=True, slots=True)
class AppContext:
    settings: RouterSettings
    pool: WorkerPool
    upstreams: dict[str, UpstreamClient]
    pipeline: Pipeline
    prober: HealthProber


def _build_pool(settings: RouterSettings, needs_engine_ids: bool) -> WorkerPool:
    prefill = [Worker(Role.PREFILL, s.url, s.bootstrap_port) for s in settings.prefill]
    decode = [Worker(Role.DECODE, s.url) for s in settings.decode]
    return WorkerPool(prefill, decode, needs_engine_ids=needs_engine_ids)


@contextlib.asynccontextmanager
async def open_context(settings: RouterSettings) -> AsyncIterator[AppContext]:
    """Build the context, start health probing, and tear both down on exit."""
    adapter = build_adapter(settings.engine)
    pool = _build_pool(settings, adapter.needs_engine_ids)
    upstreams = {w.id: build_upstream(w, settings.upstream) for w in pool.all()}
    prober = HealthProber(pool, settings.engine, settings.health)
    policy = settings.policy
    pipeline = Pipeline(
        pool,
        upstreams,
        adapter,
        build_policy(policy.prefill_policy or policy.policy),
        build_policy(policy.decode_policy or policy.policy),
        settings.upstream,
        settings.health,
        prober.refresh_soon,
    )
    probing = asyncio.create_task(prober.run(), name="health-prober")
    try:
        yield AppContext(settings, pool, upstreams, pipeline, prober)
    finally:
        probing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await probing
        await prober.aclose()
        await asyncio.gather(*(upstream.aclose() for upstream in upstreams.values()))
