"""The engine-facing side: connections and timeouts, load polls, health probes, breakers."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from router.settings.flags import DOCUMENTED, PositiveFloat, cli, env_only

__all__ = ["CircuitBreakerSettings", "HealthSettings", "LoadSettings", "UpstreamSettings"]

# the pool per worker: left to the environment, like flags.TUNING
_POOL = env_only("connection pool tuning, rarely changed")


class UpstreamSettings(BaseModel):
    """Timeouts and connection limits of the pooled client kept per worker."""

    model_config = DOCUMENTED

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
    prefill_grace_s: float = Field(default=1.0, ge=0.0, json_schema_extra=_POOL)
    """seconds a prefill leg still running when its decode served the client may take to
    answer, so that its keep-alive connection is kept (the client has its whole answer by then:
    only the request's admission slot waits); past it the leg is cancelled, its connection
    closed"""
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
    client: Literal["lean", "aiohttp", "httpx"] = Field(
        default="lean", json_schema_extra=cli("--upstream-client")
    )
    """HTTP client for engine calls: `lean` (HTTP/1.1 keep-alive on asyncio protocols and
    httptools, the least CPU per request), `aiohttp` or `httpx`"""
    max_answer_bytes: int = Field(
        default=256 * 1024 * 1024, gt=0, json_schema_extra=cli("--max-answer-bytes")
    )
    """largest engine answer the router reads whole (a prefill's, a non-streaming decode's);
    beyond it the leg fails with 502 and its connection is closed, nothing more is read.
    Streams are relayed as they come, unbounded in total. 256 MiB holds `n` = 128 samples of
    16k tokens with a logprob per token (~200 MiB; their text alone is ~9 MiB)"""
    max_error_answer_bytes: int = Field(
        default=64 * 1024, ge=1024, json_schema_extra=env_only("rarely tuned")
    )
    """largest error answer (HTTP status >= 400) read from an engine; beyond it the leg fails
    with 502 and its connection is closed (engines' errors are a few hundred bytes)"""


class LoadSettings(BaseModel):
    """Polling each worker's own load report (vLLM ``/metrics``; SGLang ``/v1/loads``, else
    ``/metrics``). A failed or missing reading is unknown, never idle."""

    model_config = DOCUMENTED

    interval_s: float = Field(default=1.0, ge=0, json_schema_extra=cli("--load-interval"))
    """seconds between engine load reads (0: never; the router's in-flight counts only)"""
    timeout_s: PositiveFloat = Field(default=1.0, json_schema_extra=cli("--load-timeout"))
    """engine load read timeout, s"""
    stale_after_s: PositiveFloat = Field(default=5.0, json_schema_extra=cli("--load-stale-after"))
    """an engine load older than this many seconds is unknown"""


class HealthSettings(BaseModel):
    """Probing each worker (``GET /health``, then a prefill's bootstrap layout), and the
    failed requests that open its circuit breaker."""

    model_config = DOCUMENTED

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

    model_config = DOCUMENTED

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
