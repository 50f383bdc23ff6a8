"""One typed settings tree for the router: env (``PDR_`` prefix, ``__`` nesting) < CLI flags.

A field's docstring is its help text; its ``json_schema_extra`` says how the command line sets
it (:func:`cli`) or why only the environment does (:func:`env_only`). ``router.server.cli``
builds the flags from them, ``router.server.settings_reference`` docs/configuration.md.
"""

from __future__ import annotations

import os
from enum import StrEnum
from typing import Annotated, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationInfo, field_validator
from pydantic.config import JsonDict
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
    "cli",
    "env_only",
]

PositiveFloat = Annotated[float, Field(gt=0)]
_DOCUMENTED = ConfigDict(use_attribute_docstrings=True)


def cli(
    *flags: str,
    metavar: str | tuple[str, ...] | None = None,
    choices: tuple[str, ...] | None = None,
    choices_of: Literal["policies"] | None = None,
    repeat: bool = False,
    nargs: Literal["+"] | None = None,
    switch: bool | None = None,
    adapter: Literal["prefill", "urls", "name_ports"] | None = None,
    default: str | None = None,
    help: str | None = None,
) -> JsonDict:
    """A setting's flag (``json_schema_extra``): ``flags`` are its option strings; a Literal or
    enum field's choices and an int/float field's type come from its annotation; ``choices_of``
    names a table of ``router.server`` (the policies); ``repeat``: given again, it adds to a
    list; ``switch``: the flag takes no value and sets this one; ``adapter``: a conversion of
    ``router.server.cli``; ``default``: the default as shown where it is computed; ``help``:
    for fields declared in another package. On a section field, ``flags[0]`` is the flag that
    the section's own validation errors name."""
    given: dict[str, JsonValue] = {
        "flags": list(flags),
        "metavar": list(metavar) if isinstance(metavar, tuple) else metavar,
        "choices": list(choices) if choices else None,
        "choices_of": choices_of,
        "repeat": repeat or None,
        "nargs": nargs,
        "switch": switch,
        "adapter": adapter,
        "default": default,
        "help": help,
    }
    return {"cli": {key: value for key, value in given.items() if value is not None}}


def env_only(reason: str, *, default: str | None = None, help: str | None = None) -> JsonDict:
    """A setting without a flag, and why; ``default`` and ``help`` as for :func:`cli`."""
    given: dict[str, JsonValue] = {"env_only": reason, "default": default, "help": help}
    return {"cli": {key: value for key, value in given.items() if value is not None}}


# why some settings have no flag: to keep the command line to what operators set
_TUNING = env_only("rarely tuned")
_POOL = env_only("connection pool tuning, rarely changed")


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
    """The client-facing HTTP server: where it listens, the bounds of a request (400 beyond
    them; ``router.schemas.RequestLimits``), connection limits (``router.server.http_limits``)
    and the graceful shutdown."""

    model_config = _DOCUMENTED

    host: str = Field(default="127.0.0.1", json_schema_extra=cli("--host"))
    """address to listen on"""
    port: int = Field(default=8000, ge=0, le=65535, json_schema_extra=cli("--port"))
    """port to listen on"""
    max_body_bytes: int = Field(
        default=32 * 1024 * 1024, gt=0, json_schema_extra=cli("--max-body-bytes")
    )
    """larger request bodies get 413 (completions, `/admin` and the engine bootstrap
    listeners)"""
    max_n: int = Field(default=128, ge=1, json_schema_extra=cli("--max-n"))
    """largest `n`: each sample is a full sequence, and with SGLang a request and a bootstrap
    room of its own; 128 is OpenAI's own cap on chat `n` and covers best-of sampling"""
    max_batch: int = Field(default=256, ge=1, json_schema_extra=cli("--max-batch"))
    """most prompts in one batched `/v1/completions` request"""
    max_sequences: int = Field(default=1024, ge=1, json_schema_extra=cli("--max-sequences"))
    """most sequences one request asks for, `n` x prompts"""
    max_request_id_bytes: int = Field(
        default=256, ge=1, le=4096, json_schema_extra=cli("--max-request-id-bytes")
    )
    """longest `X-Request-Id`; a longer one, or one with a byte outside printable ASCII
    (0x21-0x7E), gets 400 (the id goes into both legs' headers, which the engines echo within
    an 8190-byte limit, and into every log line)"""
    max_json_depth: int = Field(default=64, ge=1, le=512, json_schema_extra=_TUNING)
    """deepest nesting of arrays and objects in a request body, the body being level 1 (chat
    content parts need ~6, nested tool schemas a few dozen)"""
    graceful_shutdown_s: PositiveFloat = Field(
        default=30.0, json_schema_extra=cli("--shutdown-grace")
    )
    """on SIGTERM, `/ready` answers 503 and new connections are refused; requests in flight
    get this many seconds to finish, then end with an error; exit status 0"""
    max_header_bytes: int = Field(
        default=64 * 1024, ge=1024, le=16 * 1024 * 1024, json_schema_extra=cli("--max-header-bytes")
    )
    """most bytes of a request's head (request line + headers); beyond it 431 and the
    connection closes"""
    header_timeout_s: PositiveFloat = Field(default=10.0, json_schema_extra=cli("--header-timeout"))
    """seconds a request's headers may take from their first byte; then 408 and close (idle
    keep-alive connections between requests are uvicorn's: 75 s)"""
    body_timeout_s: PositiveFloat = Field(default=30.0, json_schema_extra=cli("--body-timeout"))
    """seconds a request body may go without data (idle time, not a total); then 408"""
    max_connections: int | None = Field(
        default=None,
        ge=1,
        json_schema_extra=cli("--max-connections", default="from the open file limit"),
    )
    """open client connections; one more is answered 503 at once (by default a third of the
    open file limit, raised to its hard limit at start, minus 256, within 64..16384)"""


