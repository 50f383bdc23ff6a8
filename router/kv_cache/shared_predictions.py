"""Predicted KV entries shared by the processes of ``router --workers N`` (off by default,
``PDR_CACHE__SHARE_PREDICTIONS``): every prediction this process makes
(``KVBlockIndex.on_predict``: the location, the block size, the block keys) goes to its
siblings over the host's bus (``router.sibling_bus``), and theirs go into its own index with the
same lifetime (``--prediction-ttl``). Engine events stay per process: each process follows the
engines' streams itself, so confirmed blocks need no sharing. A lost prediction costs what a
split burst costs and expires with its lifetime anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from router.kv_cache.index import KVBlockIndex, Location
from router.sibling_bus import SiblingBus

__all__ = ["Prediction", "SharedPredictions"]


class Prediction(msgspec.Struct, array_like=True, tag="prediction"):
    worker_id: str
    rank: int
    block_size: int
    keys: list[int]


class SharedPredictions:
    """Publishes this process's predictions and applies its siblings' to ``index``."""

    def __init__(self, index: KVBlockIndex, bus: SiblingBus) -> None:
        self._index = index
        self._bus = bus
        bus.on(Prediction, self._apply)
        index.on_predict = self.publish

    def publish(self, location: Location, keys: Sequence[int], block_size: int) -> None:
        worker_id, rank = location
        self._bus.publish(Prediction(worker_id, rank, block_size, list(keys)))

    def _apply(self, prediction: Prediction) -> None:
        location = (prediction.worker_id, prediction.rank)
        self._index.predict(location, prediction.keys, prediction.block_size, own=False)

    def close(self) -> None:
        self._index.on_predict = None
