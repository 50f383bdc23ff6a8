"""Engine load: poll each worker's own report and keep it on the worker (issue 9, in progress)."""

from __future__ import annotations

import asyncio
from typing import Any

from router.settings import EngineProtocol, LoadSettings
from router.workers import WorkerPool

__all__ = ["EngineLoadMonitor"]


class EngineLoadMonitor:
    """Owns the load client and the poll loop; run ``run()`` as a lifespan task."""

    def __init__(self, pool: WorkerPool[Any], engine: EngineProtocol, settings: LoadSettings):
        self._pool = pool
        self._engine = engine
        self._settings = settings

    async def run(self) -> None:
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        return None