class UpstreamSettings(BaseModel):
    """Timeouts and connection limits of the pooled client kept per worker."""

    model_config = _DOCUMENTED

    connect_timeout_s: PositiveFloat = Field(
        default=5.0, json_schema_extra=cli("--connect-timeout")
    )
    """seconds to connect to an engine"""
    read_timeout_s: PositiveFloat = Field(default=600.0, json_schema_extra=cli("--read-timeout"))
    """idle seconds between two reads of an engine's response (not a total)"""
    prefill_timeout_s: PositiveFloat = Field(
        default=900.0, json_schema_extra=cli("--prefill-timeout")
    )
    """total seconds a prefill leg may take"""
    kv_arrival_timeout_s: PositiveFloat = Field(
        default=30.0, json_schema_extra=cli("--kv-arrival-timeout")
    )
    """seconds a streaming decode may take to send its first byte after its prefill answered;
    past it the KV cache is not coming (504): real engines wait 480-540 s for it. Also how long
    after the prefill's answer a plain request still counts as waiting for the KV"""
    max_connections: int = Field(default=2048, gt=0, json_schema_extra=_POOL)
    """connections to one worker"""
    max_keepalive: int = Field(default=512, ge=0, json_schema_extra=_POOL)
    """idle connections kept per worker"""
    keepalive_s: PositiveFloat = Field(default=4.0, json_schema_extra=_POOL)
    """seconds an idle connection is kept: below the engines' own keep-alive (uvicorn: 5)"""
    max_retries: int = Field(default=2, ge=0, le=10, json_schema_extra=cli("--max-retries"))
    """retries on connect errors and on engines answering 429/503 (full), only before any byte
    reached the client, each with a new pair; when every try finds a full engine the client
    gets its 429/503"""
    client: Literal["aiohttp", "httpx"] = Field(
        default="aiohttp", json_schema_extra=cli("--upstream-client")
    )
    """HTTP client library for engine calls"""


class AdmissionSettings(BaseModel):
    """Overload: admission control before routing, per-worker in-flight caps, and the back-off
    from an engine that answered it is full (``router.pipeline.admission``, ``WorkerPool``)."""

    model_config = _DOCUMENTED

    max_concurrent_requests: int = Field(
        default=1024, ge=0, json_schema_extra=cli("--max-concurrent-requests")
    )
    """completion requests served at once, admitted after their body was read and parsed;
    more wait in a FIFO queue (0: no limit)"""
    max_queued_requests: int = Field(
        default=2048, ge=0, json_schema_extra=cli("--max-queued-requests")
    )
    """requests waiting for a slot; beyond it 429 with `Retry-After` at once (0: no queue)"""
    queue_timeout_s: PositiveFloat = Field(default=30.0, json_schema_extra=cli("--queue-timeout"))
    """a request queued this long gets 429"""
    retry_after_s: int = Field(default=1, ge=1, le=3600, json_schema_extra=_TUNING)
    """the `Retry-After` (whole seconds) of the router's 429s"""
    max_inflight_per_worker: int = Field(
        default=0, ge=0, json_schema_extra=cli("--max-inflight-per-worker")
    )
    """legs one worker (all its DP ranks) may have in flight from this router; at the cap it
    is no candidate, and with every candidate at it the request gets 429 (0: no cap)"""
    max_inflight_per_prefill: int | None = Field(
        default=None,
        ge=0,
        json_schema_extra=cli("--max-inflight-per-prefill", default="--max-inflight-per-worker"),
    )
    """the same for prefill workers only"""
    max_inflight_per_decode: int | None = Field(
        default=None,
        ge=0,
        json_schema_extra=cli("--max-inflight-per-decode", default="--max-inflight-per-worker"),
    )
    """the same for decode workers only"""
    capacity_backoff_s: float = Field(
        default=1.0, ge=0, json_schema_extra=cli("--capacity-backoff")
    )
    """a worker that answered 429/503 (full) is avoided this long while another candidate
    exists; it stays healthy (0: never avoided)"""

    def worker_caps(self) -> tuple[int, int]:
        """The in-flight caps of a prefill and of a decode worker (0: none)."""
        default = self.max_inflight_per_worker
        prefill, decode = self.max_inflight_per_prefill, self.max_inflight_per_decode
        return (default if prefill is None else prefill, default if decode is None else decode)


