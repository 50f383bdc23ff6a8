"""Where the workers come from: their PD protocol, static worker specs, Kubernetes discovery."""

from __future__ import annotations

import os
from enum import StrEnum

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator

from registry.models import NAMESPACE_PATTERN, check_worker_url
from router.settings.flags import DOCUMENTED, TUNING, PositiveFloat, cli, env_only

__all__ = ["MAX_MODEL_NAME", "EngineProtocol", "KubernetesDiscoverySettings", "WorkerSpec"]

MAX_MODEL_NAME = 256  # characters of a served model name


class EngineProtocol(StrEnum):
    """The PD wire protocol spoken by the engines behind this router."""

    VLLM_MOONCAKE = "vllm-mooncake"
    VLLM_NIXL = "vllm-nixl"
    SGLANG = "sglang"


class WorkerSpec(BaseModel):
    """A statically configured worker: its HTTP URL, for prefill its bootstrap port, and the
    models it serves."""

    model_config = ConfigDict(frozen=True)

    url: str
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    # set when the prefill registers its ranks with this router's registry instead of hosting
    # its own bootstrap server (vLLM >= 0.32 bootstrap_server_address, our transfer library)
    bootstrap_namespace: str | None = Field(default=None, pattern=NAMESPACE_PATTERN)
    # the prefill's KV event stream (DP rank 0; rank r at port + r), like the engine's own
    # --kv-events-config endpoint / replay_endpoint; None: derived from CacheAwareSettings ports
    kv_events: str | None = None
    kv_events_replay: str | None = None
    # the model names it serves (``model=A,B``); empty: read from its /v1/models
    models: tuple[str, ...] = ()

    @field_validator("models")
    @classmethod
    def _check_models(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        for name in names:
            if not name or len(name) > MAX_MODEL_NAME or not name.isprintable():
                raise ValueError(
                    f"a model name is 1 to {MAX_MODEL_NAME} printable characters, got {name!r}"
                )
        return names

    @field_validator("kv_events", "kv_events_replay")
    @classmethod
    def _check_events(cls, value: str | None) -> str | None:
        if value is None:
            return None
        url = httpx.URL(value)
        if url.scheme != "tcp" or not url.host or url.port is None:
            raise ValueError(f"a KV event endpoint must look like tcp://host:port, got {value!r}")
        return value

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return check_worker_url(value)


def _in_kubernetes_pod() -> bool:
    """What client-go's in-cluster config checks: the API server's address is in the env."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


class KubernetesDiscoverySettings(BaseModel):
    """``--discovery k8s``: workers are the Ready pods matching a label selector per role
    (``router.fleet.kube``). The API server is reached with ``kubeconfig`` when given, else
    in-cluster (the pod's service account) when running in a pod, else ``$KUBECONFIG`` /
    ``~/.kube/config``."""

    model_config = DOCUMENTED

    namespace: str | None = Field(
        default=None,
        json_schema_extra=cli(
            "--k8s-namespace", default="the kubeconfig context's, in a pod its own, else `default`"
        ),
    )
    """namespace of the engine pods"""
    prefill_selector: str | None = Field(
        default=None, json_schema_extra=cli("--k8s-prefill-selector", metavar="SELECTOR")
    )
    """label selector of the prefill pods, e.g. `app=llm,pd-role=prefill`"""
    decode_selector: str | None = Field(
        default=None, json_schema_extra=cli("--k8s-decode-selector", metavar="SELECTOR")
    )
    """label selector of the decode pods"""
    kubeconfig: str | None = Field(
        default=None,
        json_schema_extra=cli(
            "--k8s-kubeconfig",
            metavar="PATH",
            default="in a pod its service account, else `$KUBECONFIG` or `~/.kube/config`",
        ),
    )
    """kubeconfig to reach the API server"""
    in_cluster: bool = Field(
        default_factory=_in_kubernetes_pod,
        json_schema_extra=env_only(
            "detected: KUBERNETES_SERVICE_HOST is set in a pod", default="in a pod"
        ),
    )
    """reach the API server with the pod's service account"""
    watch_timeout_s: int = Field(default=300, ge=1, json_schema_extra=TUNING)
    """seconds after which the API server ends a watch"""
    request_timeout_s: PositiveFloat = Field(default=30.0, json_schema_extra=TUNING)
    """connect, a list page, and a watch's silence beyond its own timeout, s"""
    list_page_size: int = Field(default=500, ge=1, json_schema_extra=TUNING)
    """pods per list page (limit/continue)"""
    backoff_s: PositiveFloat = Field(default=0.5, json_schema_extra=TUNING)
    """wait after a failure, s; doubled per failure up to `max_backoff_s`"""
    max_backoff_s: PositiveFloat = Field(default=10.0, json_schema_extra=TUNING)
    """cap on that wait, s"""
