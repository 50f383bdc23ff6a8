"""One typed settings tree for the router: env (``PDR_`` prefix, ``__`` nesting) < CLI flags."""

from __future__ import annotations

import os
from enum import StrEnum
from typing import Annotated, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from registry.models import NAMESPACE_PATTERN, check_worker_url
from registry.settings import RegistrySettings
from router.kv_tiers import DEFAULT_TIER_WEIGHTS, check_tier_weights, parse_tier_weights

__all__ = [
    "AdmissionSettings",
    "CacheAwareSettings",
    "CircuitBreakerSettings",
    "EngineProtocol",
    "HealthSettings",
    "KubernetesDiscoverySettings",
    "LoadSettings",
    "LoggingSettings",
    "ObservabilitySettings",
    "PolicySettings",
    "RouterSettings",
    "ServerSettings",
    "TracingSettings",
    "UpstreamSettings",
    "WorkerSpec",
]

PositiveFloat = Annotated[float, Field(gt=0)]


class EngineProtocol(StrEnum):
    """The PD wire protocol spoken by the engines behind this router."""

    VLLM_MOONCAKE = "vllm-mooncake"
    VLLM_NIXL = "vllm-nixl"
    SGLANG = "sglang"


class WorkerSpec(BaseModel):
    """A statically configured worker: its HTTP URL and, for prefill, its bootstrap port."""

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


class ServerSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    # Request bounds (400 beyond them; router.schemas.RequestLimits carries them). Each sample is
    # a full sequence, and with SGLang a request and a bootstrap room of its own: 128 is OpenAI's
    # own cap on chat ``n`` and covers best-of / self-consistency sampling.
    max_n: int = Field(default=128, ge=1)
    max_batch: int = Field(default=256, ge=1)  # prompts in one batched /v1/completions request
    max_sequences: int = Field(default=1024, ge=1)  # n x batch
    # the id goes into both legs' headers and every log line, and the engines echo it back in
    # a header of their own (8190-byte header limit); longer ids, or any byte outside printable
    # ASCII 0x21-0x7E, get 400
    max_request_id_bytes: int = Field(default=256, ge=1, le=4096)
    # arrays/objects, the body being level 1: chat content parts need ~6, nested tool schemas a
    # few dozen; msgspec gives up near 1000 levels anyway
    max_json_depth: int = Field(default=64, ge=1, le=512)
    graceful_shutdown_s: PositiveFloat = 30.0
    # HTTP connection limits (router.server.http_limits): a request's head (request line + headers)
    # beyond max_header_bytes gets 431; headers not complete header_timeout_s after their first
    # byte, or a body idle for body_timeout_s, get 408; connections beyond max_connections get
    # 503 at once (None: derived from the open file limit, leaving room for upstream sockets)
    max_header_bytes: int = Field(default=64 * 1024, ge=1024, le=16 * 1024 * 1024)
    header_timeout_s: PositiveFloat = 10.0
    body_timeout_s: PositiveFloat = 30.0
    max_connections: int | None = Field(default=None, ge=1)


class UpstreamSettings(BaseModel):
    """Timeouts and connection limits of the pooled client kept per worker."""

    connect_timeout_s: PositiveFloat = 5.0
    read_timeout_s: PositiveFloat = 600.0  # idle time between two reads, not a total
    prefill_timeout_s: PositiveFloat = 900.0  # total time a prefill leg may take
    # A streaming decode's first byte must come this long after its prefill answered: past it the
    # KV cache is not coming (real engines wait 480-540 s for a KV that never arrives).
    kv_arrival_timeout_s: PositiveFloat = 30.0
    max_connections: int = Field(default=2048, gt=0)
    max_keepalive: int = Field(default=512, ge=0)
    keepalive_s: PositiveFloat = 4.0  # below the engines' own keep-alive (uvicorn: 5 s)
    max_retries: int = Field(default=2, ge=0, le=10)
    client: Literal["aiohttp", "httpx"] = "aiohttp"