class PolicySettings(BaseModel):
    """How a prefill and a decode worker are chosen (``router.scheduling.policies``)."""

    model_config = _DOCUMENTED

    policy: str = Field(
        default="round_robin", json_schema_extra=cli("--policy", choices_of="policies")
    )
    """policy for both roles: `least_load` takes the lowest engine-reported load,
    `cache_aware` the prefill holding most of the prompt's KV cache (the decode: least_load)"""
    prefill_policy: str | None = Field(
        default=None,
        json_schema_extra=cli("--prefill-policy", choices_of="policies", default="--policy"),
    )
    """policy for prefill"""
    decode_policy: str | None = Field(
        default=None,
        json_schema_extra=cli("--decode-policy", choices_of="policies", default="--policy"),
    )
    """policy for decode"""


class LoadSettings(BaseModel):
    """Polling each worker's own load report (vLLM ``/metrics``; SGLang ``/v1/loads``, else
    ``/metrics``). A failed or missing reading is unknown, never idle."""

    model_config = _DOCUMENTED

    interval_s: float = Field(default=1.0, ge=0, json_schema_extra=cli("--load-interval"))
    """seconds between engine load reads (0: never; the router's in-flight counts only)"""
    timeout_s: PositiveFloat = Field(default=1.0, json_schema_extra=cli("--load-timeout"))
    """engine load read timeout, s"""
    stale_after_s: PositiveFloat = Field(default=5.0, json_schema_extra=cli("--load-stale-after"))
    """an engine load older than this many seconds is unknown"""


