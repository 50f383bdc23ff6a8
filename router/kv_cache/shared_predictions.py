"""Predicted KV entries shared with those routing beside this process (off by default,
``PDR_CACHE__SHARE_PREDICTIONS``): every prediction this process makes
(``KVBlockIndex.on_predict``: the location, the block size, the block keys) goes to its siblings
of ``router --workers N`` over the host's bus (``router.sibling_bus``) and to the replica peers
over the replicas' sync (``router.fleet.replica_sync``, ``--replica-listen``); theirs go into
its own index with the same lifetime (``--prediction-ttl``). A sibling's prediction goes on to
the peers (only process 0 publishes for its host: the others' sync sends nothing); a peer's
reaches every process of the host by itself. Engine events stay per process: each process
follows the engines' streams itself, so confirmed blocks need no sharing. A lost prediction
(a gap, counted by the channel) costs what a split burst costs and expires with its lifetime
anyway; one arrives at most the channel's lag late (``lag_s``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec

from router.kv_cache.index import KVBlockIndex, Location

__all__ = ["Prediction", "PredictionChannel", "SharedPredictions"]


class Prediction(msgspec.Struct, array_like=True, tag="prediction"):
    worker_id: str
    rank: int
    block_size: int
    keys: list[int]


class PredictionChannel(Protocol):
    """What carries predictions (``SiblingBus``, ``ReplicaSync``)."""

    def publish(self, body: msgspec.Struct) -> None: ...

    def on(self, kind: type[msgspec.Struct], handler: Callable[[Any], None]) -> None: ...


class SharedPredictions:
    """Publishes this process's predictions to ``host`` (its siblings) and ``fleet`` (the
    replica peers) and applies theirs to ``index``."""

    def __init__(
        self,
        index: KVBlockIndex,
        host: PredictionChannel | None = None,
        fleet: PredictionChannel | None = None,
    ) -> None:
        self._index = index
        self._channels = [channel for channel in (host, fleet) if channel is not None]
        self._fleet = fleet
        if host is not None:
            host.on(Prediction, self._apply_sibling)
        if fleet is not None:
            fleet.on(Prediction, self._apply)
        index.on_predict = self.publish

    def publish(self, location: Location, keys: Sequence[int], block_size: int) -> None:
        worker_id, rank = location
        prediction = Prediction(worker_id, rank, block_size, list(keys))
        for channel in self._channels:
            channel.publish(prediction)

    def _apply(self, prediction: Prediction) -> None:
        location = (prediction.worker_id, prediction.rank)
        self._index.predict(location, prediction.keys, prediction.block_size, own=False)

    def _apply_sibling(self, prediction: Prediction) -> None:
        self._apply(prediction)
        if self._fleet is not None:
            self._fleet.publish(prediction)

    def close(self) -> None:
        self._index.on_predict = None
