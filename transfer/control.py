"""The control plane between decode and prefill ranks: typed messages over pyzmq (``zmq.asyncio``).

Each rank binds one PULL socket and sends to peers through one cached PUSH socket per peer, as
SGLang's Mooncake backend does (docs/concepts/protocols.md 6.2). Frames are made and read by
``transfer.codec``
only. The process owns one ``zmq.asyncio.Context`` and passes it in; a ``ControlPlane`` owns its
sockets and closes them when its ``async with`` block ends.

Decisions:

* PUSH sockets set ``ZMQ_IMMEDIATE``: a message is queued only on a completed connection, so a
  send to a dead or unreachable peer fails after ``send_timeout_s`` with ``PeerUnreachable``
  instead of sitting in a queue for a peer that will never read it (SGLang's 1 s
  ``SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT``). A send that timed out was not delivered.
* With ``on_peer_lost``, every PUSH socket has a monitor: when an established connection to a
  peer drops (the peer process exited or its socket closed) the callback runs with the peer, so
  the roles fail that peer's rooms at once instead of at their deadlines. zmq keeps reconnecting;
  a peer that comes back at the same address is reached through the same socket.
* Messages on the PULL socket are bounded by ``max_message_bytes``; ``recv`` raises
  ``ProtocolMismatch`` for frames that are not ours, and the roles log and skip those.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Final, NamedTuple, Self

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from transfer import codec
from transfer.closing import AsyncClosing
from transfer.errors import TransferError
from transfer.messages import Message, RegisterKVArgs

__all__ = ["ControlPlane", "Peer", "PeerLost", "PeerUnreachable"]

logger = logging.getLogger(__name__)

_WILDCARDS: Final = frozenset({"", "*", "0.0.0.0", "::"})
_RECONNECT_MAX_MS: Final = 5000  # back off to one attempt per 5 s for a peer that is gone
_MONITOR_EVENTS: Final = zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED


class Peer(NamedTuple):
    """A rank's control address: where its PULL socket listens."""

    host: str
    port: int

    @property
    def endpoint(self) -> str:
        return f"{_tcp(self.host)}:{self.port}"

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


PeerLost = Callable[[Peer], None]


def _tcp(host: str) -> str:
    return f"tcp://[{host}]" if ":" in host else f"tcp://{host}"


class PeerUnreachable(TransferError):
    """A control message could not be handed to a peer in time: no connection, or a full queue."""

    def __init__(self, peer: Peer, timeout_s: float, *, room: int | None = None) -> None:
        message = f"peer {peer} unreachable: send not accepted within {timeout_s:g} s"
        super().__init__(message, room=room, op="send")
        self.peer = peer


class _Link:
    """One peer's PUSH socket and, when watched, its monitor socket and task."""

    __slots__ = ("monitor", "push", "watcher")

    def __init__(self, push: zmq.asyncio.Socket) -> None:
        self.push = push
        self.monitor: zmq.asyncio.Socket | None = None
        self.watcher: asyncio.Task[None] | None = None