class CacheAwareSettings(BaseModel):
    """KV-cache-aware prefill selection (``cache_aware``) and skipping the prefill leg."""

    model_config = _DOCUMENTED

    tokenizer: str | None = Field(default=None, json_schema_extra=cli("--tokenizer", metavar="DIR"))
    """the engines' Hugging Face tokenizer directory (`tokenizer.json`, the chat template from
    `tokenizer_config.json`): precise `cache_aware`"""
    render_url: str | None = Field(
        default=None, json_schema_extra=cli("--render-url", metavar="URL")
    )
    """tokenize with this vLLM engine's (or render server's) `POST /v1/.../render` instead of
    `--tokenizer` (5 s timeout, then approximate)"""
    kv_events_port: int | None = Field(
        default=None, ge=1, le=65535, json_schema_extra=cli("--kv-events-port")
    )
    """KV event port of every prefill (on its URL's host; DP rank r at port + r)"""
    kv_events_replay_port: int | None = Field(
        default=None, ge=1, le=65535, json_schema_extra=cli("--kv-events-replay-port")
    )
    """KV event replay port of every prefill"""
    max_indexed_blocks: int = Field(
        default=4_000_000, gt=0, json_schema_extra=cli("--max-indexed-blocks")
    )
    """cap on the KV blocks indexed, all workers together"""
    prediction_ttl_s: PositiveFloat = Field(default=2.0, json_schema_extra=cli("--prediction-ttl"))
    """seconds the entries a routing decision predicts live unless the engine's events
    confirm them"""
    # SMG's cache_threshold
    cache_threshold: float = Field(
        default=0.3, ge=0.0, le=1.0, json_schema_extra=cli("--cache-threshold")
    )
    """a cached prefix counts only when it covers at least this share of the prompt (a shared
    template header alone must not pull every request along); below it the rank with the
    least queued prefill work wins"""
    # defaults measured by bench/kv_tiers/main.py; the env takes JSON ({"DISK": 0.7})
    tier_weights: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS),
        json_schema_extra=cli("--cache-tier-weights", metavar="TIER=WEIGHT,..."),
    )
    """tiered KV caches: what a cached block only in host memory (`CPU_PINNED`, or vLLM's
    `CPU`) or on `DISK` counts for in `cache_aware`, a GPU block being 1; each 0..1, a tier not
    given keeps its default"""
    balance_abs_threshold: float = Field(
        default=32.0, ge=0, json_schema_extra=cli("--balance-abs-threshold")
    )
    """`cache_aware`: load wins over the cache when max - min load exceeds this ..."""
    balance_rel_threshold: float = Field(
        default=1.5, ge=1.0, json_schema_extra=cli("--balance-rel-threshold")
    )
    """... and the max load exceeds this times the min"""
    approx_tree_max_chars: int = Field(
        default=16 * 1024 * 1024, gt=0, json_schema_extra=cli("--approx-tree-max-chars")
    )
    """approximate `cache_aware` (no tokenizer): prefix tree size cap per worker, chars"""
    tokenize_cache_entries: int = Field(
        default=8192, ge=0, json_schema_extra=cli("--tokenize-cache-entries")
    )
    """cached tokenized prompt segments"""
    pd_min_uncached_tokens: int = Field(
        default=0, ge=0, json_schema_extra=cli("--pd-min-uncached-tokens")
    )
    """vLLM protocols: a request with fewer predicted uncached prompt tokens skips the prefill
    leg (the decode prefills it; 0: never)"""
    prefill_saturated_waiting: int | None = Field(
        default=None, ge=1, json_schema_extra=cli("--prefill-saturated-waiting")
    )
    """vLLM protocols: when every prefill reports this many waiting requests, the decode
    prefills locally (none: never for load)"""

    @field_validator("tier_weights", mode="before")
    @classmethod
    def _parse_tier_weights(cls, value: object) -> object:
        return parse_tier_weights(value) if isinstance(value, str) else value

    @field_validator("tier_weights")
    @classmethod
    def _check_tier_weights(cls, value: dict[str, float]) -> dict[str, float]:
        return check_tier_weights(value)


class HealthSettings(BaseModel):
    """Probing each worker (``GET /health``, then a prefill's bootstrap layout), and the
    failed requests that open its circuit breaker."""

    model_config = _DOCUMENTED

    interval_s: PositiveFloat = Field(default=5.0, json_schema_extra=cli("--health-interval"))
    """seconds between health probes"""
    timeout_s: PositiveFloat = Field(default=2.0, json_schema_extra=cli("--health-timeout"))
    """health probe timeout, s"""
    failure_threshold: int = Field(
        default=3, ge=1, json_schema_extra=cli("--health-failure-threshold")
    )
    """consecutive failed requests (5xx, timeouts, connection errors: the worker's fault) that
    open a worker's circuit breaker: it gets no traffic until a trial request succeeds"""
    unhealthy_threshold: int = Field(
        default=3, ge=1, json_schema_extra=cli("--health-unhealthy-threshold")
    )
    """consecutive failed probes that take a worker out (a refused connection counts as all of
    them; a failed probe does not count while the worker served a request successfully within
    the last interval)"""
    healthy_threshold: int = Field(
        default=2, ge=1, json_schema_extra=cli("--health-healthy-threshold")
    )
    """consecutive good probes that bring a worker that was taken out back (a new worker needs
    one)"""


class CircuitBreakerSettings(BaseModel):
    """Circuit breakers (router.fleet.circuit_breaker): a worker's opens after
    ``health.failure_threshold`` failed requests in a row, a prefill -> decode pair's after
    ``pair_failure_threshold`` failed KV transfers in a row; open ones get one trial request
    after ``open_s``, doubled after every failed trial up to ``max_open_s``."""

    model_config = _DOCUMENTED

    open_s: PositiveFloat = Field(default=5.0, json_schema_extra=cli("--breaker-open"))
    """seconds an open circuit breaker (worker or pair) waits before one trial request;
    doubled after each failed trial"""
    max_open_s: PositiveFloat = Field(default=60.0, json_schema_extra=cli("--breaker-max-open"))
    """cap on a circuit breaker's back-off, s (at least `--breaker-open`)"""
    pair_failure_threshold: int = Field(
        default=3, ge=0, json_schema_extra=cli("--pair-failure-threshold")
    )
    """consecutive failed KV transfers that open a prefill -> decode pair's circuit breaker:
    the pair is avoided while another exists (0: no pair breakers)"""

    @field_validator("max_open_s")
    @classmethod
    def _check_back_off(cls, value: float, info: ValidationInfo) -> float:
        start = info.data.get("open_s")
        if start is not None and value < start:
            raise ValueError(f"the back-off cap ({value:g}s) is below --breaker-open ({start:g}s)")
        return value