class AdmissionSettings(BaseModel):
    """Overload: admission control before routing, per-worker in-flight caps, and the back-off
    from an engine that answered it is full (``router.pipeline.admission``, ``WorkerPool``)."""

    # completion requests served at once (admitted after their body was read and parsed); more
    # wait in a FIFO queue; 0: no limit
    max_concurrent_requests: int = Field(default=1024, ge=0)
    max_queued_requests: int = Field(default=2048, ge=0)  # beyond it: 429 at once
    queue_timeout_s: PositiveFloat = 30.0  # a request queued longer gets 429
    retry_after_s: int = Field(default=1, ge=1, le=3600)  # the 429s' Retry-After
    # legs a worker may have in flight from this router (all its DP ranks); at the cap it is no
    # candidate, and with every candidate at it the request gets 429; 0: no cap
    max_inflight_per_worker: int = Field(default=0, ge=0)
    max_inflight_per_prefill: int | None = Field(default=None, ge=0)  # None: ..._per_worker
    max_inflight_per_decode: int | None = Field(default=None, ge=0)
    # a worker that answered 429/503 (full) is avoided this long while another candidate
    # exists (not a fault: it stays healthy); 0: never avoided
    capacity_backoff_s: float = Field(default=1.0, ge=0)

    def worker_caps(self) -> tuple[int, int]:
        """The in-flight caps of a prefill and of a decode worker (0: none)."""
        default = self.max_inflight_per_worker
        prefill, decode = self.max_inflight_per_prefill, self.max_inflight_per_decode
        return (default if prefill is None else prefill, default if decode is None else decode)


class PolicySettings(BaseModel):
    policy: str = "round_robin"
    prefill_policy: str | None = None
    decode_policy: str | None = None


class LoadSettings(BaseModel):
    """Polling each worker's own load report (vLLM ``/metrics``; SGLang ``/v1/loads``, else
    ``/metrics``). A failed or missing reading is unknown, never idle."""

    interval_s: float = Field(default=1.0, ge=0)  # 0: never poll (router in-flight counts only)
    timeout_s: PositiveFloat = 1.0
    stale_after_s: PositiveFloat = 5.0  # an older reading is unknown


class CacheAwareSettings(BaseModel):
    """KV-cache-aware prefill selection (``cache_aware``) and skipping the prefill leg."""

    tokenizer: str | None = None  # a Hugging Face tokenizer directory (tokenizer.json + config)
    render_url: str | None = None  # a vLLM engine or render server: POST /v1/.../render
    kv_events_port: int | None = Field(default=None, ge=1, le=65535)  # on each prefill's host
    kv_events_replay_port: int | None = Field(default=None, ge=1, le=65535)
    max_indexed_blocks: int = Field(default=4_000_000, gt=0)  # the whole index, all workers
    prediction_ttl_s: PositiveFloat = 2.0  # predicted entries live this long unless confirmed
    # the cache decides only when the best rank holds at least this fraction of the prompt
    # (SMG's cache_threshold): a shared template header alone must not pull every request along
    cache_threshold: float = Field(default=0.3, ge=0.0, le=1.0)
    # tiered KV caches: a matched block found only in host memory (CPU_PINNED, or CPU) or on
    # DISK counts as this share of a GPU block (router.kv_tiers); a tier not given keeps its
    # default. Defaults measured by bench/kv_tiers/main.py (router.kv_tiers). The CLI takes
    # "CPU_PINNED=0.9,DISK=0.7", the env JSON ({"DISK": 0.7}).
    tier_weights: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS))
    balance_abs_threshold: float = Field(default=32.0, ge=0)  # load wins when max-min > this
    balance_rel_threshold: float = Field(default=1.5, ge=1.0)  # ... and max > this * min
    approx_tree_max_chars: int = Field(default=16 * 1024 * 1024, gt=0)  # per worker
    tokenize_cache_entries: int = Field(default=8192, ge=0)
    # vLLM protocols: a request whose predicted uncached prompt tokens are fewer goes to the
    # decode alone (it prefills locally); 0 never skips
    pd_min_uncached_tokens: int = Field(default=0, ge=0)
    # vLLM protocols: when every prefill reports at least this many waiting requests, the
    # decode prefills locally; None never skips for load
    prefill_saturated_waiting: int | None = Field(default=None, ge=1)

    @field_validator("tier_weights", mode="before")
    @classmethod
    def _parse_tier_weights(cls, value: object) -> object:
        return parse_tier_weights(value) if isinstance(value, str) else value

    @field_validator("tier_weights")
    @classmethod
    def _check_tier_weights(cls, value: dict[str, float]) -> dict[str, float]:
        return check_tier_weights(value)


class HealthSettings(BaseModel):
    interval_s: PositiveFloat = 5.0
    timeout_s: PositiveFloat = 2.0
    # consecutive failed requests (the worker's fault) that open the worker's circuit breaker
    failure_threshold: int = Field(default=3, ge=1)
    unhealthy_threshold: int = Field(default=3, ge=1)  # consecutive failed probes: down
    healthy_threshold: int = Field(default=2, ge=1)  # consecutive good probes: back up


