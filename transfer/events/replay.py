"""Asking a publisher's replay endpoint for the batches it still buffers: ``ReplayClient``.

The subscriber's side of the replay exchange (docs/concepts/protocols.md section 7): a DEALER sends
the start
seq, and the replies (the buffered batches from that seq on, in order) are collected up to the end
marker within a timeout. One request runs at a time. After a request that did not finish (timed
out, failed or cancelled) the DEALER is replaced, so that its late replies can never be taken for
replies to the next request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq
import zmq.asyncio

from . import codec
from .errors import ReplayTimeout

__all__ = ["ReplayClient"]


class ReplayClient:
    """A DEALER connected to ``endpoint``, made by ``socket`` (which sets its options).

    ``fetch`` raises ``ReplayTimeout`` when the end marker has not come within ``timeout``
    seconds and ``KVEventDecodeError`` for a malformed reply. ``close`` closes the DEALER.
    """

    def __init__(
        self, endpoint: str, timeout: float, socket: Callable[[int], zmq.asyncio.Socket]
    ) -> None:
        self._endpoint = endpoint
        self._timeout = timeout
        self._socket = socket
        self._lock = asyncio.Lock()
        self._dealer = self._open()

    def close(self) -> None:
        self._dealer.close(linger=0)

    async def fetch(self, start_seq: int) -> list[codec.LiveMessage]:
        """Ask from ``start_seq`` and collect the replies up to the end marker.

        On any failure or cancellation the DEALER is replaced, so late replies to this
        request can never be mistaken for replies to the next one.
        """
        async with self._lock:
            dealer, finished = self._dealer, False
            try:
                messages = await self._collect(dealer, start_seq)
                finished = True
                return messages
            except TimeoutError as exc:
                raise ReplayTimeout(self._endpoint, start_seq, self._timeout) from exc
            finally:
                if not finished:
                    dealer.close(linger=0)
                    self._dealer = self._open()

    async def _collect(self, dealer: zmq.asyncio.Socket, start_seq: int) -> list[codec.LiveMessage]:
        messages: list[codec.LiveMessage] = []
        async with asyncio.timeout(self._timeout):
            await dealer.send_multipart(codec.replay_request_frames(start_seq))
            while True:
                reply = codec.parse_replay_reply(await dealer.recv_multipart())
                if isinstance(reply, codec.ReplayEnd):
                    return messages
                messages.append(reply)

    def _open(self) -> zmq.asyncio.Socket:
        dealer = self._socket(zmq.DEALER)
        dealer.connect(self._endpoint)
        return dealer
