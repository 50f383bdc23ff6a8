"""Listening sockets made by the router itself rather than by uvicorn: with ``--workers N``
every process binds the client port (and the bootstrap ports) with SO_REUSEPORT, so that the
kernel spreads new connections over the processes evenly, or takes the one socket its
supervisor bound (``--worker-sockets shared``)."""

from __future__ import annotations

import socket

__all__ = ["BACKLOG", "listening_socket", "reserved_port"]

BACKLOG = 4096  # as the router's own uvicorn config


def _bound(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def listening_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A listening TCP socket on ``host:port``, non-blocking, inheritable by nobody."""
    sock = _bound(host, port, reuse_port=reuse_port)
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


def reserved_port(host: str, port: int) -> socket.socket:
    """A socket bound with SO_REUSEPORT but not listening: it holds ``port`` (a port 0 is
    resolved) for the processes that bind it with SO_REUSEPORT too, and takes no connection."""
    return _bound(host, port, reuse_port=True)
