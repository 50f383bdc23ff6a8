"""The end of one completion request: its metrics, the recent-traffic window and a log line.

Called once per request with its final status and routing receipt. The debug line carries the
same facts as the ``x-pdr-*`` headers plus the stage timings and ``cached=ACTUAL/PREDICTED``: the
prompt tokens the prefill reported cached and those the policy predicted (the request id comes
from the logging filter).
"""

from __future__ import annotations

import logging
import time

from router.observability.metrics import RouterMetrics
from router.observability.receipt import RoutingReceipt
from router.observability.recent_traffic import RecentTraffic

__all__ = ["RequestAccounting"]

logger = logging.getLogger(__name__)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}ms"


def _count(tokens: int | None) -> str:
    return "-" if tokens is None else str(tokens)


class RequestAccounting:
    def __init__(self, metrics: RouterMetrics, traffic: RecentTraffic | None) -> None:
        self._metrics = metrics
        self._traffic = traffic

    def finish(
        self,
        endpoint: str,
        stream: bool,
        status: int,
        started: float,
        first_byte_at: float,
        receipt: RoutingReceipt,
    ) -> None:
        """``started``/``first_byte_at``: ``time.monotonic()`` of the request's arrival and of
        the response's start (0: none)."""
        metrics = self._metrics
        duration = time.monotonic() - started
        ttft = first_byte_at - started if stream and first_byte_at and status < 400 else None
        if metrics.enabled:
            streamed = "true" if stream else "false"
            metrics.count(metrics.requests, endpoint, str(status), streamed)
            metrics.observe(metrics.request_seconds, duration, endpoint, streamed)
            if ttft is not None:
                metrics.observe(metrics.ttft_seconds, ttft, endpoint)
            if receipt.model:  # several models: per pool too (served names only)
                metrics.count(metrics.model_responses, receipt.model, str(status))
                if ttft is not None:
                    metrics.observe(metrics.model_ttft_seconds, ttft, receipt.model)
            if receipt.prefill_s is not None:
                metrics.prefill_seconds.observe(receipt.prefill_s)
            if receipt.kv_wait_s is not None:
                metrics.kv_wait_seconds.observe(receipt.kv_wait_s)
        if self._traffic is not None:
            self._traffic.record(status, ttft)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "%s status=%d prefill=%s dp_rank=%s decode=%s outcome=%s attempts=%d "
                "route=%dus prefill_leg=%s kv_wait=%s ttft=%s total=%s transfer=%s "
                "cached=%s/%s%s%s",
                endpoint,
                status,
                receipt.prefill or f"skipped:{receipt.skipped}",
                receipt.dp_rank if receipt.prefill else "-",
                receipt.decode or "-",
                receipt.outcome or "-",
                receipt.attempts,
                round(receipt.route_s * 1e6),
                _ms(receipt.prefill_s),
                _ms(receipt.kv_wait_s),
                _ms(ttft),
                _ms(duration),
                receipt.transfer_ref or "-",
                _count(receipt.cached_tokens),
                _count(receipt.predicted_cached_tokens),
                " RECOMPUTED" if receipt.recomputed else "",
                f" model={receipt.model}" if receipt.model else "",
            )