class CircuitBreakerSettings(BaseModel):
    """Circuit breakers (router.fleet.circuit_breaker): a worker's opens after
    ``health.failure_threshold`` failed requests in a row, a prefill -> decode pair's after
    ``pair_failure_threshold`` failed KV transfers in a row; open ones get one trial request
    after ``open_s``, doubled after every failed trial up to ``max_open_s``."""

    open_s: PositiveFloat = 5.0
    max_open_s: PositiveFloat = 60.0
    pair_failure_threshold: int = Field(default=3, ge=0)  # 0: no pair breakers

    @field_validator("max_open_s")
    @classmethod
    def _check_back_off(cls, value: float, info: ValidationInfo) -> float:
        start = info.data.get("open_s")
        if start is not None and value < start:
            raise ValueError(f"the back-off cap ({value:g}s) is below --breaker-open ({start:g}s)")
        return value


class LoggingSettings(BaseModel):
    level: str = "info"

    @field_validator("level")
    @classmethod
    def _check_level(cls, value: str) -> str:
        value = value.lower()
        if value not in ("critical", "error", "warning", "info", "debug"):
            raise ValueError("must be one of critical, error, warning, info, debug")
        return value


class ObservabilitySettings(BaseModel):
    """The status page's recent traffic, and "PD did not happen" detection."""

    # a decode that computed at least this share of the prompt itself recomputed it: the KV
    # from the prefill was not used (vLLM ``prompt_tokens_details.created_cache_tokens``)
    recompute_min_ratio: float = Field(default=0.5, gt=0.0, le=1.0)
    # a P<->D pair stays suspect this long after its last recompute
    suspect_window_s: PositiveFloat = 300.0
    traffic_window_s: PositiveFloat = 600.0  # the status page's request rate, TTFT, errors
    traffic_bucket_s: PositiveFloat = 5.0


class TracingSettings(BaseModel):
    """OpenTelemetry spans (needs the ``otel`` extra). The W3C ``traceparent`` and
    ``tracestate`` headers reach both legs either way."""

    otlp_endpoint: str | None = None  # OTLP/HTTP collector, e.g. http://127.0.0.1:4318
    service_name: str = "pd-router"
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)  # for traces the router starts


def _in_kubernetes_pod() -> bool:
    """What client-go's in-cluster config checks: the API server's address is in the env."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


class KubernetesDiscoverySettings(BaseModel):
    """``--discovery k8s``: workers are the Ready pods matching a label selector per role
    (``router.fleet.kube``). The API server is reached with ``kubeconfig`` when given, else
    in-cluster
    (the pod's service account) when running in a pod, else ``$KUBECONFIG`` / ``~/.kube/config``."""

    # None: the kubeconfig context's namespace, or in a pod its own, else "default"
    namespace: str | None = None
    prefill_selector: str | None = None  # e.g. "app=llm,pd-role=prefill"
    decode_selector: str | None = None
    kubeconfig: str | None = None
    in_cluster: bool = Field(default_factory=_in_kubernetes_pod)
    watch_timeout_s: int = Field(default=300, ge=1)  # the server ends a watch after this
    request_timeout_s: PositiveFloat = 30.0  # connect, a list page, a watch's silence beyond
    list_page_size: int = Field(default=500, ge=1)  # pods per list page (limit/continue)
    backoff_s: PositiveFloat = 0.5  # after a failure; doubled per failure up to max_backoff_s
    max_backoff_s: PositiveFloat = 10.0


class RouterSettings(BaseSettings):
    """Root of the settings tree. CLI flags are passed as init values and win over env."""

    model_config = SettingsConfigDict(
        env_prefix="PDR_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    engine: EngineProtocol = EngineProtocol.VLLM_MOONCAKE
    prefill: list[WorkerSpec] = Field(default_factory=list)
    decode: list[WorkerSpec] = Field(default_factory=list)
    server: ServerSettings = ServerSettings()
    upstream: UpstreamSettings = UpstreamSettings()
    admission: AdmissionSettings = AdmissionSettings()
    policy: PolicySettings = PolicySettings()
    health: HealthSettings = HealthSettings()
    breaker: CircuitBreakerSettings = CircuitBreakerSettings()
    load: LoadSettings = LoadSettings()
    cache: CacheAwareSettings = CacheAwareSettings()
    registry: RegistrySettings = RegistrySettings()
    logging: LoggingSettings = LoggingSettings()
    observability: ObservabilitySettings = ObservabilitySettings()
    tracing: TracingSettings = TracingSettings()
    # where workers come from besides --prefill/--decode and the registry: "k8s" also follows
    # the Ready pods of ``kubernetes`` (written to the registry as source "kubernetes")
    discovery: Literal["static", "k8s"] = "static"
    kubernetes: KubernetesDiscoverySettings = Field(
        default_factory=KubernetesDiscoverySettings, validate_default=True
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
