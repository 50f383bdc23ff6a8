"""What each outcome of a leg or an attempt means: for the circuit breakers, the pair ledger, the
pool's back-off, the prefill's KV layout, and whether the request may be tried again.

Circuit breakers (``router.fleet.circuit_breaker``) hear every outcome. A worker's: its leg
succeeded, or failed by its own fault (transport errors, timeouts, 5xx; not 429/503 "full", not
a KV that did not come). A pair's: the decode leg of a PD attempt failed (5xx, timeout,
``kv_timeout``, dropped stream) or recomputed the prompt, while the prefill leg did not fail.

Blame goes to the cause (``kv_failure``): a decode 5xx that says the KV from its prefill did not
arrive (the adapter's ``is_kv_failure`` texts) is the prefill's: it becomes a ``kv_failed`` error
(retried on another prefill before any byte reached the client) that counts against the prefill's
breaker and the pair's, never the decode's. A decode 5xx without such a text (vLLM's bare 500 of a
failed KV load, a decode's own fault) counts against the decode, and against the pair in a PD
attempt. A frozen prefill is taken out before its decodes give up on its KV (real engines wait
300-540 s): outlier detection (``router.fleet.outlier``) ejects it within seconds. An
open breaker never marks a worker down by itself: a worker that may be alive keeps its pending
KV transfers. Only a breaker opened by a refused connection (nothing listens: the engine is gone,
as a refused probe says) marks the worker down too, which tells the requests waiting for its KV
(``Worker.signal_loss``); health probes bring it back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from router.adapters import PDAdapter
from router.errors import CAPACITY_STATUSES, UpstreamError, UpstreamUnavailable
from router.fleet.circuit_breaker import Circuits
from router.fleet.health import connection_refused
from router.observability.metrics import RouterMetrics
from router.observability.pair_ledger import PairLedger
from router.observability.receipt import RoutingReceipt
from router.pipeline.decode_usage import PromptUsage
from router.scheduling.chooser import Route
from router.upstream.base import UpstreamPool, is_worker_fault
from router.workers import Worker

__all__ = ["Verdicts", "error_detail", "retryable"]

logger = logging.getLogger(__name__)
_decode = msgspec.json.Decoder().decode
# kv_lost, kv_failed: the prefill lost or failed this request's KV; another pair may serve it
_RETRYABLE_KINDS = frozenset(
    {"capacity", "stale_connection", "worker_lost", "kv_lost", "kv_failed"}
)
# failures that say nothing against the worker whose leg saw them: the KV did not come (the
# pair's; kv_failed: the prefill's, counted in ``upstream_failed``), or the prefill was lost
# (marked down already)
_NOT_THE_WORKERS = frozenset({"kv_timeout", "kv_lost", "worker_lost", "kv_failed"})


def error_detail(body: bytes) -> str:
    """The engine's error message if it sent an OpenAI/FastAPI error JSON, else the raw text."""
    try:
        data = _decode(body)
    except msgspec.DecodeError:
        return body[:500].decode(errors="replace")
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(data.get("detail"), str):
            return str(data["detail"])
        if isinstance(data.get("message"), str):
            return str(data["message"])
    return body[:500].decode(errors="replace")


def retryable(exc: UpstreamError) -> bool:
    """Nothing was sent (connect), the engine had closed the pooled connection before any
    answer (stale_connection), or it was full (capacity): another worker may serve the request
    (before any byte reached the client)."""
    if isinstance(exc, UpstreamUnavailable) and exc.connect:
        return True
    return exc.kind in _RETRYABLE_KINDS