class LoggingSettings(BaseModel):
    """The router's log lines; they carry the request id."""

    model_config = _DOCUMENTED

    level: str = Field(
        default="info",
        json_schema_extra=cli(
            "--log-level", choices=("critical", "error", "warning", "info", "debug")
        ),
    )
    """`debug` adds one line per request: status, the workers and DP rank, outcome, attempts,
    the transfer id or bootstrap room, and the leg timings"""

    @field_validator("level")
    @classmethod
    def _check_level(cls, value: str) -> str:
        value = value.lower()
        if value not in ("critical", "error", "warning", "info", "debug"):
            raise ValueError("must be one of critical, error, warning, info, debug")
        return value


class ObservabilitySettings(BaseModel):
    """The status page's recent traffic, and "PD did not happen" detection."""

    model_config = _DOCUMENTED

    # vLLM ``prompt_tokens_details.created_cache_tokens``
    recompute_min_ratio: float = Field(
        default=0.5, gt=0.0, le=1.0, json_schema_extra=cli("--recompute-min-ratio")
    )
    """a decode that computed at least this share of the prompt itself counts as a PD
    recompute: the KV from the prefill was not used"""
    suspect_window_s: PositiveFloat = Field(
        default=300.0, json_schema_extra=cli("--suspect-window")
    )
    """seconds a prefill-decode pair stays suspect after its last recompute"""
    traffic_window_s: PositiveFloat = Field(default=600.0, json_schema_extra=_TUNING)
    """seconds of traffic the status page's request rate, TTFT and errors cover"""
    traffic_bucket_s: PositiveFloat = Field(default=5.0, json_schema_extra=_TUNING)
    """the resolution of that window, s"""


class TracingSettings(BaseModel):
    """OpenTelemetry spans (needs the ``otel`` extra). The W3C ``traceparent`` and
    ``tracestate`` headers reach both legs either way."""

    model_config = _DOCUMENTED

    otlp_endpoint: str | None = Field(
        default=None, json_schema_extra=cli("--otlp-endpoint", metavar="URL")
    )
    """export spans (route, prefill, decode) to this OTLP/HTTP collector, e.g.
    http://127.0.0.1:4318 (needs `pd-router[otel]`)"""
    service_name: str = Field(default="pd-router", json_schema_extra=cli("--otel-service-name"))
    """`service.name` of the spans"""
    sample_ratio: float = Field(
        default=1.0, ge=0.0, le=1.0, json_schema_extra=cli("--trace-sample-ratio")
    )
    """share of the traces the router starts that are sampled; a client's `traceparent`
    decides for its own"""


def _in_kubernetes_pod() -> bool:
    """What client-go's in-cluster config checks: the API server's address is in the env."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


class KubernetesDiscoverySettings(BaseModel):
    """``--discovery k8s``: workers are the Ready pods matching a label selector per role
    (``router.fleet.kube``). The API server is reached with ``kubeconfig`` when given, else
    in-cluster (the pod's service account) when running in a pod, else ``$KUBECONFIG`` /
    ``~/.kube/config``."""

    model_config = _DOCUMENTED

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
    watch_timeout_s: int = Field(default=300, ge=1, json_schema_extra=_TUNING)
    """seconds after which the API server ends a watch"""
    request_timeout_s: PositiveFloat = Field(default=30.0, json_schema_extra=_TUNING)
    """connect, a list page, and a watch's silence beyond its own timeout, s"""
    list_page_size: int = Field(default=500, ge=1, json_schema_extra=_TUNING)
    """pods per list page (limit/continue)"""
    backoff_s: PositiveFloat = Field(default=0.5, json_schema_extra=_TUNING)
    """wait after a failure, s; doubled per failure up to `max_backoff_s`"""
    max_backoff_s: PositiveFloat = Field(default=10.0, json_schema_extra=_TUNING)
    """cap on that wait, s"""


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
    (DP rank 0; rank r at port + r, as in its `--kv-events-config`)"""
    decode: list[WorkerSpec] = Field(
        default_factory=list,
        json_schema_extra=cli("--decode", metavar="URL", repeat=True, adapter="urls"),
    )
    """a decode worker's URL"""
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
