"""How the router reaches the Kubernetes API: a private client ``Configuration`` and a namespace.

A kubeconfig given by the operator wins; else, in a pod (``KubernetesDiscoverySettings.
in_cluster``), the pod's service account (whose token the client re-reads as it rotates); else
``$KUBECONFIG`` or ``~/.kube/config``. The configuration is loaded into an object of our own:
the client library's process-wide default is never set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes_asyncio.client import Configuration
from kubernetes_asyncio.config import ConfigException, load_incluster_config, load_kube_config

from router.settings import KubernetesDiscoverySettings

__all__ = ["SERVICE_ACCOUNT_NAMESPACE", "ClusterAccess", "KubeConfigError", "cluster_access"]

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class KubeConfigError(RuntimeError):
    """The API server's address or credentials cannot be loaded; the message says from where."""


@dataclass(frozen=True, slots=True)
class ClusterAccess:
    configuration: Configuration
    namespace: str  # where the engine pods are watched


async def cluster_access(
    settings: KubernetesDiscoverySettings,
    *,
    service_account_namespace: Path = SERVICE_ACCOUNT_NAMESPACE,
) -> ClusterAccess:
    """Load the configuration ``settings`` names; raises KubeConfigError. The namespace is
    ``settings.namespace``, else the kubeconfig context's (in a pod: the pod's own), else
    ``default``."""
    configuration = Configuration()
    if settings.kubeconfig is None and settings.in_cluster:
        try:
            load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except (ConfigException, OSError) as exc:
            raise KubeConfigError(f"in-cluster Kubernetes config: {exc}") from exc
        found = _read_namespace(service_account_namespace)
    else:
        source = settings.kubeconfig or "$KUBECONFIG or ~/.kube/config"
        _check_exists(settings.kubeconfig)
        try:
            loader = await load_kube_config(
                config_file=settings.kubeconfig,
                client_configuration=configuration,
                persist_config=False,  # never rewrite the operator's file
            )
        except (ConfigException, OSError, ValueError, TypeError) as exc:
            raise KubeConfigError(f"kubeconfig {source}: {exc}") from exc
        found = _context_namespace(loader.current_context)
    return ClusterAccess(configuration, settings.namespace or found or "default")


def _check_exists(kubeconfig: str | None) -> None:
    """Once, at start-up (the client library reads the file synchronously too): its own error
    for a missing file names a missing key instead."""
    if kubeconfig is not None and not Path(kubeconfig).is_file():
        raise KubeConfigError(f"kubeconfig {kubeconfig}: no such file")


def _read_namespace(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _context_namespace(context: Any) -> str | None:
    details = context.get("context") if isinstance(context, dict) else None
    namespace = details.get("namespace") if isinstance(details, dict) else None
    return namespace if isinstance(namespace, str) and namespace else None
