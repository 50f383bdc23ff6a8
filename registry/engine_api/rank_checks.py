"""``RegistrationGuard``: what a rank registration must satisfy before a rank table stores it.

Engines register without credentials, so a registration is checked against the world instead
(SGLang ``PUT /route``, vLLM ``POST /register``):

* reachable: the rank's advertised ``host:port`` accepts a TCP connection within
  ``connect_timeout_s`` (engines bind before they register), else 400;
* tied to its prefill: when the namespace belongs to a known prefill worker (``owner_hosts``:
  a ``WorkerSpec.bootstrap_namespace`` or a registry record naming it), the rank's host *and*
  the registration's source (the TCP peer address, which a body cannot fake) must be that
  worker's host: equal resolved addresses, or both on this machine (loopback aliases and this
  machine's own addresses), else 409. Real engines allow both: each rank registers its own
  address from its own process (SGLang ``PUT /route``, vLLM ``POST /register``), on the
  prefill's host. The source check can be turned off (``bootstrap_check_source``) where engines
  reach the registry through NAT or a proxy;
* a squatter gives way: a rank registered at an address off the owner's host (before the owner
  was known, or by an older version) is replaced by a registration that passes the checks above,
  even while its address is alive: ``admit`` says so and the table drops the squatter's entry;
* not moved: otherwise a registration that moves a registered rank (same namespace and rank) to
  another address is refused with 409 unless it carries the admin token (``Authorization:
  Bearer``) or the previous address no longer accepts connections (the engine restarted on a new
  port; with the reachability check off this cannot be told, so the move is refused). Every move
  is logged as a warning, allowed or not. Re-registering at the same address is always fine.

Without credentials the machine is the unit of trust: two processes on the prefill's own host
cannot be told apart, so there the first registration of a rank keeps it until its address dies
(or the admin token moves it).

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
    source: str | None = None  # the registering connection's peer address (None: unknown)

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
        check_source: bool = True,
    ) -> None:
        self._check_reachable = check_reachable
        self._check_source = check_source
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
            check_source=settings.bootstrap_check_source,
        )

    async def admit(self, claim: RankClaim, authorization: str) -> bool:
        """Accept ``claim`` or raise; ``authorization`` is the request's header (may be "").

        True when it replaces a squatter (a rank registered off the owner's host): the table must
        then drop that registration instead of refusing the new one."""
        owners = await self._owner_hosts(claim.namespace) if self._owner_hosts else ()
        if owners:
            await self._check_owner(claim, owners)
        if self._check_reachable:
            problem = await tcp_problem(claim.host, claim.port, self._timeout_s)
            if problem is not None:
                raise RegistrationRefused(
                    f"rank {claim.rank} of namespace {claim.namespace!r} advertises "
                    f"{_show(claim.host, claim.port)}, which is not reachable: {problem}",
                    400,
                )
        if claim.previous is None or not claim.moves():
            return False
        if owners and not await _on_owner_host(claim.previous[0], owners):
            logger.warning(
                "bootstrap %s: rank %s registered at %s, off the prefill's host (%s): replaced by "
                "%s",
                claim.namespace,
                claim.rank,
                _show(*claim.previous),
                ", ".join(sorted(owners)),
                _show(claim.host, claim.port),
            )
            return True
        await self._check_move(claim, authorization)
        return False

    async def _check_owner(self, claim: RankClaim, owners: Collection[str]) -> None:
        source = claim.source if self._check_source else None
        if source is not None and not await _on_owner_host(source, owners):
            logger.warning(
                "bootstrap %s: refused rank %s registered from %s: not the namespace's prefill "
                "host (%s)",
                claim.namespace,
                claim.rank,
                source,
                ", ".join(sorted(owners)),
            )
            raise RegistrationRefused(
                f"rank {claim.rank} of namespace {claim.namespace!r} is registered from {source}, "
                f"but the namespace belongs to the prefill worker on {', '.join(sorted(owners))}: "
                "a rank registers from its prefill's host",
                409,
            )
        if await _on_owner_host(claim.host, owners):
            return
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


async def _on_owner_host(host: str, owners: Collection[str]) -> bool:
    """Whether ``host`` is the host of one of ``owners`` (a name that does not resolve: not)."""
    for owner in owners:
        try:
            async with asyncio.timeout(_RESOLVE_TIMEOUT_S):
                if await same_host(host, owner):
                    return True
        except (OSError, TimeoutError) as exc:
            reason = str(exc) or type(exc).__name__
            logger.warning("bootstrap: cannot resolve %s or %s: %s", host, owner, reason)
    return False


def _show(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
