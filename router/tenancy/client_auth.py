"""A client request's tenant, from its API key (``--api-keys``; ``router.tenancy.client_keys``).

``Authorization: Bearer KEY`` on every client route; on ``/v1/messages`` Anthropic's
``x-api-key: KEY`` too. A request without a key, or with one the table does not hold, is a 401
(before its body is read). The client's key goes no further: the engines get
``engine_authorization`` (``--engine-api-key``) or no ``Authorization`` at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator

from pydantic import SecretStr

from router.errors import Unauthorized
from router.settings import ClientAuthSettings
from router.tenancy.client_keys import ClientKeys, KeyTable
from router.tenancy.limiter import TenantLimiter, TenantLimits

__all__ = ["ClientGate", "client_gate", "limits_of", "serving_clients"]

_MAX_KEY_CHARS = 1024  # a longer one is no key of ours: refused without hashing it


class ClientGate:
    """Checks client keys against ``keys``; ``engine_key``: what the engines get instead;
    ``limiter``: the tenants' limits (from the keys file, following its reloads)."""

    def __init__(
        self,
        keys: ClientKeys,
        engine_key: SecretStr | None,
        limiter: TenantLimiter | None = None,
        default_max_tokens: int = 256,
    ) -> None:
        self.keys = keys
        secret = None if engine_key is None else engine_key.get_secret_value()
        self.engine_authorization = None if not secret else f"Bearer {secret}"
        self.limiter = limiter
        self.default_max_tokens = default_max_tokens
        if limiter is not None:
            keys.on_reload = lambda table: limiter.replace_limits(limits_of(table))

    async def aclose(self) -> None:
        if self.limiter is not None:
            await self.limiter.aclose()

    def tenant(self, authorization: str | None, api_key: str | None = None) -> str:
        """The caller's tenant; raises Unauthorized (its message never quotes the key)."""
        if authorization is None:
            key = api_key
        elif authorization.startswith("Bearer "):  # the usual spelling: the same key, sooner
            key = authorization[7:].strip()
        else:
            key = _bearer(authorization)
        if not key:
            raise Unauthorized(
                "no API key was given: send it as 'Authorization: Bearer KEY'"
                if authorization is None
                else "the Authorization header must be 'Bearer KEY'"
            )
        tenant = self.keys.table.tenant_for(key) if len(key) <= _MAX_KEY_CHARS else None
        if tenant is None:
            raise Unauthorized("incorrect API key provided")
        return tenant


def _bearer(authorization: str) -> str | None:
    scheme, _, key = authorization.strip().partition(" ")
    return key.strip() if scheme.lower() == "bearer" else None


def client_gate(auth: ClientAuthSettings) -> ClientGate | None:
    """The gate of ``--api-keys`` (None: off); raises KeyFileError for a file it cannot load."""
    if auth.api_keys is None:
        return None
    keys = ClientKeys(auth.api_keys, auth.reload_interval_s)
    limiter = TenantLimiter(limits_of(keys.table), auth.rate_limit_storage)
    return ClientGate(keys, auth.engine_api_key, limiter, auth.default_max_tokens)


def limits_of(table: KeyTable) -> dict[str, TenantLimits]:
    """Each tenant's limits, as its entry in the keys file gives them."""
    return {
        name: TenantLimits(spec.requests_per_minute, spec.tokens_per_minute, spec.max_concurrent)
        for name, spec in table.specs.items()
    }


@contextlib.asynccontextmanager
async def serving_clients(clients: ClientGate | None) -> AsyncIterator[None]:
    """While the router serves: SIGHUP rereads the keys file (with ``router --workers N`` the
    supervisor passes it on); at the end the limits' storage is closed."""
    if clients is None:
        yield
        return
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGHUP, clients.keys.reload)
        handled = True
    except RuntimeError:  # not the main thread (an embedded app): the file watch alone
        handled = False
    try:
        yield
    finally:
        if handled:
            loop.remove_signal_handler(signal.SIGHUP)
        await clients.aclose()
