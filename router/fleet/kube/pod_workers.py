"""One pod -> one worker: the annotation contract between engine pods and the router (pure).

The annotations (the deploy manifests use the same names)::

    pd-router.io/http-port              the engine's HTTP port; default: the first container
                                        port named "http"; neither: the pod is skipped
    pd-router.io/bootstrap-port         prefill bootstrap port (``sglang.ai/bootstrap-port``,
                                        SGLang Model Gateway's name, is accepted too); absent: None
    pd-router.io/bootstrap-namespace    the prefill registers its ranks with the router under this
                                        namespace (like ``--prefill URL ns:NAME``)
    pd-router.io/kv-events-port         the prefill's KV event stream: tcp://<podIP>:<port>
    pd-router.io/kv-events-replay-port  ... and its replay endpoint

The worker URL is ``http://<podIP>:<port>`` (an IPv6 address in brackets). A pod is Ready when
its phase is Running, it has a pod IP and no deletionTimestamp, and its ``Ready`` condition is
``"True"``. A decode pod's bootstrap and KV event annotations are ignored.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Literal

from kubernetes_asyncio.client import V1Pod

from registry.models import NAMESPACE_RE
from router.workers import format_host

__all__ = [
    "BOOTSTRAP_NAMESPACE",
    "BOOTSTRAP_PORT",
    "HTTP_PORT",
    "KV_EVENTS_PORT",
    "KV_EVENTS_REPLAY_PORT",
    "SGLANG_BOOTSTRAP_PORT",
    "PodSkipped",
    "PodWorker",
    "not_ready_reason",
    "pod_name",
    "worker_from_pod",
]

HTTP_PORT = "pd-router.io/http-port"
BOOTSTRAP_PORT = "pd-router.io/bootstrap-port"
SGLANG_BOOTSTRAP_PORT = "sglang.ai/bootstrap-port"
BOOTSTRAP_NAMESPACE = "pd-router.io/bootstrap-namespace"
KV_EVENTS_PORT = "pd-router.io/kv-events-port"
KV_EVENTS_REPLAY_PORT = "pd-router.io/kv-events-replay-port"
# the models the pod serves: the annotation (comma-separated names, any characters), else the
# label (one name, in a label's alphabet); neither: the router reads its /v1/models
MODELS = "pd-router.io/models"
MODEL_LABEL = "pd-router.io/model"

Role = Literal["prefill", "decode"]


class PodSkipped(ValueError):
    """The pod cannot become a worker (a bad or missing annotation); the message says why."""


@dataclass(frozen=True, slots=True)
class PodWorker:
    """The worker a pod stands for. ``not_ready``: why it must get no requests (None: Ready)."""

    role: Role
    url: str
    bootstrap_port: int | None = None
    bootstrap_namespace: str | None = None
    kv_events: str | None = None
    kv_events_replay: str | None = None
    not_ready: str | None = None
    models: tuple[str, ...] = ()

    @property
    def ready(self) -> bool:
        return self.not_ready is None


def pod_name(pod: V1Pod) -> str:
    """``namespace/name``, as logs name a pod."""
    meta = pod.metadata
    return f"{meta.namespace or ''}/{meta.name or ''}" if meta is not None else "?/?"


def worker_from_pod(pod: V1Pod, role: Role) -> PodWorker | None:
    """The worker ``pod`` stands for as a ``role`` worker, Ready or not; None while the pod has
    no IP (nothing to address yet). Raises PodSkipped naming the annotation that is wrong."""
    address = pod.status.pod_ip if pod.status is not None else None
    if not address:
        return None
    host = _host(address)
    annotations = (pod.metadata.annotations if pod.metadata is not None else None) or {}
    port = _annotated_port(annotations, HTTP_PORT) or _named_container_port(pod, "http")
    if port is None:
        raise PodSkipped(f"no {HTTP_PORT} annotation and no container port named 'http'")
    url = f"http://{host}:{port}"
    not_ready = not_ready_reason(pod)
    models = _models(pod, annotations)
    if role == "decode":
        return PodWorker(role, url, not_ready=not_ready, models=models)
    bootstrap_port = _annotated_port(annotations, BOOTSTRAP_PORT)
    if bootstrap_port is None:
        bootstrap_port = _annotated_port(annotations, SGLANG_BOOTSTRAP_PORT)
    events = _annotated_port(annotations, KV_EVENTS_PORT)
    replay = _annotated_port(annotations, KV_EVENTS_REPLAY_PORT)
    return PodWorker(
        role,
        url,
        bootstrap_port=bootstrap_port,
        bootstrap_namespace=_bootstrap_namespace(annotations),
        kv_events=None if events is None else f"tcp://{host}:{events}",
        kv_events_replay=None if replay is None else f"tcp://{host}:{replay}",
        not_ready=not_ready,
        models=models,
    )


def _models(pod: V1Pod, annotations: dict[str, str]) -> tuple[str, ...]:
    listed = annotations.get(MODELS)
    if listed is None:
        labels = (pod.metadata.labels if pod.metadata is not None else None) or {}
        listed = labels.get(MODEL_LABEL, "")
    return tuple(name.strip() for name in listed.split(",") if name.strip())[:64]


def not_ready_reason(pod: V1Pod) -> str | None:
    """Why ``pod`` must get no requests (terminating, not Running, no IP, not Ready), or None."""
    if pod.metadata is not None and pod.metadata.deletion_timestamp is not None:
        return "terminating (deletionTimestamp set)"
    status = pod.status
    if status is None or status.phase != "Running":
        return f"phase {status.phase if status is not None else None}"
    if not status.pod_ip:
        return "no pod IP"
    ready = next((c for c in status.conditions or () if c.type == "Ready"), None)
    if ready is None:
        return "no Ready condition"
    if ready.status != "True":
        detail = f": {ready.reason}" if ready.reason else ""
        return f"condition Ready is {ready.status}{detail}"
    return None


def _host(address: str) -> str:
    try:
        ipaddress.ip_address(address)
    except ValueError as exc:
        raise PodSkipped(f"pod IP {address!r} is not an IP address") from exc
    return format_host(address)


def _annotated_port(annotations: dict[str, str], key: str) -> int | None:
    value = annotations.get(key)
    if value is None:
        return None
    text = value.strip()
    if not (text.isascii() and text.isdigit() and 1 <= int(text) <= 65535):
        raise PodSkipped(f"annotation {key}={value!r} is not a port number (1..65535)")
    return int(text)


def _named_container_port(pod: V1Pod, name: str) -> int | None:
    containers = pod.spec.containers if pod.spec is not None else None
    for container in containers or ():
        for port in container.ports or ():
            if port.name == name:
                return int(port.container_port)
    return None


def _bootstrap_namespace(annotations: dict[str, str]) -> str | None:
    value = annotations.get(BOOTSTRAP_NAMESPACE)
    if value is not None and not NAMESPACE_RE.fullmatch(value):
        raise PodSkipped(
            f"annotation {BOOTSTRAP_NAMESPACE}={value!r} is not a namespace "
            "(letters, digits, '_', '.', '-'; up to 128)"
        )
    return value
