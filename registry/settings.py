"""Registry settings: which store, how long entries live, who may call the admin API, and how the
engines' bootstrap listeners protect themselves (source allow-list, registration checks)."""

from __future__ import annotations

from ipaddress import IPv4Network, IPv6Network

from pydantic import BaseModel, Field, IPvAnyNetwork, SecretStr, model_validator

__all__ = ["DEFAULT_BOOTSTRAP_ALLOW", "RegistrySettings"]

# loopback only: the operator names the private ranges their engines live in
DEFAULT_BOOTSTRAP_ALLOW: tuple[IPv4Network | IPv6Network, ...] = (
    IPv4Network("127.0.0.0/8"),
    IPv6Network("::1/128"),
)


class RegistrySettings(BaseModel):
    """``url``: ``memory://`` (in-process, the default) or ``etcd://host:2379[/prefix]``."""

    url: str = "memory://"
    admin_token: SecretStr | None = None  # without one, only loopback clients may use /admin
    # bearer token sent to an http(s):// store (a `registry serve --admin-token` process)
    store_token: SecretStr | None = None
    ttl_s: float = Field(default=10.0, gt=0)  # lease of self-registered workers and ranks
    resync_backoff_s: float = Field(default=1.0, gt=0)  # wait before re-listing after a failure
    drain_timeout_s: float = Field(default=3600.0, gt=0)  # a draining worker is removed by then
    # namespace -> extra port serving that namespace's engine bootstrap APIs at the plain paths
    # (one per prefill instance whose engines register here: vLLM >= 0.32 and SGLang decoders
    # can only be pointed at host:port)
    bootstrap_ports: dict[str, int] = Field(default_factory=dict)
    # the router's shared bootstrap port: namespace "default" on the plain paths and every
    # namespace under /bootstrap/{ns}/...; None: none (the client port never serves them)
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    # where the bootstrap listeners bind (None: the server's --host)
    bootstrap_host: str | None = None
    # source networks allowed on the engine bootstrap APIs (others: 403 before the body is read)
    bootstrap_allow: tuple[IPvAnyNetwork, ...] = DEFAULT_BOOTSTRAP_ALLOW
    # a registered rank's address must accept a TCP connection within the timeout (else 400)
    bootstrap_check_reachable: bool = True
    bootstrap_connect_timeout_s: float = Field(default=1.0, gt=0, le=30)
    # a rank registration must come from (TCP peer address) the host of the prefill worker
    # owning its namespace, when one is known (else 409)
    bootstrap_check_source: bool = True
    # namespaces the engine bootstrap APIs create on first use; beyond: 429 (error JSON)
    max_namespaces: int = Field(default=4096, ge=1)
    # a store that suddenly lost the workers it listed is suspect (an empty or wiped etcd):
    # the router keeps the workers it knew for up to this long unless the store shows them again
    suspect_grace_s: float = Field(default=120.0, gt=0)
    # a listing removing more than this share of the (live, at least 2) discovered workers at
    # once is suspect
    suspect_removed_share: float = Field(default=0.5, gt=0, le=1)
    # a worker deleted from the store leaves after this settle time (a re-list judges deletes
    # that arrive together, like a wiped prefix, as one batch)
    removal_settle_s: float = Field(default=0.25, gt=0, le=10)
    # the host decoders use to reach this process's bootstrap APIs (default: the listen host, or
    # this machine's name when listening on a wildcard address)
    advertise_host: str | None = None

    @model_validator(mode="after")
    def _distinct_bootstrap_ports(self) -> RegistrySettings:
        ports = list(self.bootstrap_ports.values())
        if self.bootstrap_port is not None:
            ports.append(self.bootstrap_port)
        if len(set(ports)) != len(ports):
            raise ValueError(f"bootstrap ports must be distinct, got {sorted(ports)}")
        return self
