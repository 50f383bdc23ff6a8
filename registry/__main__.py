"""``registry serve --store URL --port N``: the bootstrap registry as a process of its own.

Its engine bootstrap paths accept sources in ``--bootstrap-allow`` only (default loopback) and
check every rank registration (``registry.engine_api.rank_checks``); ``/admin`` and ``/store``
keep their own auth (``--admin-token``, else loopback only). It speaks HTTP/1.1 through h11,
which bounds a request's head and a chunked body's trailers (16 KiB: 400 beyond) and never merges
trailers into the request headers.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

import uvicorn
from pydantic import SecretStr, ValidationError

from registry.admin import DEFAULT_MAX_BODY_BYTES
from registry.app import create_registry_app
from registry.settings import DEFAULT_BOOTSTRAP_ALLOW, RegistrySettings

__all__ = ["main"]

# On SIGTERM uvicorn waits for open responses to end, and a router ends its /store/watch stream
# only at its next resync (every 10 s); cut them after this many seconds instead.
SHUTDOWN_GRACE_S = 3


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="registry", description="pd-router bootstrap registry")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the registry service")
    serve.add_argument(
        "--store",
        default="memory://",
        help="memory:// or etcd://host:2379[/prefix] (default memory://); routers reach it "
        "with --registry http://HOST:PORT",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8998)
    serve.add_argument("--admin-token", help="bearer token for /admin")
    _add_bootstrap_flags(serve)
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    token = SecretStr(args.admin_token) if args.admin_token else None
    try:
        settings = RegistrySettings(
            url=args.store,
            admin_token=token,
            bootstrap_allow=args.bootstrap_allow or DEFAULT_BOOTSTRAP_ALLOW,
            bootstrap_check_reachable=not args.no_bootstrap_reachability_check,
            bootstrap_connect_timeout_s=args.bootstrap_connect_timeout,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        serve.error(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}")
    uvicorn.run(
        create_registry_app(settings, max_body_bytes=args.max_body_bytes),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        http="h11",  # heads and trailers bounded, trailers dropped (httptools: neither)
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )


def _add_bootstrap_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--bootstrap-allow",
        action="append",
        metavar="CIDR",
        help="source network allowed on the engine bootstrap paths; repeat; replaces the "
        "default 127.0.0.0/8 and ::1/128 (others get 403)",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest accepted admin or engine API body (413 beyond; {DEFAULT_MAX_BODY_BYTES})",
    )
    serve.add_argument(
        "--bootstrap-connect-timeout",
        type=float,
        default=1.0,
        help="a registered rank's address must accept a TCP connection within this, s (1)",
    )
    serve.add_argument(
        "--no-bootstrap-reachability-check",
        action="store_true",
        help="accept rank registrations without connecting to their address",
    )


if __name__ == "__main__":
    main()