class ControlPlane(AsyncClosing):
    """One rank's control sockets: a bound PULL socket and a PUSH socket per peer.

    Use as ``async with ControlPlane(context, host=...) as control:``. ``address`` is what peers
    send to. ``send`` and ``recv`` may be called concurrently from tasks of one event loop;
    messages to one peer leave in the order of the ``send`` calls.
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        send_timeout_s: float = 1.0,
        linger_s: float = 1.0,
        max_message_bytes: int = 64 << 20,
        on_peer_lost: PeerLost | None = None,
    ) -> None:
        if send_timeout_s <= 0:
            raise ValueError(f"send_timeout_s must be > 0, got {send_timeout_s}")
        if advertise_host is None and host in _WILDCARDS:
            raise ValueError(f"binding {host!r} needs an advertise_host that peers can reach")
        self._context = context
        self._host = host
        self._port = port
        self._advertise = advertise_host or host
        self._send_timeout = send_timeout_s
        self._linger_ms = int(linger_s * 1000)
        self._max_message = max_message_bytes
        self._on_peer_lost = on_peer_lost
        self._pull: zmq.asyncio.Socket | None = None
        self._bound_port = 0
        self._links: dict[Peer, _Link] = {}

    async def __aenter__(self) -> Self:
        pull = self._context.socket(zmq.PULL)
        try:
            pull.setsockopt(zmq.LINGER, 0)
            pull.setsockopt(zmq.MAXMSGSIZE, self._max_message)
            base = "tcp://*" if self._host in _WILDCARDS else _tcp(self._host)
            if self._port:
                pull.bind(f"{base}:{self._port}")
                self._bound_port = self._port
            else:
                self._bound_port = pull.bind_to_random_port(base)
        except zmq.ZMQError as exc:
            pull.close(linger=0)
            raise TransferError(
                f"cannot bind control socket on {self._host}:{self._port}: {exc}", op="bind"
            ) from exc
        self._pull = pull
        return self

    async def aclose(self) -> None:
        """Close every socket (idempotent). Queued outgoing messages get ``linger_s`` to leave."""
        for peer in list(self._links):
            await self._close_link(peer)
        if self._pull is not None:
            self._pull.close(linger=0)
            self._pull = None

    @property
    def address(self) -> Peer:
        """The advertised host and the bound port of the PULL socket."""
        if self._pull is None:
            raise TransferError("control plane is not open", op="address")
        return Peer(self._advertise, self._bound_port)

    @property
    def send_timeout_s(self) -> float:
        return self._send_timeout

    def connect(self, peer: Peer) -> None:
        """Open (or keep) the PUSH socket to ``peer``; connecting happens in the background."""
        if peer in self._links:
            return
        if self._pull is None:
            raise TransferError("control plane is not open", op="connect")
        push = self._context.socket(zmq.PUSH)
        push.setsockopt(zmq.IMMEDIATE, 1)
        push.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_MAX_MS)
        push.setsockopt(zmq.LINGER, self._linger_ms)
        link = _Link(push)
        if self._on_peer_lost is not None:
            link.monitor = push.get_monitor_socket(_MONITOR_EVENTS)
            link.watcher = asyncio.create_task(
                self._watch(peer, link.monitor), name=f"control-monitor-{peer}"
            )
        push.connect(peer.endpoint)
        self._links[peer] = link

    async def forget(self, peer: Peer) -> None:
        """Close the PUSH socket to ``peer`` (a later ``send`` opens a new one)."""
        await self._close_link(peer)

    async def send(self, peer: Peer, msg: Message, *, timeout_s: float | None = None) -> None:
        """Hand ``msg`` to ``peer``'s connection within ``timeout_s`` (default ``send_timeout_s``).

        Raises ``PeerUnreachable`` when it could not be queued in time (the message is then not
        delivered). Returning means zmq accepted it, not that the peer has read it.
        """
        self.connect(peer)
        timeout = self._send_timeout if timeout_s is None else max(timeout_s, 0.0)
        frames = codec.encode(msg)
        room = None if isinstance(msg, RegisterKVArgs) else msg.room
        try:
            async with asyncio.timeout(timeout):
                await self._links[peer].push.send_multipart(frames, copy=False)
        except TimeoutError:
            raise PeerUnreachable(peer, timeout, room=room) from None
        except zmq.ZMQError as exc:
            raise PeerUnreachable(peer, timeout, room=room) from exc

    async def recv(self) -> Message:
        """The next message on the PULL socket.

        Raises ``ProtocolMismatch`` for frames that are not a message of our protocol version
        (the socket stays usable) and ``TransferError`` when the plane is closed.
        """
        if self._pull is None:
            raise TransferError("control plane is not open", op="recv")
        frames = await self._pull.recv_multipart(copy=True)
        return codec.decode(frames)

    async def _watch(self, peer: Peer, monitor: zmq.asyncio.Socket) -> None:
        while True:
            try:
                event = parse_monitor_message(await monitor.recv_multipart())
            except zmq.ZMQError:
                return  # the monitor was closed
            if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED and self._on_peer_lost is not None:
                logger.warning("control connection to %s lost", peer)
                try:
                    self._on_peer_lost(peer)
                except Exception:
                    logger.exception("on_peer_lost(%s) failed", peer)

    async def _close_link(self, peer: Peer) -> None:
        link = self._links.pop(peer, None)
        if link is None:
            return
        if link.watcher is not None:
            link.watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await link.watcher
        if link.monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                link.push.disable_monitor()
            link.monitor.close(linger=0)
        link.push.close(linger=self._linger_ms)
