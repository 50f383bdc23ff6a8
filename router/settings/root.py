"""The root of the settings tree, :class:`RouterSettings`: env (``PDR_``) < flags (init values)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from registry.settings import RegistrySettings
from router.settings.auth import ClientAuthSettings
from router.settings.discovery import EngineProtocol, KubernetesDiscoverySettings, WorkerSpec
from router.settings.features import FeatureSettings
from router.settings.flags import cli
from router.settings.observability import LoggingSettings, ObservabilitySettings, TracingSettings
from router.settings.outlier import OutlierSettings
from router.settings.replicas import ReplicaSettings
from router.settings.scheduling import CacheAwareSettings, PolicySettings, SessionSettings
from router.settings.server import AdmissionSettings, ServerSettings
from router.settings.upstream import (
    CircuitBreakerSettings,
    HealthSettings,
    LoadSettings,
    UpstreamSettings,
)

__all__ = ["RouterSettings"]


class RouterSettings(BaseSettings):
    """Root of the settings tree. CLI flags are passed as init values and win over env."""

    model_config = SettingsConfigDict(
        env_prefix="PDR_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
    )

    engine: EngineProtocol = Field(
        default=EngineProtocol.VLLM_MOONCAKE, json_schema_extra=cli("--engine")
    )
    """the PD protocol the engines speak"""
    prefill: list[WorkerSpec] = Field(
        default_factory=list,
        json_schema_extra=cli(
            "--prefill",
            metavar=("URL", "BOOTSTRAP_PORT"),
            nargs="+",
            repeat=True,
            adapter="prefill",
        ),
    )
    """a prefill worker: its URL, then its bootstrap port (vLLM Mooncake: 8998, its
    `VLLM_MOONCAKE_BOOTSTRAP_PORT`; SGLang: its `--disaggregation-bootstrap-port`), `none`
    (SGLang uses its own) or `ns:NS` (it registers with this router's registry in namespace
    NS), then optionally its KV event stream `events=tcp://HOST:PORT replay=tcp://HOST:PORT`
    (DP rank 0; rank r at port + r, as in its `--kv-events-config`) and `model=NAME[,NAME]`,
    the models it serves (else read from its `/v1/models`)"""
    decode: list[WorkerSpec] = Field(
        default_factory=list,
        json_schema_extra=cli(
            "--decode", metavar=("URL", "model=NAME"), nargs="+", repeat=True, adapter="decode"
        ),
    )
    """a decode worker's URL, then optionally `model=NAME[,NAME]`: the models it serves (else
    read from its `/v1/models`)"""
    server: ServerSettings = ServerSettings()
    upstream: UpstreamSettings = UpstreamSettings()
    admission: AdmissionSettings = AdmissionSettings()
    policy: PolicySettings = PolicySettings()
    health: HealthSettings = HealthSettings()
    breaker: CircuitBreakerSettings = CircuitBreakerSettings()
    outlier: OutlierSettings = OutlierSettings()
    load: LoadSettings = LoadSettings()
    cache: CacheAwareSettings = CacheAwareSettings()
    session: SessionSettings = SessionSettings()
    auth: ClientAuthSettings = ClientAuthSettings()
    registry: RegistrySettings = RegistrySettings()
    logging: LoggingSettings = LoggingSettings()
    observability: ObservabilitySettings = ObservabilitySettings()
    tracing: TracingSettings = TracingSettings()
    features: FeatureSettings = FeatureSettings()
    replicas: ReplicaSettings = Field(
        default_factory=ReplicaSettings, json_schema_extra=cli("--replica-listen")
    )
    discovery: Literal["static", "k8s"] = Field(
        default="static", json_schema_extra=cli("--discovery")
    )
    """where workers come from besides --prefill/--decode and the registry: `k8s` also follows
    the Ready pods matching --k8s-prefill-selector and --k8s-decode-selector (written to the
    registry as source "kubernetes")"""
    kubernetes: KubernetesDiscoverySettings = Field(
        default_factory=KubernetesDiscoverySettings,
        validate_default=True,
        json_schema_extra=cli("--discovery"),
    )

    @field_validator("kubernetes")
    @classmethod
    def _check_selectors(
        cls, value: KubernetesDiscoverySettings, info: ValidationInfo
    ) -> KubernetesDiscoverySettings:
        if info.data.get("discovery") != "k8s":
            return value
        missing = [
            flag
            for flag, selector in (
                ("--k8s-prefill-selector", value.prefill_selector),
                ("--k8s-decode-selector", value.decode_selector),
            )
            if not selector
        ]
        if missing:
            raise ValueError(f"k8s needs a label selector per role: {' and '.join(missing)}")
        return value

    @model_validator(mode="after")
    def _check_replicas(self) -> RouterSettings:
        several = self.server.workers != "1"
        if self.replicas.listen is not None and several and not self.features.host_sharing:
            raise ValueError(
                "--replica-listen with --workers N needs the processes' sharing on (features."
                "host_sharing): process 0 publishes the host's counts, read from the load board"
            )
        if self.replicas.peers_registry and self.registry.url.startswith("memory://"):
            raise ValueError(
                "--replica-peers-registry needs a registry the replicas share (--registry "
                "etcd://... or http://...), not the router's own memory://"
            )
        return self
