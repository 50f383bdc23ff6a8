"""Switches for the CPU ledger (``python -m bench.load.peers --ledger``): each feature the
request path pays for can be switched off alone, to measure what it costs. All are on by
default, and an operator keeps them on: each one off loses what it gives."""

from __future__ import annotations

from pydantic import BaseModel, Field

from router.settings.flags import DOCUMENTED, env_only

__all__ = ["FeatureSettings"]

_LEDGER = env_only("for measuring a feature's CPU cost; keep it on")


class FeatureSettings(BaseModel):
    """Which per-request features run (all by default)."""

    model_config = DOCUMENTED

    metrics: bool = Field(default=True, json_schema_extra=_LEDGER)
    """per-request Prometheus counters and histograms (off: they stay at zero)"""
    receipts: bool = Field(default=True, json_schema_extra=_LEDGER)
    """the `x-pdr-*` routing receipt headers on each response"""
    admission: bool = Field(default=True, json_schema_extra=_LEDGER)
    """the admission gate (off: no request limit, no queue)"""
    breakers: bool = Field(default=True, json_schema_extra=_LEDGER)
    """worker and pair circuit breakers (off: failures open none)"""
    health: bool = Field(default=True, json_schema_extra=_LEDGER)
    """periodic health probes of every worker"""
    engine_load: bool = Field(default=True, json_schema_extra=_LEDGER)
    """polling the engines' load (`/metrics`, SGLang's load API)"""
    outliers: bool = Field(default=True, json_schema_extra=_LEDGER)
    """request-path outlier detection"""
    traffic: bool = Field(default=True, json_schema_extra=_LEDGER)
    """the status page's recent-traffic window"""
    trace_headers: bool = Field(default=True, json_schema_extra=_LEDGER)
    """forwarding the client's W3C `traceparent`/`tracestate` to both legs"""
    host_sharing: bool = Field(default=True, json_schema_extra=_LEDGER)
    """`--workers N`: the processes share their load counts and KV predictions (off: each
    routes and admits on its own counts, as N routers would)"""
