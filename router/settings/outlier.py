"""Request-path outlier detection (router.fleet.outlier): ejecting a worker whose legs stopped
completing, without waiting for its health probes."""

from __future__ import annotations

from pydantic import BaseModel, Field

from router.settings.flags import DOCUMENTED, TUNING, PositiveFloat, cli

__all__ = ["OutlierSettings"]


class OutlierSettings(BaseModel):
    """Outlier detection on the request path (Envoy's model): every ``interval_s`` the router
    looks at each worker's legs. A prefill with ``overdue_min_legs`` legs in flight whose
    oldest is older than max(``overdue_floor_s``, ``overdue_factor`` x its recent leg latency)
    while none of its legs completed for that long, or a worker whose last
    ``consecutive_timeouts`` legs timed out, is ejected: marked down at once (its waiting legs
    end and are retried elsewhere), for at least ``ejection_s``, and back only through the
    health probes' healthy threshold. At most ``max_ejection_percent`` of a role's workers are
    ejected at a time, and never the last one in service."""

    model_config = DOCUMENTED

    interval_s: float = Field(default=0.25, ge=0, json_schema_extra=cli("--outlier-interval"))
    """seconds between two outlier checks (0: no outlier detection)"""
    overdue_floor_s: PositiveFloat = Field(
        default=1.5, json_schema_extra=cli("--outlier-overdue-floor")
    )
    """seconds a prefill may go without completing a leg while one is in flight before it is
    ejected, at least (raise it when a batch of concurrent prompts may take longer than that
    on an idle prefill)"""
    overdue_min_legs: int = Field(default=2, ge=1, json_schema_extra=TUNING)
    """legs a prefill must have in flight to be judged overdue: one long prompt alone on an
    idle prefill is no evidence (a frozen prefill under load has many)"""
    overdue_factor: PositiveFloat = Field(default=10.0, json_schema_extra=TUNING)
    """a prefill is overdue past this many times its recent leg latency (a moving average),
    when that is above the floor"""
    consecutive_timeouts: int = Field(default=3, ge=1, json_schema_extra=TUNING)
    """legs in a row that timed out on a worker that eject it"""
    ejection_s: PositiveFloat = Field(default=5.0, json_schema_extra=cli("--outlier-ejection"))
    """seconds an ejected worker stays out at least, whatever its probes say"""
    max_ejection_percent: int = Field(
        default=50, ge=0, le=100, json_schema_extra=cli("--outlier-max-ejection-percent")
    )
    """most workers of a role ejected at a time, % of the role's pool (rounded down; the last
    worker in service is never ejected)"""
