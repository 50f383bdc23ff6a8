"""What the router tells about itself: its logs, the status page's traffic, tracing."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from router.settings.flags import DOCUMENTED, TUNING, PositiveFloat, cli

__all__ = ["LoggingSettings", "ObservabilitySettings", "TracingSettings"]


class LoggingSettings(BaseModel):
    """The router's log lines; they carry the request id."""

    model_config = DOCUMENTED

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

    model_config = DOCUMENTED

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
    traffic_window_s: PositiveFloat = Field(default=600.0, json_schema_extra=TUNING)
    """seconds of traffic the status page's request rate, TTFT and errors cover"""
    traffic_bucket_s: PositiveFloat = Field(default=5.0, json_schema_extra=TUNING)
    """the resolution of that window, s"""
    # routing agreement: predicted against actual cached tokens (router.observability.agreement)
    agreement_window: int = Field(default=64, ge=1, le=4096, json_schema_extra=TUNING)
    """requests per prefill DP rank whose predicted and actual cached tokens are kept (the
    recent agreement, the routing states, the doctor)"""
    agreement_tolerance: float = Field(
        default=0.1, gt=0.0, le=1.0, json_schema_extra=cli("--agreement-tolerance")
    )
    """the routing state is EXACT while the recent mean error between the predicted and the
    actual cached tokens stays within this share of the prompt tokens, DEGRADED beyond it"""
    agreement_min_requests: int = Field(default=8, ge=1, le=4096, json_schema_extra=TUNING)
    """requests with reported cached tokens a rank's window needs before its agreement (and
    the doctor's findings from it) counts"""
    events_stale_s: PositiveFloat = Field(default=30.0, json_schema_extra=TUNING)
    """a rank whose engine computed prompt tokens this many seconds after its last KV event batch,
    with none since, has a silent event stream; one whose batches were lost (or its publisher
    restarted) this many seconds ago or less is gapped (both DEGRADED)"""
    engine_block_size: int | None = Field(
        default=None, ge=1, json_schema_extra=cli("--engine-block-size")
    )
    """the engines' KV block size (vLLM `--block-size`, SGLang `--page-size`); a rank whose KV
    events report another one is a finding of `router doctor`; None: not checked"""


class TracingSettings(BaseModel):
    """OpenTelemetry spans (needs the ``otel`` extra). The W3C ``traceparent`` and
    ``tracestate`` headers reach both legs either way."""

    model_config = DOCUMENTED

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
