"""Outbound HTTP to one worker: the seam (``base``), its implementations, and their table here.

May import: the top level (errors, settings, workers). Nothing in ``base`` imports an
implementation; each implementation imports ``base``; only this table names them.
"""

from __future__ import annotations

from router.settings import UpstreamSettings
from router.upstream.base import UpstreamClient
from router.workers import Worker

__all__ = ["build_upstream"]


def build_upstream(worker: Worker, settings: UpstreamSettings) -> UpstreamClient:
    """The configured implementation for ``worker``."""
    if settings.client == "lean":
        from router.upstream.lean_client import LeanUpstream

        return LeanUpstream(worker, settings)
    if settings.client == "httpx":
        from router.upstream.httpx_client import HttpxUpstream

        return HttpxUpstream(worker, settings)
    from router.upstream.aiohttp_client import AiohttpUpstream

    return AiohttpUpstream(worker, settings)
