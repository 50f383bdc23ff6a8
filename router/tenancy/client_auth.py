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
from collections.abc import Iterator

from pydantic import SecretStr

from router.errors import Unauthorized
from router.settings import ClientAuthSettings
from router.tenancy.client_keys import ClientKeys

__all__ = ["ClientGate", "client_gate", "reloading_on_sighup"]

_MAX_KEY_CHARS = 1024  # a longer one is no key of ours: refused without hashing it


class ClientGate:
    """Checks client keys against ``keys``; ``engine_key``: what the engines get instead."""

    def __init__(self, keys: ClientKeys, engine_key: SecretStr | None) -> None:
        self.keys = keys
        secret = None if engine_key is None else engine_key.get_secret_value()
        self.engine_authorization = None if not secret else f"Bearer {secret}"

    def tenant(self, authorization: str | None, api_key: str | None = None) -> str:
        """The caller's tenant; raises Unauthorized (its message never quotes the key)."""
        key = _bearer(authorization) if authorization is not None else api_key
        if not key:
            raise Unauthorized(
                "no API key was given: send it as 'Authorization: Bearer KEY'"
                if authorization is None
                else "the Authorization header must be 'Bearer KEY'"
            )
        tenant = self.keys.tenant_for(key) if len(key) <= _MAX_KEY_CHARS else None
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
    return ClientGate(ClientKeys(auth.api_keys, auth.reload_interval_s), auth.engine_api_key)


@contextlib.contextmanager
def reloading_on_sighup(clients: ClientGate | None) -> Iterator[None]:
    """SIGHUP rereads the keys file (with ``router --workers N`` the supervisor passes it on)."""
    if clients is None:
        yield
        return
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGHUP, clients.keys.reload)
    except RuntimeError:  # not the main thread (an embedded app): the file watch alone
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
