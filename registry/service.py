"""Registry rules over a store: add / update / drain / remove workers, list them, watch them.

Worker URLs are logged without their credentials (``redact_url``)."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Literal

import msgspec

from registry.backends.base import RegistryStore, WatchEvent
from registry.errors import NotFound
from registry.models import (
    WORKERS_PREFIX,
    WorkerRecord,
    decode_worker,
    encode_worker,
    redact_url,
    worker_id,
    worker_key,
)

__all__ = ["RegistryService", "WorkerChange"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerChange:
    """A worker appeared or changed (``record``), or disappeared (``record`` is None)."""

    worker_id: str
    record: WorkerRecord | None


class RegistryService:
    """The only code that knows how workers are laid out in the store."""

    def __init__(self, store: RegistryStore) -> None:
        self.store = store

    async def add_worker(
        self,
        role: Literal["prefill", "decode"],
        url: str,
        *,
        bootstrap_port: int | None = None,
        bootstrap_namespace: str | None = None,
        engine: str | None = None,
        source: Literal["static", "admin", "engine", "kubernetes"] = "admin",
        ttl: float | None = None,
        kv_events: str | None = None,
        kv_events_replay: str | None = None,
        models: tuple[str, ...] = (),
    ) -> WorkerRecord:
        """Register (idempotently) a worker; a changed address or engine bumps its epoch.

        A changed KV event endpoint alone does not: the engine is the same, only how to follow
        its cache changed (the router re-subscribes on its own)."""
        url = url.rstrip("/")
        wid = worker_id(role, url)
        old = await self.get_worker(wid)
        record = WorkerRecord(
            id=wid,
            role=role,
            url=url,
            bootstrap_port=bootstrap_port,
            bootstrap_namespace=bootstrap_namespace,
            engine=engine,
            source=source,
            kv_events=kv_events,
            kv_events_replay=kv_events_replay,
            models=models,
        )
        if old is not None:
            same = (old.bootstrap_port, old.bootstrap_namespace, old.engine) == (
                bootstrap_port,
                bootstrap_namespace,
                engine,
            )
            record = msgspec.structs.replace(
                record, epoch=old.epoch if same else old.epoch + 1, draining=False
            )
            events_same = (old.kv_events, old.kv_events_replay, old.models) == (
                kv_events,
                kv_events_replay,
                models,
            )
            if same and events_same and not old.draining and old.source == source and ttl is None:
                return old
        await self.store.put(worker_key(wid), encode_worker(record), ttl=ttl)
        logger.info(
            "registry: %s %s %s (epoch %d)",
            "updated" if old else "added",
            role,
            redact_url(url),
            record.epoch,
        )
        return record

    async def heartbeat(self, wid: str) -> bool:
        """Extend a self-registered worker's lease; False when it already expired."""
        return await self.store.refresh(worker_key(wid))

    async def get_worker(self, wid: str) -> WorkerRecord | None:
        raw = await self.store.get(worker_key(wid))
        return None if raw is None else decode_worker(raw)

    async def list_workers(self) -> list[WorkerRecord]:
        records = []
        for key, raw in (await self.store.list(WORKERS_PREFIX)).items():
            try:
                records.append(decode_worker(raw))
            except (msgspec.DecodeError, msgspec.ValidationError):
                logger.warning("registry: ignoring malformed worker record %s", key)
        return sorted(records, key=lambda r: (r.role, r.url))

    async def drain(self, wid: str) -> WorkerRecord:
        """Mark a worker draining: no new requests; raises NotFound."""
        record = await self.get_worker(wid)
        if record is None:
            raise NotFound(f"no worker with id {wid!r}")
        drained = msgspec.structs.replace(record, draining=True)
        await self.store.put(worker_key(wid), encode_worker(drained))
        return drained

    async def remove_worker(self, wid: str) -> None:
        if not await self.store.delete(worker_key(wid)):
            raise NotFound(f"no worker with id {wid!r}")

    def watch_workers(self) -> AsyncGenerator[WorkerChange, None]:
        """Changes from now on (the watch starts before this returns); raises
        RegistryUnavailable from the iterator when the store connection drops."""
        return self._changes(self.store.watch(WORKERS_PREFIX))

    async def _changes(
        self, events: AsyncIterator[WatchEvent]
    ) -> AsyncGenerator[WorkerChange, None]:
        try:
            async for event in events:
                wid = event.key.removeprefix(WORKERS_PREFIX)
                if event.kind == "delete" or event.value is None:
                    yield WorkerChange(wid, None)
                    continue
                try:
                    yield WorkerChange(wid, decode_worker(event.value))
                except (msgspec.DecodeError, msgspec.ValidationError):
                    logger.warning("registry: ignoring malformed worker record %s", event.key)
        finally:
            close = getattr(events, "aclose", None)
            if close is not None:
                await close()
