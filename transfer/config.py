"""Settings of the transfer roles as frozen values: what a rank endpoint needs, and each role's own.

``EndpointConfig`` is what every rank endpoint (``transfer.endpoint.RankEndpoint``) takes: where its
control socket binds and what peers are told, how long a control send may wait, and the aux buffer
it registers next to the KV pool. ``SenderConfig`` (prefill) and ``ReceiverConfig`` (decode) add the
role's own settings; they differ in one default, ``aux_slots``. Values are checked on construction
(``ValueError``); the address itself is checked when the control plane is built.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EndpointConfig", "ReceiverConfig", "SenderConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointConfig:
    """A rank endpoint: its control socket and its aux buffer.

    ``host``/``port`` is where the control socket binds (port 0: any free port) and
    ``advertise_host`` the host peers are told (required when ``host`` is a wildcard). The aux
    buffer has ``aux_slots`` slots of ``aux_item_len`` bytes; either being 0 means no aux buffer.
    A control send that is not accepted within ``send_timeout_s`` fails (the peer is unreachable).
    """

    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    aux_item_len: int = 0
    aux_slots: int = 0
    send_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if self.aux_item_len < 0 or self.aux_slots < 0:
            raise ValueError("aux_item_len and aux_slots must be >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class SenderConfig(EndpointConfig):
    """A prefill rank's sender (``transfer.sender.KVSender``).

    With ``registry`` ("host:port" or a URL) the rank publishes its control address to that
    registry's bootstrap API (under ``namespace`` when given), again every ``refresh_s`` when set.
    ``bootstrap_timeout_s`` bounds the wait for the decode's transfer info (KVPoll
    Bootstrapping), and for transfer info no request claims; ``transfer_timeout_s`` each chunk
    and an idle room between chunks. Deadlines are checked every ``reap_interval_s``. The aux
    buffer holds one staging slot per room that sends aux: ``aux_item_len`` must equal the
    decode's.
    """

    aux_slots: int = 64
    registry: str | None = None
    namespace: str | None = None
    bootstrap_timeout_s: float = 300.0
    transfer_timeout_s: float = 300.0
    refresh_s: float | None = None
    reap_interval_s: float = 0.05


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiverConfig(EndpointConfig):
    """A decode rank's receiver (``transfer.receiver.KVReceiver``).

    ``tp_rank``/``tp_size`` place the rank in its instance (it receives from the prefill rank of
    the same TP rank: no resharding) and ``kv_cache_dtype`` (None: any) must match the prefill's.
    After a failure that may leave prefill writes running, the receiver waits up to
    ``drain_timeout_s`` for the prefill to acknowledge its ``Abort``.
    """

    tp_rank: int = 0
    tp_size: int = 1
    kv_cache_dtype: str | None = None
    drain_timeout_s: float = 2.0
