"""What the registry stores about a worker, and where (the key layout)."""

from __future__ import annotations

import hashlib
import ipaddress
import re
import socket
from typing import Literal

import httpx
import msgspec

__all__ = [
    "NAMESPACE_PATTERN",
    "NAMESPACE_RE",
    "WORKERS_PREFIX",
    "WorkerRecord",
    "admin_address_problem",
    "check_worker_url",
    "decode_worker",
    "encode_worker",
    "redact_url",
    "worker_id",
    "worker_key",
]

WORKERS_PREFIX = "workers/"
# A bootstrap namespace (one prefill instance): also a path segment and a store key part.
NAMESPACE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
NAMESPACE_RE = re.compile(NAMESPACE_PATTERN)

Role = Literal["prefill", "decode"]


class WorkerRecord(msgspec.Struct, kw_only=True, frozen=True):
    """One engine instance as registered: the wire schema shared by routers and engines.

    ``epoch`` grows by one whenever the worker re-registers with a different bootstrap address or
    engine (a restart), so cached engine ids and addresses can be dropped at once.
    """

    id: str
    role: Role
    url: str
    bootstrap_port: int | None = None
    bootstrap_namespace: str | None = None  # the prefill registers its ranks with the registry
    engine: str | None = None
    draining: bool = False
    epoch: int = 1
    source: Literal["static", "admin", "engine", "kubernetes"] = "admin"
    # the prefill's KV cache event stream (DP rank 0; rank r at port + r) and its replay
    # endpoint, ``tcp://host:port``; None: not advertised (older records decode as None)
    kv_events: str | None = None
    kv_events_replay: str | None = None
    # the model names it serves; empty: not declared (the router reads the engine's /v1/models)
    models: tuple[str, ...] = ()


def worker_id(role: str, url: str) -> str:
    """A stable id: the same role and URL always name the same worker, on every router."""
    digest = hashlib.sha256(f"{role} {url.rstrip('/')}".encode()).hexdigest()
    return f"{role[0]}-{digest[:12]}"


def worker_key(worker_id: str) -> str:
    return WORKERS_PREFIX + worker_id


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(WorkerRecord)


def encode_worker(record: WorkerRecord) -> bytes:
    return _encoder.encode(record)


def decode_worker(raw: bytes) -> WorkerRecord:
    """Raises msgspec.ValidationError / DecodeError for a malformed record."""
    return _decoder.decode(raw)


_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@")


def check_worker_url(value: str) -> str:
    """``value`` without its trailing slash when it is a usable worker URL: ``http(s)://`` with a
    host, parseable by httpx (what the upstream clients use), a port in 1..65535 and no
    whitespace. Raises ValueError naming why not. Shared by the CLI, the admin API and discovery
    (a record written by an older version may not have been checked)."""
    if any(c.isspace() for c in value):
        raise ValueError(f"worker URL {redact_url(value)!r} contains whitespace")
    try:
        url = httpx.URL(value)
    except httpx.InvalidURL as exc:
        raise ValueError(f"invalid worker URL {redact_url(value)!r}: {exc}") from exc
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"worker URL must look like http://host:port, got {redact_url(value)!r}")
    if url.port is not None and not 1 <= url.port <= 65535:
        raise ValueError(f"worker URL {redact_url(value)!r} has port {url.port}, not 1..65535")
    return value.rstrip("/")


def _ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address a host literal names, in any form the resolver accepts (``2852039166`` and
    ``0xa9.0xfe.0xa9.0xfe`` are 169.254.169.254 to ``getaddrinfo``); None for a name."""
    host = host.rstrip(".").split("%", 1)[0]  # a trailing root dot, an IPv6 zone id
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def admin_address_problem(url: str) -> str | None:
    """Why a worker added at runtime (admin API, self-registration) may not live at ``url``'s
    host, or None. Link-local addresses (169.254.0.0/16, fe80::/10: cloud metadata services)
    and unspecified ones (0.0.0.0, ::) are refused there; the operator's own CLI workers may use
    any address. Host names are not resolved."""
    address = _ip_of(httpx.URL(url).host)
    if address is None:
        return None
    if address.is_unspecified:
        return f"{address} is an unspecified address, not a worker's"
    if address.is_link_local:
        return f"{address} is a link-local address (e.g. a cloud metadata service)"
    return None


def redact_url(url: str) -> str:
    """``url`` with any ``user:password@`` replaced by ``***@``: how a worker or store URL is
    shown (``/ready``, the admin API, logs). Works on unparseable URLs too."""
    return _USERINFO.sub(r"\1***@", url)
