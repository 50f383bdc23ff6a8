"""Router replicas that route as one: the sync of their routing state
(``router.fleet.replica_sync``)."""

from __future__ import annotations

import os
import socket

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator

from router.settings.flags import DOCUMENTED, TUNING, PositiveFloat, cli

__all__ = ["MIN_TOKEN_CHARS", "ReplicaSettings", "split_address"]

MIN_TOKEN_CHARS = 16


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT``) -> (host, port); ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host, int(port)


class ReplicaSettings(BaseModel):
    """Several router replicas (hosts, pods) share what each routes with: per-rank in-flight
    legs and pending prefill tokens, and admission units in use. Each publishes its own state on
    `--replica-listen` every `interval_s` and follows its peers' (`--replica-peers`); a peer
    silent for `stale_s` no longer counts, and this replica reports itself degraded."""

    model_config = DOCUMENTED

    listen: str | None = Field(default=None, json_schema_extra=cli("--replica-listen"))
    """`HOST:PORT` this replica publishes its routing state on (ZeroMQ over TCP); unset: no
    replica sync"""
    peers: list[str] = Field(
        default_factory=list,
        json_schema_extra=cli("--replica-peer", metavar="HOST:PORT", repeat=True),
    )
    """another replica's `--replica-listen` address (repeat the flag per peer)"""
    peers_dns: str | None = Field(default=None, json_schema_extra=cli("--replica-peers-dns"))
    """`NAME:PORT`: the peers are every address NAME resolves to (a Kubernetes headless Service
    of the router pods), looked up every `dns_interval_s`; this replica's own `--replica-listen`
    address is left out, so listen on the pod's IP (`$(POD_IP):PORT`)"""
    id: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        json_schema_extra=cli("--replica-id", default="HOSTNAME-PID"),
    )
    """this replica's name among its peers (unique)"""
    token: SecretStr | None = Field(default=None, json_schema_extra=cli("--replica-token"))
    """shared secret of the replicas (at least 16 characters; required with `--replica-listen`):
    every message carries its HMAC-SHA256, and one without a valid one is dropped, so nobody
    without it can change this replica's routing"""
    interval_s: PositiveFloat = Field(default=0.05, json_schema_extra=TUNING)
    """how often a replica publishes its state (the counts a peer routes with are at most this
    old, plus the network's delay)"""
    stale_s: PositiveFloat = Field(default=1.0, json_schema_extra=TUNING)
    """a peer silent this long no longer counts (its last counts are dropped) and this replica
    reports itself degraded (`/ready` details, the status page) until it hears it again"""

    peers_registry: bool = Field(
        default=False, json_schema_extra=cli("--replica-peers-registry", switch=True)
    )
    """find the peers through the router's shared registry (`--registry etcd://...` or a
    `registry serve`): each replica registers its `--replica-listen` address there under a lease
    (`registry.ttl_s`) and follows every address registered"""
    dns_interval_s: PositiveFloat = Field(default=2.0, json_schema_extra=TUNING)
    """how often `--replica-peers-dns` and the registry are looked at again"""

    @field_validator("listen", "peers_dns")
    @classmethod
    def _check_listen(cls, value: str | None) -> str | None:
        if value is not None:
            split_address(value)
        return value

    @field_validator("peers")
    @classmethod
    def _check_peers(cls, value: list[str]) -> list[str]:
        for address in value:
            split_address(address)
        return value

    @model_validator(mode="after")
    def _check_sync(self) -> ReplicaSettings:
        if self.listen is None:
            if self.peers or self.peers_dns or self.peers_registry:
                raise ValueError(
                    "--replica-peer, --replica-peers-dns and --replica-peers-registry need "
                    "--replica-listen (this replica's own address)"
                )
            return self
        token = self.token.get_secret_value() if self.token is not None else ""
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(
                f"--replica-listen needs --replica-token of at least {MIN_TOKEN_CHARS} "
                "characters (PDR_REPLICAS__TOKEN): peers' messages change routing"
            )
        if self.stale_s <= self.interval_s:
            raise ValueError("replicas.stale_s must be longer than replicas.interval_s")
        return self
