"""Engine-side KV transfer library: a prefill rank writes a request's KV pages into a decode rank.

Modules (import from them; this package exports nothing itself):

* ``sender``: ``KVSender``, the prefill role (a room's transfer info, chunk writes, status).
* ``receiver``: ``KVReceiver``, the decode role (lookup, registration, transfer info, outcome).
* ``config``: ``EndpointConfig``, ``SenderConfig``, ``ReceiverConfig``: the roles' settings.
* ``endpoint``: ``RankEndpoint``, what a rank of either role owns: control plane, rendezvous
  client, KV pool and aux buffer registered with the engine.
* ``room_ledger``: ``RoomLedger``, a prefill rank's rooms (early info, tombstones, draining
  writes); ``receive_ledger``: ``ReceiveLedger``, a decode rank's rooms in progress.
* ``decode_link``: ``DecodeLink``, a prefill rank's control messages from decode ranks and the
  statuses it pushes to them; ``prefill_peers``: ``PrefillPeers``, a decode rank's lookup of and
  registration with prefill ranks.
* ``chunk_writer``: ``ChunkWriter``, a prefill chunk's pages and aux slot as engine writes.
* ``sessions``: ``DecodeSessions``, the decode sessions registered with a prefill rank.
* ``rendezvous``: ``RendezvousClient``, prefill ranks publish and decode ranks find each other's
  control address through the registry's engine bootstrap APIs (SGLang and vLLM).
* ``control``: ``ControlPlane``, the zmq control sockets; ``messages`` + ``codec``: the typed,
  versioned control messages and their frames.
* ``page_layout``: ``KVPageLayout`` and the pure address arithmetic of paged KV pools.
* ``state``: ``KVPoll`` and the per-room state machine with deadlines (``RoomTable``).
* ``memory``: ``RegisteredBuffers``; ``stats``: counters; ``closing``: ``async with`` plumbing.
* ``errors``: the ``TransferError`` exception tree.
* ``engine/``: the ``TransferEngine`` seam, ``MooncakeEngine`` and the in-process
  ``LoopbackEngine``; ``events/``: KV cache event publisher and subscriber.
"""

from __future__ import annotations

__all__: list[str] = []
