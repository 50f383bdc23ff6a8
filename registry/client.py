"""For engines: register with the registry and keep the lease alive while serving.

    async with RegistryClient("http://router:8000") as registry:
        async with registry.registered("prefill", "http://10.0.0.5:8100", bootstrap_port=8998):
            await serve_forever()

``registered`` heartbeats every ``lease_s / 3`` seconds, re-registers if the lease was lost
(registry restarted, etcd blip), and deregisters on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal, Self

import httpx

from registry.errors import RegistryUnavailable

__all__ = ["RegistryClient"]

logger = logging.getLogger(__name__)


class RegistryClient:
    """Async client of the registry's ``/admin/workers`` API."""

    def __init__(self, base_url: str, *, token: str | None = None, timeout: float = 5.0) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._http.aclose()

    async def register(self, body: dict[str, Any]) -> dict[str, Any]:
        """Register (idempotent); returns the stored record. Raises RegistryUnavailable."""
        response = await self._call("POST", "/admin/workers", json=body)
        record: dict[str, Any] = response.json()
        return record

    async def heartbeat(self, worker_id: str) -> bool:
        """False when the lease is gone (the caller registers again)."""
        response = await self._call("POST", f"/admin/workers/{worker_id}/heartbeat", ok=(404,))
        return response.status_code == 200

    async def deregister(self, worker_id: str) -> None:
        await self._call("DELETE", f"/admin/workers/{worker_id}", ok=(404,))

    @contextlib.asynccontextmanager
    async def registered(
        self,
        role: Literal["prefill", "decode"],
        url: str,
        *,
        lease_s: float = 10.0,
        **fields: Any,
    ) -> AsyncIterator[dict[str, Any]]:
        """Stay registered (with heartbeats) while the block runs."""
        body = {"role": role, "url": url, "lease_s": lease_s, **fields}
        record = await self.register(body)
        beating = asyncio.create_task(self._keep_alive(record["id"], body, lease_s / 3))
        try:
            yield record
        finally:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating
            with contextlib.suppress(RegistryUnavailable):
                await self.deregister(record["id"])

    async def _keep_alive(self, worker_id: str, body: dict[str, Any], every: float) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                if not await self.heartbeat(worker_id):
                    logger.warning("registry lease of %s expired; registering again", worker_id)
                    await self.register(body)
            except RegistryUnavailable as exc:
                logger.warning("registry heartbeat failed (will retry): %s", exc)

    async def _call(
        self, method: str, path: str, *, ok: tuple[int, ...] = (), **kwargs: Any
    ) -> httpx.Response:
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise RegistryUnavailable(f"registry {self._http.base_url}: {exc!r}") from exc
        if response.status_code >= 400 and response.status_code not in ok:
            raise RegistryUnavailable(
                f"registry {method} {path} answered {response.status_code}: {response.text[:200]}"
            )
        return response
