"""Command line: flags compatible with vLLM's PD proxy and sglang-router, mapped onto settings."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from pydantic import ValidationError

from router.policies import POLICIES
from router.settings import EngineProtocol, RouterSettings

__all__ = ["parse_args"]

# settings path -> the flag that sets it, for one-line error messages
_FLAG_OF = {
    ("prefill",): "--prefill",
    ("decode",): "--decode",
    ("server", "host"): "--host",
    ("server", "port"): "--port",
    ("server", "max_body_bytes"): "--max-body-bytes",
    ("upstream", "connect_timeout_s"): "--connect-timeout",
    ("upstream", "read_timeout_s"): "--read-timeout",
    ("upstream", "prefill_timeout_s"): "--prefill-timeout",
    ("upstream", "kv_arrival_timeout_s"): "--kv-arrival-timeout",
    ("upstream", "max_retries"): "--max-retries",
    ("upstream", "client"): "--upstream-client",
    ("health", "interval_s"): "--health-interval",
    ("health", "timeout_s"): "--health-timeout",
    ("health", "failure_threshold"): "--health-failure-threshold",
    ("health", "unhealthy_threshold"): "--health-unhealthy-threshold",
    ("health", "healthy_threshold"): "--health-healthy-threshold",
    ("logging", "level"): "--log-level",
    ("registry", "url"): "--registry",
    ("registry", "admin_token"): "--admin-token",
    ("registry", "advertise_host"): "--advertise-host",
    ("registry", "bootstrap_ports"): "--bootstrap-namespace",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line naming the flag, as argparse phrases it, then exit 2."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def _build_parser() -> _Parser:
    p = _Parser(prog="router", description="OpenAI-compatible prefill/decode router")
    p.add_argument(
        "--prefill",
        action="append",
        nargs="+",
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="prefill worker URL and optional bootstrap port (int or 'none'); repeat",
    )
    p.add_argument("--decode", action="append", metavar="URL", help="decode worker URL; repeat")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default 8000)")
    p.add_argument(
        "--engine",
        choices=[e.value for e in EngineProtocol],
        help="PD protocol of the engines (default vllm-mooncake)",
    )
    p.add_argument("--policy", choices=list(POLICIES), help="policy for both roles")
    p.add_argument("--prefill-policy", choices=list(POLICIES), help="policy for prefill")
    p.add_argument("--decode-policy", choices=list(POLICIES), help="policy for decode")
    p.add_argument("--connect-timeout", type=float, help="upstream connect timeout, s")
    p.add_argument("--read-timeout", type=float, help="upstream idle time between reads, s")
    p.add_argument("--prefill-timeout", type=float, help="total time for a prefill leg, s")
    p.add_argument(
        "--kv-arrival-timeout",
        type=float,
        help="deadline for a streaming decode's first byte after its prefill answered, s "
        "(default 30)",
    )
    p.add_argument("--max-retries", type=int, help="retries on connect errors")
    p.add_argument(
        "--upstream-client",
        choices=["aiohttp", "httpx"],
        help="HTTP client for engine calls (default aiohttp)",
    )
    p.add_argument("--max-body-bytes", type=int, help="largest accepted request body")
    p.add_argument("--health-interval", type=float, help="seconds between health probes")
    p.add_argument("--health-timeout", type=float, help="health probe timeout, s")
    p.add_argument(
        "--health-failure-threshold",
        type=int,
        help="consecutive failed requests that mark a worker unhealthy",
    )
    p.add_argument(
        "--health-unhealthy-threshold",
        type=int,
        help="consecutive failed probes that mark a worker unhealthy (default 3; a refused "
        "connection counts as all of them)",
    )
    p.add_argument(
        "--health-healthy-threshold",
        type=int,
        help="consecutive good probes that bring an unhealthy worker back (default 2)",
    )
    p.add_argument(
        "--registry",
        metavar="URL",
        help="worker registry store: memory:// (default, in-process), "
        "etcd://host:2379[/prefix], or http://host:port (a `registry serve` process) "
        "to share workers between routers",
    )
    p.add_argument(
        "--admin-token", help="bearer token for /admin (prefer PDR_REGISTRY__ADMIN_TOKEN)"
    )
    p.add_argument(
        "--bootstrap-namespace",
        action="append",
        metavar="NAME=PORT",
        help="serve namespace NAME's engine bootstrap APIs on an extra PORT; repeat",
    )
    p.add_argument(
        "--advertise-host",
        help="host decoders use to reach this router's bootstrap APIs "
        "(default: --host, or the hostname when listening on a wildcard address)",
    )
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    return p


def _prefill_spec(parser: _Parser, values: list[str]) -> dict[str, Any]:
    if len(values) > 2:
        parser.error(f"argument --prefill: expected URL [BOOTSTRAP_PORT], got {' '.join(values)}")
    spec: dict[str, Any] = {"url": values[0]}
    if len(values) == 2 and values[1].startswith("ns:"):
        spec["bootstrap_namespace"] = values[1][3:]
    elif len(values) == 2 and values[1].lower() != "none":
        if not values[1].isdigit():
            parser.error(
                f"argument --prefill: invalid bootstrap port {values[1]!r} (an integer or 'none')"
            )
        spec["bootstrap_port"] = int(values[1])
    return spec


def _namespace_ports(parser: _Parser, items: list[str]) -> dict[str, int]:
    ports: dict[str, int] = {}
    for item in items:
        name, _, port = item.partition("=")
        if not name or not port.isdigit():
            parser.error(f"argument --bootstrap-namespace: expected NAME=PORT, got {item!r}")
        ports[name] = int(port)
    return ports


def _overrides(parser: _Parser, args: argparse.Namespace) -> dict[str, Any]:
    """Only the flags the user gave, nested like the settings tree."""
    out: dict[str, Any] = {}
    if args.prefill:
        out["prefill"] = [_prefill_spec(parser, values) for values in args.prefill]
    if args.decode:
        out["decode"] = [{"url": url} for url in args.decode]
    if args.engine:
        out["engine"] = args.engine
    for path, flag in _FLAG_OF.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if len(path) == 2 and value is not None and path != ("registry", "bootstrap_ports"):
            out.setdefault(path[0], {})[path[1]] = value
    if args.bootstrap_namespace:
        out.setdefault("registry", {})["bootstrap_ports"] = _namespace_ports(
            parser, args.bootstrap_namespace
        )
    for name in ("policy", "prefill_policy", "decode_policy"):
        if getattr(args, name):
            out.setdefault("policy", {})[name] = getattr(args, name)
    return out


def _flag_for(loc: Sequence[Any]) -> str:
    for size in (2, 1):
        flag = _FLAG_OF.get(tuple(str(part) for part in loc[:size]))
        if flag:
            return flag
    return "PDR_" + "__".join(str(part) for part in loc).upper()


def parse_args(argv: Sequence[str] | None = None) -> RouterSettings:
    """Settings from env (``PDR_*``) overridden by ``argv``; exits 2 with one line on error."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return RouterSettings(**_overrides(parser, args))
    except ValidationError as exc:
        first = exc.errors()[0]
        message = first["msg"].removeprefix("Value error, ")
        parser.error(f"argument {_flag_for(first['loc'])}: {message}")


if __name__ == "__main__":  # pragma: no cover
    print(parse_args(sys.argv[1:]))