class Verdicts:
    """Tells the breakers, the pair ledger, the pool and the layouts what an outcome meant."""

    __slots__ = (
        "_adapter",
        "_metrics",
        "_on_stale_layout",
        "_pairs",
        "_pool",
        "_recompute_ratio",
        "circuits",
    )

    def __init__(
        self,
        pool: UpstreamPool,
        adapter: PDAdapter,
        circuits: Circuits,
        metrics: RouterMetrics,
        pairs: PairLedger,
        recompute_ratio: float,
        on_stale_layout: Callable[[Worker], None],
    ) -> None:
        self._pool = pool
        self._adapter = adapter
        self.circuits = circuits
        self._metrics = metrics
        self._pairs = pairs
        self._recompute_ratio = recompute_ratio
        self._on_stale_layout = on_stale_layout

    def record(self, worker: Worker, exc: UpstreamError | None) -> None:
        """A leg's outcome for its worker: served, failed by its fault, or full (and, for
        outlier detection, the legs in a row that timed out)."""
        if exc is None:
            worker.record_success()
            worker.legs.timeouts_in_row = 0
            self.circuits.worker_success(worker)
            return
        if exc.kind == "timeout" and exc.role == worker.role.value:
            worker.legs.timeouts_in_row += 1
        if is_worker_fault(exc):
            self._worker_failed(worker, exc)
        elif exc.kind == "capacity":  # full, not broken: avoid it for a moment
            self._pool.back_off(worker)

    def delivered(self, prefill: Worker) -> None:
        """A prefill leg still running when its decode served the client (it is cancelled):
        the KV arrived, a success for the prefill (its breaker, outlier detection)."""
        prefill.legs.delivered()
        self.record(prefill, None)

    def _worker_failed(self, worker: Worker, exc: UpstreamError) -> None:
        """A leg failed by the worker's fault: its breaker hears it. When that opens the breaker
        and the connection was refused (the engine is gone), the worker is marked down too, as
        a refused probe does: requests waiting for its KV give up, probes bring it back."""
        if exc.role != worker.role.value or exc.kind in _NOT_THE_WORKERS:
            return
        self.circuits.worker_failure(worker, exc.message)
        if worker.healthy and _refused(exc) and not self.circuits.worker_allows(worker):
            logger.warning(
                "%s worker %s is now unhealthy: its port refuses connections",
                worker.role.value,
                worker.public_url,
            )
            worker.mark_down("its port refuses connections")

    def kv_failure(self, status: int, content: bytes) -> bool:
        """Whether a PD attempt's decode error is its prefill's doing: a 5xx (or a 200 stream
        whose first event is an error) that says the KV did not arrive."""
        if status < 500 or status in CAPACITY_STATUSES:
            return False
        return self._adapter.is_kv_failure(content)

    def decode_status(
        self, status: int, content: bytes, worker: Worker, prefill: Worker | None
    ) -> None:
        """A decode's whole answer (not "full"): a 5xx counts against it, unless it names a
        prefill's layout it does not know (then the prefill's layout is re-read)."""
        if status < 500:
            self.record(worker, None)
        elif not self.stale_layout(content, worker, prefill):  # else: the prefill's
            self.circuits.worker_failure(worker, f"HTTP {status}: {error_detail(content)}")

    def stale_layout(self, content: bytes, worker: Worker, prefill: Worker | None) -> bool:
        """A decode error naming an unknown engine id: re-read the prefill's layout now."""
        if prefill is None or not self._adapter.is_stale_layout(content):
            return False
        logger.warning(
            "decode %s does not know prefill %s's engine id; re-querying",
            worker.public_url,
            prefill.public_url,
        )
        self._on_stale_layout(prefill)
        return True

    def decode_refused(
        self, status: int, content: bytes, prefill: Worker | None, decode: Worker
    ) -> str | None:
        """A decode's error answer goes to the client as is; count it like a failed leg. For a PD
        attempt (``prefill``: its prefill), returns the error for the receipt."""
        kind = "http_4xx" if status < 500 else "http_5xx"
        self._metrics.count(self._metrics.upstream_errors, "decode", kind)
        if prefill is None:
            return None
        error = f"decode answered HTTP {status}: {error_detail(content)}"
        if status >= 500:
            self.circuits.pair_failure(prefill, decode, error)
        return error

    def recomputed(self, usage: PromptUsage | None) -> bool:
        """Whether the decode's usage shows it computed the prompt itself (PD did nothing)."""
        return usage is not None and usage.recomputed(
            self._recompute_ratio, trust_cached=self._adapter.decode_reports_own_cache
        )

    def upstream_failed(self, route: Route, exc: UpstreamError) -> None:
        """An attempt failed: counted, and held against its pair (when it had one); a KV its
        prefill failed to deliver (``kv_failed``) against the prefill too."""
        self._metrics.count(self._metrics.upstream_errors, exc.role, exc.kind)
        prefill = route.prefill
        if prefill is not None:
            key = (prefill.id, route.decode.id)
            self._pairs.failed(key, prefill.public_url, route.decode.public_url, exc.message)
            if exc.kind == "kv_failed":
                self.circuits.worker_failure(prefill, exc.message)
            if _transfer_failed(exc) or exc.kind == "kv_failed":
                self.circuits.pair_failure(prefill, route.decode, exc.message)

    def pd_served(self, prefill: Worker, decode: Worker, receipt: RoutingReceipt) -> None:
        """A PD attempt answered the client: what its receipt says of the pair."""
        key = (prefill.id, decode.id)
        if receipt.decode_error is not None:  # a 5xx counted against the pair already
            self._pairs.failed(key, prefill.public_url, decode.public_url, receipt.decode_error)
            return
        self._pairs.served(key, prefill.public_url, decode.public_url)
        if not receipt.recomputed:
            self.circuits.pair_success(prefill, decode)
        else:
            self._pairs.recomputed(key, prefill.public_url, decode.public_url)
            self.circuits.pair_failure(prefill, decode, "the decode recomputed the prompt")
            logger.warning(
                "PD did not happen: decode %s recomputed the prompt instead of using the KV "
                "from prefill %s (dp_rank %d); pair %s -> %s is suspect",
                decode.public_url,
                prefill.public_url,
                receipt.dp_rank,
                prefill.public_url,
                decode.public_url,
            )


def _refused(exc: UpstreamError) -> bool:
    """Nothing listens on the worker's port (not a connect timeout): the engine is gone."""
    return isinstance(exc, UpstreamUnavailable) and exc.connect and connection_refused(exc)


def _transfer_failed(exc: UpstreamError) -> bool:
    """A PD attempt's decode leg failed by a fault after it was sent (so the KV transfer may
    be what failed): evidence against the pair. Not a decode that could not be reached, nor
    one that was full."""
    if exc.role != "decode" or not is_worker_fault(exc):
        return False
    return not (isinstance(exc, UpstreamUnavailable) and exc.connect)
