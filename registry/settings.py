"""Registry settings: which store, how long entries live, who may call the admin API."""

from __future__ import annotations

from pydantic import BaseModel, Field, SecretStr

__all__ = ["RegistrySettings"]


class RegistrySettings(BaseModel):
    """``url``: ``memory://`` (in-process, the default) or ``etcd://host:2379[/prefix]``."""

    url: str = "memory://"
    admin_token: SecretStr | None = None  # without one, only loopback clients may use /admin
    ttl_s: float = Field(default=10.0, gt=0)  # lease of self-registered workers and ranks
    resync_backoff_s: float = Field(default=1.0, gt=0)  # wait before re-listing after a failure
    drain_timeout_s: float = Field(default=3600.0, gt=0)  # a draining worker is removed by then
    # namespace -> extra port serving that namespace's engine bootstrap APIs at the plain paths
    # (one per prefill instance whose engines register here: vLLM >= 0.32 and SGLang decoders
    # can only be pointed at host:port)
    bootstrap_ports: dict[str, int] = Field(default_factory=dict)
    # the host decoders use to reach this process's bootstrap APIs (default: the listen host, or
    # this machine's name when listening on a wildcard address)
    advertise_host: str | None = None
