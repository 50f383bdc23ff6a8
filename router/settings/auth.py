"""Who may call the router's client API: API keys mapped to tenants (``router.tenancy``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, SecretStr

from router.settings.flags import DOCUMENTED, PositiveFloat, cli

__all__ = ["ClientAuthSettings"]


class ClientAuthSettings(BaseModel):
    """Client authentication, off until a keys file is given. The client's key is never sent
    to an engine: the engines get ``engine_api_key`` (or no ``Authorization`` at all)."""

    model_config = DOCUMENTED

    api_keys: Path | None = Field(default=None, json_schema_extra=cli("--api-keys", metavar="FILE"))
    """a YAML or TOML file of tenants and their API keys (`tenants: {NAME: {keys: [...]}}`,
    a key in plain text or as `sha256:HEX`): every completion, pass-through and `/v1/models`
    request then needs one (`Authorization: Bearer KEY`; on `/v1/messages` also `x-api-key`),
    else 401; reread on SIGHUP and when the file changes"""
    engine_api_key: SecretStr | None = Field(
        default=None, json_schema_extra=cli("--engine-api-key", metavar="KEY")
    )
    """the `Authorization: Bearer` the engines get (their `--api-key`): on the router's reads
    of their `/v1/models`, and with `--api-keys` on every request in place of the client's;
    unset: none (without `--api-keys` the client's own header goes to the engines, as before)"""
    reload_interval_s: PositiveFloat = Field(
        default=2.0, json_schema_extra=cli("--api-keys-reload-interval")
    )
    """how often the keys file is checked for a change, s"""
    rate_limit_storage: str = Field(
        default="memory://", json_schema_extra=cli("--rate-limit-storage", metavar="URL")
    )
    """where the tenants' request and token counts live (`limits` storage URLs): `memory://`
    (this process alone), or `redis://HOST:PORT` for replicas sharing every tenant's limits"""
    default_max_tokens: int = Field(
        default=256, gt=0, json_schema_extra=cli("--tenant-default-max-tokens")
    )
    """the output tokens a request without `max_tokens` (`max_completion_tokens`,
    `max_output_tokens`) is charged on admission, until its usage corrects it"""
