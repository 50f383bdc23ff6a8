"""Predicted KV entries shared by the processes of ``router --workers N``: a burst of requests
sharing a prefix lands on one prefill rank even when its requests reach different processes.

Each process publishes every prediction it makes (``KVBlockIndex.on_predict``: the location, the
block size, the block keys) on a ZeroMQ PUB socket at ``ipc://<run dir>/pred-<index>.ipc`` and
subscribes to every sibling's; what arrives goes into its own index as a prediction of the same
lifetime (``--prediction-ttl``). Engine events stay per process: each process follows the
engines' streams itself, so confirmed blocks need no sharing.

Bounded, not best effort: each message carries its publisher's sequence number, so a receiver
counts what it missed (``gaps``: the publisher's send buffer was full, ``SNDHWM``, or the
receiver restarted); a missed prediction costs at most what a split burst costs and is gone
after the prediction lifetime anyway, so nothing is re-sent. A prediction reaches the siblings
in well under a millisecond on one host (``lag``: the last one's age on arrival); requests
decided within that window do not see it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from router.kv_cache.index import KVBlockIndex, Location
from router.process_role import ProcessRole

__all__ = ["SharedPredictions", "prediction_endpoint"]

logger = logging.getLogger(__name__)

SEND_HWM = 10_000  # messages a slow sibling may lag behind before they are dropped (gaps)
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # a larger one is dropped by ZeroMQ (a 256k-block prompt)


class _Prediction(msgspec.Struct, array_like=True):
    sender: int
    seq: int
    sent: float  # time.time() at the sender
    worker_id: str
    rank: int
    block_size: int
    keys: list[int]


def prediction_endpoint(role: ProcessRole, index: int) -> str:
    return "ipc://" + os.path.join(role.run_dir, f"pred-{index}.ipc")


class SharedPredictions:
    """Publishes this process's predictions and applies its siblings' to ``index``."""

    def __init__(self, index: KVBlockIndex, role: ProcessRole) -> None:
        self._index = index
        self._role = role
        self._context = zmq.asyncio.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(prediction_endpoint(role, role.index))
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        for other in range(role.count):
            if other != role.index:
                self._sub.connect(prediction_endpoint(role, other))
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(_Prediction).decode
        self._seq = 0
        self._last_seq: dict[int, int] = {}
        self.sent = self.dropped = self.received = self.gaps = 0
        self.lag_s: float | None = None
        index.on_predict = self.publish

    def publish(self, location: Location, keys: Sequence[int], block_size: int) -> None:
        """Tell the siblings (never blocks: a full send buffer drops the message)."""
        self._seq += 1
        worker_id, rank = location
        role, seq, now = self._role, self._seq, time.time()
        message = _Prediction(role.index, seq, now, worker_id, rank, block_size, list(keys))
        try:
            self._pub.send(self._encode(message), zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            self.dropped += 1

    async def run(self) -> None:
        """Apply the siblings' predictions until cancelled."""
        while True:
            try:
                frame = await self._sub.recv()
                prediction = self._decode(frame)
            except msgspec.DecodeError as exc:
                logger.warning("a sibling's prediction could not be read: %s", exc)
                continue
            self._apply(prediction)

    def _apply(self, prediction: _Prediction) -> None:
        last = self._last_seq.get(prediction.sender)
        if last is not None and prediction.seq > last + 1:
            self.gaps += prediction.seq - last - 1
        self._last_seq[prediction.sender] = prediction.seq
        self.received += 1
        self.lag_s = max(time.time() - prediction.sent, 0.0)
        location = (prediction.worker_id, prediction.rank)
        self._index.predict(location, prediction.keys, prediction.block_size, own=False)

    def stats(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "dropped": self.dropped,
            "received": self.received,
            "gaps": self.gaps,
            "lag_s": self.lag_s,
        }

    def close(self) -> None:
        self._index.on_predict = None
        self._pub.close()
        self._sub.close()
        self._context.term()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(prediction_endpoint(self._role, self._role.index).removeprefix("ipc://"))
