"""The router's flags for the fields of ``registry.settings`` (registry/ may not import router).

``registry serve`` has flags of its own for the same fields (``--store`` for ``url``), so they
are declared here rather than next to the fields.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel
from pydantic.config import JsonDict

from registry.settings import RegistrySettings
from router.settings.flags import cli, env_only

__all__ = ["EXTERNAL"]

_REGISTRY_TIMING = "registry timing, rarely tuned"

_REGISTRY_CLI: dict[str, JsonDict] = {
    "url": cli(
        "--registry",
        metavar="URL",
        help="worker registry store: `memory://` (in-process), `etcd://host:2379[/prefix]`, "
        "or `http://host:port` (a `registry serve` process) to share workers between routers",
    ),
    "admin_token": cli(
        "--admin-token",
        help="bearer token for `/admin` (none: loopback clients only); prefer the env variable",
    ),
    "store_token": cli(
        "--registry-token",
        help="bearer token sent to an `http(s)://` registry (one started with `--admin-token`); "
        "prefer the env variable",
    ),
    "ttl_s": env_only(_REGISTRY_TIMING, help="lease of self-registered workers and ranks, s"),
    "resync_backoff_s": env_only(
        _REGISTRY_TIMING, help="wait before re-listing the store after a failure, s"
    ),
    "drain_timeout_s": env_only(_REGISTRY_TIMING, help="a draining worker is removed by then, s"),
    "bootstrap_ports": cli(
        "--bootstrap-namespace",
        metavar="NAME=PORT",
        repeat=True,
        adapter="name_ports",
        help="serve namespace NAME's engine bootstrap APIs on an extra PORT",
    ),
    "bootstrap_port": cli(
        "--bootstrap-port",
        help="serve the engine bootstrap APIs (namespace `default` on the plain paths, any "
        "other under `/bootstrap/NS/...`) on this port; the client port never serves them",
    ),
    "bootstrap_host": cli(
        "--bootstrap-host", default="--host", help="address the bootstrap ports listen on"
    ),
    "bootstrap_allow": cli(
        "--bootstrap-allow",
        metavar="CIDR",
        repeat=True,
        help="source network allowed on the bootstrap ports; replaces the default (add "
        "127.0.0.0/8 to keep loopback); others get 403 before their body is read",
    ),
    "bootstrap_check_reachable": cli(
        "--no-bootstrap-reachability-check",
        switch=False,
        help="a registered rank's address must accept a TCP connection; the flag skips that "
        "check (when the router cannot reach the engines' KV ports): a moved rank then always "
        "needs the admin token",
    ),
    "bootstrap_connect_timeout_s": cli(
        "--bootstrap-connect-timeout",
        help="a registered rank's address must accept a TCP connection within this, s",
    ),
    "bootstrap_check_source": cli(
        "--no-bootstrap-source-check",
        switch=False,
        help="a rank registration must come from the host of the prefill worker owning its "
        "namespace (when one is known); the flag skips that check (when engines reach the "
        "router through NAT or a proxy)",
    ),
    "max_namespaces": cli(
        "--max-bootstrap-namespaces",
        help="namespaces the engine bootstrap APIs hold at most; a registration creating one "
        "more is refused with 429",
    ),
    "suspect_grace_s": cli(
        "--registry-suspect-grace",
        help="when the store suddenly lost the workers it listed (an empty or wiped etcd), keep "
        "them this long unless it shows them again, s",
    ),
    "suspect_removed_share": env_only(
        _REGISTRY_TIMING,
        help="a listing removing more than this share of the live discovered workers (at least "
        "2) at once is suspect",
    ),
    "removal_settle_s": env_only(
        _REGISTRY_TIMING,
        help="a worker deleted from the store leaves after this, s (deletes arriving together "
        "are judged as one batch)",
    ),
    "advertise_host": cli(
        "--advertise-host",
        default="`--host`, or the hostname on a wildcard address",
        help="host decoders use to reach this router's bootstrap APIs",
    ),
}

# section model declared in another package -> (its description, its fields' ``cli`` /
# ``env_only`` declarations)
EXTERNAL: dict[type[BaseModel], tuple[str, Mapping[str, JsonDict]]] = {
    RegistrySettings: (
        "The worker registry (``registry``): where workers and engine ranks register, the "
        "admin API's token, and the engine bootstrap APIs this router serves.",
        _REGISTRY_CLI,
    ),
}
