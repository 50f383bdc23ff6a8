"""A verdict channel in memory (``router.fleet.verdict_relay.VerdictChannel``): what was
published, and the handlers to deliver to."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

__all__ = ["MemoryChannel"]


class MemoryChannel:
    def __init__(self) -> None:
        self.published: list[Any] = []
        self._handlers: dict[type[msgspec.Struct], Callable[[Any], None]] = {}

    def publish(self, body: msgspec.Struct) -> None:
        self.published.append(body)

    def on(self, kind: type[msgspec.Struct], handler: Callable[[Any], None]) -> None:
        self._handlers[kind] = handler

    def deliver(self, body: msgspec.Struct) -> None:
        self._handlers[type(body)](body)
