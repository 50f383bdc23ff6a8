"""Command line: flags compatible with vLLM's PD proxy and sglang-router, mapped onto settings."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from pydantic import ValidationError

from router.scheduling.policies import POLICIES
from router.settings import EngineProtocol, RouterSettings

__all__ = ["parse_args"]

# settings path -> the flag that sets it, for one-line error messages
_FLAG_OF = {
    ("prefill",): "--prefill",
    ("decode",): "--decode",
    ("server", "host"): "--host",
    ("server", "port"): "--port",
    ("server", "max_body_bytes"): "--max-body-bytes",
    ("server", "graceful_shutdown_s"): "--shutdown-grace",
    ("server", "max_n"): "--max-n",
    ("server", "max_batch"): "--max-batch",
    ("server", "max_sequences"): "--max-sequences",
    ("server", "max_request_id_bytes"): "--max-request-id-bytes",
    ("server", "max_header_bytes"): "--max-header-bytes",
    ("server", "header_timeout_s"): "--header-timeout",
    ("server", "body_timeout_s"): "--body-timeout",
    ("server", "max_connections"): "--max-connections",
    ("upstream", "connect_timeout_s"): "--connect-timeout",
    ("upstream", "read_timeout_s"): "--read-timeout",
    ("upstream", "prefill_timeout_s"): "--prefill-timeout",
    ("upstream", "kv_arrival_timeout_s"): "--kv-arrival-timeout",
    ("upstream", "max_retries"): "--max-retries",
    ("upstream", "client"): "--upstream-client",
    ("admission", "max_concurrent_requests"): "--max-concurrent-requests",
    ("admission", "max_queued_requests"): "--max-queued-requests",
    ("admission", "queue_timeout_s"): "--queue-timeout",
    ("admission", "max_inflight_per_worker"): "--max-inflight-per-worker",
    ("admission", "max_inflight_per_prefill"): "--max-inflight-per-prefill",
    ("admission", "max_inflight_per_decode"): "--max-inflight-per-decode",
    ("admission", "capacity_backoff_s"): "--capacity-backoff",
    ("health", "interval_s"): "--health-interval",
    ("health", "timeout_s"): "--health-timeout",
    ("health", "failure_threshold"): "--health-failure-threshold",
    ("health", "unhealthy_threshold"): "--health-unhealthy-threshold",
    ("health", "healthy_threshold"): "--health-healthy-threshold",
    ("breaker", "open_s"): "--breaker-open",
    ("breaker", "max_open_s"): "--breaker-max-open",
    ("breaker", "pair_failure_threshold"): "--pair-failure-threshold",
    ("logging", "level"): "--log-level",
    ("load", "interval_s"): "--load-interval",
    ("load", "timeout_s"): "--load-timeout",
    ("load", "stale_after_s"): "--load-stale-after",
    ("cache", "tokenizer"): "--tokenizer",
    ("cache", "render_url"): "--render-url",
    ("cache", "kv_events_port"): "--kv-events-port",
    ("cache", "kv_events_replay_port"): "--kv-events-replay-port",
    ("cache", "max_indexed_blocks"): "--max-indexed-blocks",
    ("cache", "prediction_ttl_s"): "--prediction-ttl",
    ("cache", "cache_threshold"): "--cache-threshold",
    ("cache", "tier_weights"): "--cache-tier-weights",
    ("cache", "balance_abs_threshold"): "--balance-abs-threshold",
    ("cache", "balance_rel_threshold"): "--balance-rel-threshold",
    ("cache", "approx_tree_max_chars"): "--approx-tree-max-chars",
    ("cache", "tokenize_cache_entries"): "--tokenize-cache-entries",
    ("cache", "pd_min_uncached_tokens"): "--pd-min-uncached-tokens",
    ("cache", "prefill_saturated_waiting"): "--prefill-saturated-waiting",
    ("registry", "url"): "--registry",
    ("registry", "admin_token"): "--admin-token",
    ("registry", "advertise_host"): "--advertise-host",
    ("registry", "bootstrap_ports"): "--bootstrap-namespace",
    ("registry", "bootstrap_port"): "--bootstrap-port",
    ("registry", "bootstrap_host"): "--bootstrap-host",
    ("registry", "bootstrap_allow"): "--bootstrap-allow",
    ("registry", "bootstrap_connect_timeout_s"): "--bootstrap-connect-timeout",
    ("observability", "recompute_min_ratio"): "--recompute-min-ratio",
    ("observability", "suspect_window_s"): "--suspect-window",
    ("tracing", "otlp_endpoint"): "--otlp-endpoint",
    ("tracing", "service_name"): "--otel-service-name",
    ("tracing", "sample_ratio"): "--trace-sample-ratio",
    ("discovery",): "--discovery",
    ("kubernetes",): "--discovery",
    ("kubernetes", "namespace"): "--k8s-namespace",
    ("kubernetes", "prefill_selector"): "--k8s-prefill-selector",
    ("kubernetes", "decode_selector"): "--k8s-decode-selector",
    ("kubernetes", "kubeconfig"): "--k8s-kubeconfig",
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
        help="prefill worker URL, optional bootstrap port (int or 'none') and KV event "
        "endpoints events=tcp://HOST:PORT replay=tcp://HOST:PORT; repeat",
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
    p.add_argument(
        "--max-header-bytes",
        type=int,
        help="largest request line + headers; beyond it 431 (65536)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        help="seconds a request's headers may take from their first byte; then 408 (10)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        help="seconds a request body may go without data; then 408 (30)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        help="open client connections; more are answered 503 (default: from the fd limit)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        help="on SIGTERM, seconds requests in flight get to finish before they are ended with "
        "an error (30)",
    )
    p.add_argument("--max-n", type=int, help="largest accepted 'n' (128)")
    p.add_argument(
        "--max-batch", type=int, help="most prompts in one batched /v1/completions request (256)"
    )
    p.add_argument(
        "--max-sequences", type=int, help="most sequences (n x prompts) in one request (1024)"
    )
    p.add_argument(
        "--max-request-id-bytes",
        type=int,
        help="longest accepted X-Request-Id (256; printable ASCII only)",
    )
    p.add_argument("--health-interval", type=float, help="seconds between health probes")
    p.add_argument("--health-timeout", type=float, help="health probe timeout, s")
    p.add_argument(
        "--health-failure-threshold",
        type=int,
        help="consecutive failed requests (5xx, timeouts, connection errors) that open a "
        "worker's circuit breaker: it gets no traffic until a trial request succeeds (3)",
    )
    p.add_argument(
        "--breaker-open",
        type=float,
        help="seconds an open circuit breaker waits before one trial request; doubled after "
        "each failed trial (5)",
    )
    p.add_argument(
        "--breaker-max-open", type=float, help="cap on a circuit breaker's back-off, s (60)"
    )
    p.add_argument(
        "--pair-failure-threshold",
        type=int,
        help="consecutive failed KV transfers that open a prefill->decode pair's circuit "
        "breaker: the pair is avoided while another exists (3; 0: no pair breakers)",
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
        "--bootstrap-port",
        type=int,
        help="serve the engine bootstrap APIs (namespace default on the plain paths, any "
        "other under /bootstrap/NS/...) on this PORT (default: none; never the client port)",
    )
    p.add_argument(
        "--bootstrap-host", help="address the bootstrap ports listen on (default: --host)"
    )
    p.add_argument(
        "--bootstrap-allow",
        action="append",
        metavar="CIDR",
        help="source network allowed on the bootstrap ports; repeat; replaces the default "
        "127.0.0.0/8 and ::1/128 (others get 403)",
    )
    p.add_argument(
        "--bootstrap-connect-timeout",
        type=float,
        help="a registered rank's address must accept a TCP connection within this, s (1)",
    )
    p.add_argument(
        "--no-bootstrap-reachability-check",
        action="store_true",
        help="accept rank registrations without connecting to their address (when the router "
        "cannot reach the engines' KV ports); a moved rank then always needs the admin token",
    )
    p.add_argument(
        "--advertise-host",
        help="host decoders use to reach this router's bootstrap APIs "
        "(default: --host, or the hostname when listening on a wildcard address)",
    )
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    _add_scheduling_flags(p)
    _add_observability_flags(p)
    _add_admission_flags(p)
    _add_kubernetes_flags(p)
    return p


def _add_kubernetes_flags(p: _Parser) -> None:
    """Workers from the Ready pods of a Kubernetes namespace (``router.fleet.kube``)."""
    p.add_argument(
        "--discovery",
        choices=["static", "k8s"],
        help="k8s: also follow the Ready pods matching --k8s-prefill-selector and "
        "--k8s-decode-selector as workers (default static: --prefill/--decode and the registry)",
    )
    p.add_argument(
        "--k8s-namespace",
        help="namespace of the engine pods (default: the kubeconfig context's, or in a pod its "
        "own, else default)",
    )
    p.add_argument(
        "--k8s-prefill-selector", metavar="SELECTOR", help="label selector of the prefill pods"
    )
    p.add_argument(
        "--k8s-decode-selector", metavar="SELECTOR", help="label selector of the decode pods"
    )
    p.add_argument(
        "--k8s-kubeconfig",
        metavar="PATH",
        help="kubeconfig to reach the API server (default: in-cluster in a pod, else "
        "$KUBECONFIG or ~/.kube/config)",
    )


def _add_observability_flags(p: _Parser) -> None:
    """ "PD did not happen" detection and OpenTelemetry tracing."""
    p.add_argument(
        "--recompute-min-ratio",
        type=float,
        help="a decode that computed this share of the prompt itself counts as a PD recompute "
        "(0.5)",
    )
    p.add_argument(
        "--suspect-window",
        type=float,
        help="a P<->D pair stays suspect this long after its last recompute, s (300)",
    )
    p.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="export OpenTelemetry spans (route, prefill, decode) to this OTLP/HTTP collector "
        "(needs pd-router[otel])",
    )
    p.add_argument("--otel-service-name", help="service.name of the spans (pd-router)")
    p.add_argument(
        "--trace-sample-ratio",
        type=float,
        help="share of traces the router starts that are sampled (1.0); a client's "
        "traceparent decides for its own",
    )


def _add_admission_flags(p: _Parser) -> None:
    """Overload: admission control, per-worker in-flight caps, capacity back-off."""
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        help="completion requests served at once; more wait in a queue (1024; 0: no limit)",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        help="requests waiting for a slot; beyond it 429 with Retry-After at once (2048)",
    )
    p.add_argument(
        "--queue-timeout", type=float, help="a request queued this long gets 429, s (30)"
    )
    p.add_argument(
        "--max-inflight-per-worker",
        type=int,
        help="legs one worker may have in flight from this router; at the cap it is no "
        "candidate, with every candidate at it the request gets 429 (0: no cap)",
    )
    p.add_argument("--max-inflight-per-prefill", type=int, help="the same for prefill workers only")
    p.add_argument("--max-inflight-per-decode", type=int, help="the same for decode workers only")
    p.add_argument(
        "--capacity-backoff",
        type=float,
        help="a worker that answered 429/503 (full) is avoided this long while another "
        "candidate exists, s (1; 0: never)",
    )


def _add_scheduling_flags(p: _Parser) -> None:
    """Engine load polling and KV-cache-aware routing."""
    p.add_argument(
        "--load-interval", type=float, help="seconds between engine load reads (0: never; 1)"
    )
    p.add_argument("--load-timeout", type=float, help="engine load read timeout, s (1)")
    p.add_argument(
        "--load-stale-after", type=float, help="an engine load older than this is unknown, s (5)"
    )
    p.add_argument(
        "--tokenizer", metavar="DIR", help="the engines' Hugging Face tokenizer directory"
    )
    p.add_argument(
        "--render-url",
        metavar="URL",
        help="tokenize with this vLLM engine's render endpoint instead of --tokenizer",
    )
    p.add_argument(
        "--kv-events-port",
        type=int,
        help="KV event port of every prefill (on its URL's host; DP rank r at PORT+r)",
    )
    p.add_argument(
        "--kv-events-replay-port", type=int, help="KV event replay port of every prefill"
    )
    p.add_argument(
        "--max-indexed-blocks", type=int, help="cap on KV blocks indexed, all workers (4000000)"
    )
    p.add_argument(
        "--prediction-ttl", type=float, help="lifetime of predicted cache entries, s (2)"
    )
    p.add_argument(
        "--cache-threshold",
        type=float,
        help="cache_aware: a cached prefix counts only when it covers at least this fraction of "
        "the prompt (0.3); below it the rank with the least queued prefill work wins",
    )
    p.add_argument(
        "--cache-tier-weights",
        metavar="TIER=WEIGHT,...",
        help="cache_aware with a tiered KV cache: what a cached block only in host memory "
        "(CPU_PINNED, or CPU) or on DISK counts for, a GPU block being 1 "
        "(e.g. CPU_PINNED=0.9,DISK=0.7, the defaults; each 0..1)",
    )
    p.add_argument(
        "--balance-abs-threshold",
        type=float,
        help="cache_aware: load wins when max-min load exceeds this (32) ...",
    )
    p.add_argument(
        "--balance-rel-threshold",
        type=float,
        help="... and the max load exceeds this times the min (1.5)",
    )
    p.add_argument(
        "--approx-tree-max-chars",
        type=int,
        help="approximate cache_aware: prefix tree size cap per worker, chars",
    )
    p.add_argument(
        "--tokenize-cache-entries", type=int, help="cached tokenized prompt segments (8192)"
    )
    p.add_argument(
        "--pd-min-uncached-tokens",
        type=int,
        help="vLLM: fewer predicted uncached prompt tokens skip the prefill leg (0: never)",
    )
    p.add_argument(
        "--prefill-saturated-waiting",
        type=int,
        help="vLLM: when every prefill has this many waiting requests, skip the prefill leg",
    )


def _prefill_spec(parser: _Parser, values: list[str]) -> dict[str, Any]:
    """``URL [BOOTSTRAP_PORT|none|ns:NAME] [events=tcp://H:P] [replay=tcp://H:P]``."""
    named = {"events": "kv_events", "replay": "kv_events_replay"}
    spec: dict[str, Any] = {"url": values[0]}
    positional = []
    for value in values[1:]:
        key, sep, rest = value.partition("=")
        if sep and key in named:
            spec[named[key]] = rest
        else:
            positional.append(value)
    if len(positional) > 1:
        parser.error(
            "argument --prefill: expected URL [BOOTSTRAP_PORT] [events=ENDPOINT] "
            f"[replay=ENDPOINT], got {' '.join(values)}"
        )
    port = positional[0] if positional else "none"
    if port.startswith("ns:"):
        spec["bootstrap_namespace"] = port[3:]
    elif port.lower() != "none":
        if not port.isdigit():
            parser.error(
                f"argument --prefill: invalid bootstrap port {port!r} (an integer or 'none')"
            )
        spec["bootstrap_port"] = int(port)
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
    if args.discovery:
        out["discovery"] = args.discovery
    for path, flag in _FLAG_OF.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if len(path) == 2 and value is not None and path != ("registry", "bootstrap_ports"):
            out.setdefault(path[0], {})[path[1]] = value
    if args.bootstrap_namespace:
        out.setdefault("registry", {})["bootstrap_ports"] = _namespace_ports(
            parser, args.bootstrap_namespace
        )
    if args.no_bootstrap_reachability_check:
        out.setdefault("registry", {})["bootstrap_check_reachable"] = False
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
