"""``RegistrationGuard``: what a rank registration must satisfy before a rank table stores it.

Engines register without credentials, so a registration is checked against the world instead
(SGLang ``PUT /route``, vLLM ``POST /register``):

* reachable: the rank's advertised ``host:port`` accepts a TCP connection within
  ``connect_timeout_s`` (engines bind before they register), else 400;
* consistent: when the namespace belongs to a known prefill worker (``owner_hosts``: a
  ``WorkerSpec.bootstrap_namespace`` or a registry record naming it), the rank's host must be
  that worker's host: equal resolved addresses, or both on this machine (loopback aliases and
  this machine's own addresses), else 409;
* not moved: a registration that moves a registered rank (same namespace and rank) to another
  address is refused with 409 unless it carries the admin token (``Authorization: Bearer``) or
  the previous address no longer accepts connections (the engine restarted on a new port; with
  the reachability check off this cannot be told, so the move is refused). Every move is logged
  as a warning, allowed or not. Re-registering at the same address is always fine.

The check and the write are not atomic: two registrations racing for one rank are both checked
against the rank's previous address.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import socket
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address
from urllib.parse import urlsplit

from pydantic import SecretStr

from registry.errors import RegistryError
from registry.settings import RegistrySettings

__all__ = [
    "OwnerHosts",
    "RankClaim",
    "RegistrationGuard",
    "RegistrationRefused",
    "parse_tcp_address",
    "same_host",
    "tcp_problem",
]

logger = logging.getLogger(__name__)

_RESOLVE_TIMEOUT_S = 5.0  # a host name that does not resolve by then is not the owner's host
# namespace -> hosts of the prefill worker(s) it belongs to (empty: none known)
OwnerHosts = Callable[[str], Awaitable[Collection[str]]]
Address = IPv4Address | IPv6Address


class RegistrationRefused(RegistryError):
    """A registration the guard refuses; ``status`` is the HTTP answer (400 or 409)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class RankClaim:
    """One registration: ``rank`` names the rank for messages (``dp_rank=0 tp_rank=1 ...``)."""

    namespace: str
    rank: str
    host: str
    port: int
    previous: tuple[str, int] | None  # the rank's registered address, if any

    def moves(self) -> bool:
        return self.previous is not None and self.previous != (self.host, self.port)


def parse_tcp_address(addr: str) -> tuple[str, int]:
    """``tcp://host:port`` (vLLM's ``addr``; IPv6 in brackets) as (host, port); 400 otherwise."""
    try:
        parts = urlsplit(addr)
        scheme, host, port = parts.scheme, parts.hostname, parts.port
    except ValueError:
        scheme, host, port = "", None, None
    if scheme != "tcp" or not host or port is None:
        raise RegistrationRefused(f"invalid rank address {addr!r}: expected tcp://host:port", 400)
    return host, port


async def tcp_problem(host: str, port: int, timeout_s: float) -> str | None:
    """None when ``host:port`` accepts a TCP connection within ``timeout_s``, else why not."""
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(host, port)
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


def _literal(host: str) -> Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None


async def _addresses(host: str) -> set[Address]:
    literal = _literal(host)
    if literal is not None:
        return {literal}
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    found = {_literal(str(info[4][0])) for info in infos}
    return {address for address in found if address is not None}


def _on_this_machine(address: Address) -> bool:
    """Loopback, or an address this machine owns (it can bind to it)."""
    if address.is_loopback:
        return True
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((str(address), 0))
    except OSError:
        return False
    return True


async def same_host(a: str, b: str) -> bool:
    """Whether hosts ``a`` and ``b`` are one machine: a shared resolved address, or both on this
    machine. Raises ``OSError`` when a name does not resolve."""
    first, second = await _addresses(a), await _addresses(b)
    if first & second:
        return True
    both = first | second
    return bool(first and second) and all(_on_this_machine(address) for address in both)


class RegistrationGuard:
    """Checks a ``RankClaim``; raises ``RegistrationRefused`` naming why it is refused."""

    def __init__(
        self,
        *,
        check_reachable: bool = True,
        connect_timeout_s: float = 1.0,
        admin_token: SecretStr | None = None,
        owner_hosts: OwnerHosts | None = None,
    ) -> None:
        self._check_reachable = check_reachable
        self._timeout_s = connect_timeout_s
        self._token = admin_token
        self._owner_hosts = owner_hosts

    @classmethod
    def from_settings(
        cls, settings: RegistrySettings, owner_hosts: OwnerHosts | None = None
    ) -> RegistrationGuard:
        return cls(
            check_reachable=settings.bootstrap_check_reachable,
            connect_timeout_s=settings.bootstrap_connect_timeout_s,
            admin_token=settings.admin_token,
            owner_hosts=owner_hosts,
        )

    async def admit(self, claim: RankClaim, authorization: str) -> None:
        """Accept ``claim`` or raise; ``authorization`` is the request's header (may be "")."""
        await self._check_owner(claim)
        if self._check_reachable:
            problem = await tcp_problem(claim.host, claim.port, self._timeout_s)
            if problem is not None:
                raise RegistrationRefused(
                    f"rank {claim.rank} of namespace {claim.namespace!r} advertises "
                    f"{_show(claim.host, claim.port)}, which is not reachable: {problem}",
                    400,
                )
        if claim.moves():
            await self._check_move(claim, authorization)

    async def _check_owner(self, claim: RankClaim) -> None:
        owners = await self._owner_hosts(claim.namespace) if self._owner_hosts else ()
        if not owners:
            return
        for owner in owners:
            try:
                async with asyncio.timeout(_RESOLVE_TIMEOUT_S):
                    if await same_host(claim.host, owner):
                        return
            except (OSError, TimeoutError) as exc:
                reason = str(exc) or type(exc).__name__
                logger.warning("bootstrap: cannot resolve %s or %s: %s", claim.host, owner, reason)
        logger.warning(
            "bootstrap %s: refused rank %s at %s: not on the namespace's prefill host (%s)",
            claim.namespace,
            claim.rank,
            _show(claim.host, claim.port),
            ", ".join(sorted(owners)),
        )
        raise RegistrationRefused(
            f"rank {claim.rank} of namespace {claim.namespace!r} registers host {claim.host}, "
            f"but the namespace belongs to the prefill worker on {', '.join(sorted(owners))}",
            409,
        )

    async def _check_move(self, claim: RankClaim, authorization: str) -> None:
        assert claim.previous is not None
        before, after = _show(*claim.previous), _show(claim.host, claim.port)
        if self._authorized(authorization):
            why = "with the admin token"
        elif self._check_reachable and await tcp_problem(*claim.previous, self._timeout_s):
            why = "its previous address no longer answers (a restart)"
        else:
            logger.warning(
                "bootstrap %s: refused moving rank %s from %s to %s (previous address alive, "
                "no admin token)",
                claim.namespace,
                claim.rank,
                before,
                after,
            )
            raise RegistrationRefused(
                f"rank {claim.rank} of namespace {claim.namespace!r} is registered at {before}; "
                f"moving it to {after} needs the admin token (Authorization: Bearer)",
                409,
            )
        logger.warning(
            "bootstrap %s: rank %s moved from %s to %s: %s",
            claim.namespace,
            claim.rank,
            before,
            after,
            why,
        )

    def _authorized(self, authorization: str) -> bool:
        if self._token is None:
            return False
        expected = f"Bearer {self._token.get_secret_value()}"
        return secrets.compare_digest(authorization.encode(), expected.encode())


def _show(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
