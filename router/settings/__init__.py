"""One typed settings tree for the router: env (``PDR_`` prefix, ``__`` nesting) < CLI flags.

A field's docstring is its help text; its ``json_schema_extra`` says how the command line sets
it (:func:`cli`) or why only the environment does (:func:`env_only`). ``router.server.cli``
builds the flags from them, ``router.server.settings_reference`` docs/configuration.md.

The sections live in modules by concern: ``flags`` (those two helpers), ``server`` (the HTTP
server's bounds, admission), ``upstream`` (connections, load, health, breakers), ``outlier``
(request-path ejection), ``scheduling`` (policies, the KV-cache-aware choice), ``discovery``
(the workers and where they come from), ``observability`` (logs, traffic, tracing),
``features`` (switches for the CPU ledger), ``replicas`` (the replicas' sync),
``registry_flags`` (the router's flags for ``registry.settings``) and ``root``
(:class:`RouterSettings`); this module re-exports them.
"""

from __future__ import annotations

from router.settings.auth import ClientAuthSettings
from router.settings.discovery import EngineProtocol, KubernetesDiscoverySettings, WorkerSpec
from router.settings.features import FeatureSettings
from router.settings.flags import cli, env_only
from router.settings.observability import LoggingSettings, ObservabilitySettings, TracingSettings
from router.settings.outlier import OutlierSettings
from router.settings.replicas import ReplicaSettings
from router.settings.root import RouterSettings
from router.settings.scheduling import CacheAwareSettings, PolicySettings, SessionSettings
from router.settings.server import AdmissionSettings, ServerSettings
from router.settings.upstream import (
    CircuitBreakerSettings,
    HealthSettings,
    LoadSettings,
    UpstreamSettings,
)

__all__ = [
    "AdmissionSettings",
    "CacheAwareSettings",
    "ClientAuthSettings",
    "CircuitBreakerSettings",
    "EngineProtocol",
    "FeatureSettings",
    "HealthSettings",
    "KubernetesDiscoverySettings",
    "LoadSettings",
    "ReplicaSettings",
    "LoggingSettings",
    "ObservabilitySettings",
    "OutlierSettings",
    "PolicySettings",
    "RouterSettings",
    "ServerSettings",
    "SessionSettings",
    "TracingSettings",
    "UpstreamSettings",
    "WorkerSpec",
    "cli",
    "env_only",
]
