"""Routing state shared by router replicas (hosts, pods) so that they route as one.

Each replica publishes, every ``interval_s``, a snapshot of its own state on a ZeroMQ PUB socket
(``--replica-listen``): per worker and DP rank its legs in flight and the prompt tokens its
prefill legs there are predicted to compute, and its admission units in use. It subscribes to
every peer's (``--replica-peer``) and keeps the latest snapshot of each. A worker's counts
(``Worker.rank_load``, ``pending_tokens``, ``host_inflight``: the caps and every load-aware
policy) and the admission gate then add the peers' to its own.

Not best effort, and bounded:
- A snapshot carries the sender's whole state, not a change: a lost one is repaired by the next
  (``interval_s`` later), a replica that joins or restarts has its peers' state within one
  interval, and nothing is ever re-sent or replayed. Each replica still knows what it missed:
  snapshots carry a sequence number per sender run (``epoch``), gaps are counted per peer, a
  new epoch (the peer restarted) replaces its state at once.
- What a replica routes with is at most ``interval_s`` plus the network's delay old
  (``age_s`` per peer on the status page and in the metrics; ``lag_s``: a snapshot's age on
  arrival, by the sender's clock). Within that window a burst may reach the same worker
  from two replicas: at most what one replica admits in ``interval_s``.
- A peer silent for ``stale_s`` (dead, cut off) no longer counts: its last counts are dropped
  rather than held forever, this replica keeps routing on its own state and says it is
  degraded (``/ready`` details, the status page) until it hears the peer again. A connection
  cut without a reset (a partition) is found by heartbeats and dialled again
  (``_bound_connections``): the peer is heard again within a few ``stale_s`` of the link healing.
- Every message carries an HMAC-SHA256 under ``--replica-token``; one without a valid one is
  dropped and counted (``rejected``): nobody without the token changes routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import logging
import operator
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import zmq

from router.fleet.host_counts import add_counts, host_counts
from router.fleet.shared_breakers import BreakerVerdict
from router.load_board import LEGS, TOKENS
from router.settings.replicas import ReplicaSettings, split_address
from router.workers import Worker, format_host
from router.zmq_inbox import read_forever

__all__ = ["LoadSnapshot", "Note", "PeerState", "ReplicaSync"]

logger = logging.getLogger(__name__)

MAC_BYTES = 32  # HMAC-SHA256
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # a larger one is dropped by ZeroMQ
SEND_HWM = 100  # snapshots queued for a slow peer before older ones are dropped
HEARTBEAT_TIMEOUTS = 2  # x stale_s: a silent connection, a dial or a handshake given up after
FORGET_AFTER_STALE = 30  # x stale_s: a peer not heard that long is forgotten (scaled away)
_FIELDS = {LEGS: 0, TOKENS: 1}  # the board fields a snapshot carries, and where


class _Finder(Protocol):
    async def run(self) -> None: ...


class LoadSnapshot(msgspec.Struct, array_like=True, tag="loads"):
    """One replica's routing state at ``sent`` (its ``time.time()``)."""

    replica: str
    epoch: float  # when the sending replica started: a new run, a new sequence
    seq: int
    sent: float
    units: int  # admission units in use
    # worker id -> [legs in flight per DP rank, pending prefill tokens per DP rank]
    workers: dict[str, tuple[list[int], list[int]]]


class Note(msgspec.Struct, array_like=True, tag="note"):
    """One replica's advice, in the same sequence as its snapshots (a lost one is counted in
    ``gaps`` and costs what not sharing it costs): ``body`` is one of the kinds the sync was
    made for, a tagged struct: a breaker verdict (the peer's own breaker still opens on its own
    failures), a predicted KV entry (``router.kv_cache.shared_predictions``; it expires anyway)."""

    replica: str
    epoch: float
    seq: int
    sent: float
    body: msgspec.Raw


@dataclass
class PeerState:
    """What this replica knows of one peer (by the name it publishes as)."""

    replica: str
    epoch: float = 0.0
    seq: int = 0
    received_at: float | None = None  # time.monotonic() of its last snapshot
    lag_s: float | None = None
    gaps: int = 0
    restarts: int = 0
    units: int = 0
    workers: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)

    def fresh(self, now: float, stale_s: float) -> bool:
        return self.received_at is not None and now - self.received_at < stale_s

    def view(self, now: float, stale_s: float) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "fresh": self.fresh(now, stale_s),
            "age_s": None if self.received_at is None else round(now - self.received_at, 3),
            "lag_s": None if self.lag_s is None else round(self.lag_s, 4),
            "seq": self.seq,
            "gaps": self.gaps,
            "restarts": self.restarts,
        }


