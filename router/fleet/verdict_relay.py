"""Verdicts one router process reaches (a breaker opened, a worker ejected) told to those routing
beside it, and theirs followed: the other processes of its host (``router --workers N``, over
the host's bus, ``router.sibling_bus``) and the replica peers (``--replica-listen``, over the
replicas' sync, ``router.fleet.replica_sync``).

A sibling's verdict goes on to the peers: only process 0 publishes for the host (the others'
``fleet`` sends nothing); a peer's reaches every process of the host by itself, so it is not
passed on again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import msgspec

__all__ = ["VerdictChannel", "relay"]

V = TypeVar("V", bound=msgspec.Struct)


class VerdictChannel(Protocol):
    """What carries verdicts (``SiblingBus``, ``ReplicaSync``)."""

    def publish(self, body: msgspec.Struct) -> None: ...

    def on(self, kind: type[msgspec.Struct], handler: Callable[[Any], None]) -> None: ...


def relay(
    kind: type[V],
    follow: Callable[[V], None],
    *,
    host: VerdictChannel | None,
    fleet: VerdictChannel | None,
) -> Callable[[V], None]:
    """Follow the siblings' and the peers' verdicts of ``kind`` with ``follow``; returns what
    tells this process's own verdicts to both."""

    def tell(verdict: V) -> None:
        for channel in (host, fleet):
            if channel is not None:
                channel.publish(verdict)

    def follow_sibling(verdict: V) -> None:
        follow(verdict)
        if fleet is not None:
            fleet.publish(verdict)

    if host is not None:
        host.on(kind, follow_sibling)
    if fleet is not None:
        fleet.on(kind, follow)
    return tell
