"""``registry serve --store URL --port N``: the bootstrap registry as a process of its own."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

import uvicorn
from pydantic import SecretStr

from registry.app import create_registry_app
from registry.settings import RegistrySettings

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
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    token = SecretStr(args.admin_token) if args.admin_token else None
    settings = RegistrySettings(url=args.store, admin_token=token)
    uvicorn.run(
        create_registry_app(settings),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )


if __name__ == "__main__":
    main()