class ReplicaSync:
    """This replica's end of the sync: publishes its state, follows its peers'. With ``router
    --workers N`` each process follows the peers and process 0 alone (``publishes``) binds the
    replica's address and publishes the host's counts (every process's, from the load board)."""

    def __init__(
        self,
        settings: ReplicaSettings,
        workers: Callable[[], Iterable[Worker]],
        *,
        publishes: bool = True,
        kinds: tuple[type[msgspec.Struct], ...] = (BreakerVerdict,),
    ) -> None:
        """``kinds``: the tagged structs that travel as notes (``publish``, ``on``)."""
        assert settings.listen is not None and settings.token is not None
        self._settings = settings
        self._workers = workers
        self.publishes = publishes
        # this replica's admission units in use (the admission gate's, the host's with
        # --workers N, once it exists)
        self.own_units: Callable[[], int] = lambda: 0
        # what finds the peers beyond the static list (router.fleet.replica_peers), if anything
        self.finder: _Finder | None = None
        self._key = settings.token.get_secret_value().encode()
        self._epoch = time.time()
        self._seq = 0
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(LoadSnapshot | Note).decode
        union: Any = functools.reduce(operator.or_, kinds)
        self._body = msgspec.msgpack.Decoder(union).decode
        self._handlers: dict[type[msgspec.Struct], Callable[[Any], None]] = {}
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.IPV6, 1)
        _bound_connections(self._pub, settings.stale_s)
        if publishes:
            self._pub.bind(_endpoint(settings.listen))
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.IPV6, 1)
        _bound_connections(self._sub, settings.stale_s)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._addresses: set[str] = set()  # the peers' addresses followed now
        self.set_peers(settings.peers)
        self.peers: dict[str, PeerState] = {}  # by the name each publishes as
        # the fresh peers' counts summed: worker id -> [legs per rank, tokens per rank]
        self._totals: dict[str, tuple[list[int], list[int]]] = {}
        self._peer_units = 0
        self.sent = self.received = self.rejected = 0

    # --- what routing reads -----------------------------------------------------------------

    def count(self, worker_id: str, rank: int, board_field: int) -> int:
        """The fresh peers' count of ``board_field`` (LEGS, TOKENS) at a worker's rank."""
        totals = self._totals.get(worker_id)
        index = _FIELDS.get(board_field)
        if totals is None or index is None:
            return 0
        ranks = totals[index]
        return ranks[rank] if rank < len(ranks) else 0

    def units(self) -> int:
        """The fresh peers' admission units in use."""
        return self._peer_units

    def degraded(self) -> str | None:
        """Why this replica routes on less than every peer's state (None: it does not): a
        configured peer not heard within ``stale_s``."""
        return self._degraded(self._fresh_count())

    def _degraded(self, fresh: int) -> str | None:
        expected = len(self._addresses)
        if fresh >= expected:
            return None
        stale_s = self._settings.stale_s
        return f"{expected - fresh} of {expected} replica peer(s) not heard within {stale_s:g}s"

    def _fresh_count(self) -> int:
        now, stale_s = time.monotonic(), self._settings.stale_s
        return sum(1 for peer in self.peers.values() if peer.fresh(now, stale_s))

    def stats(self) -> dict[str, Any]:
        now, stale_s = time.monotonic(), self._settings.stale_s
        return {
            "replica": self._settings.id,
            "listen": self._settings.listen,
            "publishes": self.publishes,  # router --workers N: process 0 alone
            "sent": self.sent,
            "received": self.received,
            "rejected": self.rejected,
            "peer_addresses": sorted(self._addresses),
            "degraded": self.degraded(),
            "peers": [peer.view(now, stale_s) for peer in self.peers.values()],
        }

    def summary(self) -> dict[str, Any]:
        """Whether this process publishes, the peers it hears now, and why it is degraded."""
        fresh = self._fresh_count()
        return {"publishes": self.publishes, "fresh": fresh, "degraded": self._degraded(fresh)}

    def set_peers(self, addresses: Iterable[str]) -> None:
        """Follow these peers (``HOST:PORT``), and no others; this replica's own address is
        left out (a DNS name of every replica resolves to it too)."""
        wanted = set(addresses) - {self._settings.listen}
        for address in wanted - self._addresses:
            self._sub.connect(_endpoint(address))
        for address in self._addresses - wanted:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disconnect(_endpoint(address))
        self._addresses = wanted

    # --- the loops --------------------------------------------------------------------------

    async def run(self) -> None:
        """Publish and follow (and find the peers: ``finder``) until cancelled."""
        loops = [asyncio.create_task(self._publish_loop())]
        if self.finder is not None:
            loops.append(asyncio.create_task(self.finder.run()))
        try:
            await read_forever(self._sub, self.receive, self._settings.interval_s)
        finally:
            for loop in loops:
                loop.cancel()
            await asyncio.gather(*loops, return_exceptions=True)

    async def _publish_loop(self) -> None:
        while True:
            self.publish_state()
            self.expire()
            await asyncio.sleep(self._settings.interval_s)

    def publish_state(self) -> None:
        """Send this replica's state now (a full send buffer drops it: the next repairs it)."""
        if not self.publishes:
            return
        self._seq += 1
        workers = {w.id: host_counts(w) for w in self._workers()}
        own = self._settings.id, self._epoch, self._seq, time.time()
        self._send(LoadSnapshot(*own, self.own_units(), workers))

    def publish(self, body: msgspec.Struct) -> None:
        """Tell the peers a note (a breaker verdict, ``router.fleet.shared_breakers``; a
        prediction); only the publishing process sends."""
        if not self.publishes:
            return
        self._seq += 1
        raw = msgspec.Raw(self._encode(body))
        self._send(Note(self._settings.id, self._epoch, self._seq, time.time(), raw))

    def on(self, kind: type[msgspec.Struct], handler: Callable[[Any], None]) -> None:
        """Call ``handler`` with each peer's note of type ``kind``."""
        self._handlers[kind] = handler

    def _send(self, message: LoadSnapshot | Note) -> None:
        if not self.publishes:
            return
        payload = self._encode(message)
        try:
            self._pub.send(self.mac(self._key, payload) + payload, zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            pass

    def receive(self, frame: bytes) -> None:
        """One peer's message: checked, counted, taken (``run``'s; tests call it)."""
        mac, payload = frame[:MAC_BYTES], frame[MAC_BYTES:]
        if not hmac.compare_digest(mac, self.mac(self._key, payload)):
            self.rejected += 1
            return
        try:
            message = self._decode(payload)
            body: msgspec.Struct | None = None
            if isinstance(message, Note):
                body = self._body(message.body)
        except msgspec.DecodeError as exc:
            self.rejected += 1
            logger.warning("a replica's message could not be read: %s", exc)
            return
        peer = self._in_sequence(message)
        if peer is None:
            return
        self.received += 1
        if isinstance(message, LoadSnapshot):
            peer.units, peer.workers = message.units, message.workers
            self._sum()
        elif body is not None and (handler := self._handlers.get(type(body))) is not None:
            handler(body)

    def _in_sequence(self, message: LoadSnapshot | Note) -> PeerState | None:
        """The sender's state, its sequence, gaps, restarts and lag noted; None for our own
        message or old news."""
        if message.replica == self._settings.id:
            return None  # our own (a peer list naming this replica)
        peer = self.peers.get(message.replica)
        if peer is None:
            peer = self.peers[message.replica] = PeerState(message.replica)
        if message.epoch != peer.epoch:
            if peer.epoch:
                peer.restarts += 1
            peer.epoch, peer.seq = message.epoch, message.seq - 1
        if message.seq <= peer.seq:
            return None  # old news
        peer.gaps += message.seq - peer.seq - 1 if peer.received_at is not None else 0
        peer.seq = message.seq
        peer.received_at = time.monotonic()
        peer.lag_s = max(time.time() - message.sent, 0.0)
        return peer

    def expire(self) -> None:
        """Drop the counts of peers gone stale (called every interval), and forget a peer not
        heard for ``FORGET_AFTER_STALE`` times ``stale_s`` (a replica scaled away)."""
        now, stale_s = time.monotonic(), self._settings.stale_s
        forget = now - FORGET_AFTER_STALE * stale_s
        gone = [name for name, p in self.peers.items() if (p.received_at or now) < forget]
        for name in gone:
            del self.peers[name]
        if any(p.workers and not p.fresh(now, stale_s) for p in self.peers.values()):
            for peer in self.peers.values():
                if not peer.fresh(now, stale_s):
                    peer.workers, peer.units = {}, 0
            self._sum()

    def close(self) -> None:
        self._pub.close()
        self._sub.close()
        self._context.term()

    # --- inside -----------------------------------------------------------------------------

    @staticmethod
    def mac(key: bytes, payload: bytes) -> bytes:
        """A message's HMAC-SHA256 under ``key`` (what precedes its payload)."""
        return hmac.new(key, payload, hashlib.sha256).digest()

    def _sum(self) -> None:
        totals: dict[str, tuple[list[int], list[int]]] = {}
        units = 0
        for peer in self.peers.values():
            units += peer.units
            for worker_id, (legs, tokens) in peer.workers.items():
                mine = totals.get(worker_id)
                if mine is None:
                    totals[worker_id] = (list(legs), list(tokens))
                    continue
                add_counts(mine[0], legs)
                add_counts(mine[1], tokens)
        self._totals, self._peer_units = totals, units


def _bound_connections(socket: zmq.Socket[bytes], stale_s: float) -> None:
    """A connection that stops carrying anything (a partition drops packets, no reset comes) is
    found by ZMTP heartbeats within ``HEARTBEAT_TIMEOUTS`` x ``stale_s`` and closed (a SUB dials
    again); a dial or a handshake that hangs gives up as soon: a healed link carries the peer's
    state again within a few ``stale_s``, not a TCP retransmission timeout (minutes) later."""
    limit_ms = int(HEARTBEAT_TIMEOUTS * stale_s * 1000)
    socket.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(stale_s * 1000 / 2)))
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, limit_ms)
    socket.setsockopt(zmq.CONNECT_TIMEOUT, limit_ms)
    socket.setsockopt(zmq.HANDSHAKE_IVL, limit_ms)


def _endpoint(address: str) -> str:
    host, port = split_address(address)
    return f"tcp://{format_host(host)}:{port}"
