"""Per-tenant limits: requests per minute, tokens per minute, requests in flight.

    limiter = TenantLimiter({"acme": TenantLimits(requests_per_minute=600)}, default=...)
    admitted = await limiter.admit("acme", estimated_tokens=prompt_tokens + max_tokens)
    try:
        ...  # serve; answer with admitted.headers added
    finally:
        await admitted.finish(usage.total_tokens if usage else None)

``admit`` raises ``router.errors.RateLimited`` (429, ``retry-after``, ``x-ratelimit-*``) when a
limit is reached; nothing stays charged then. The rates live in the storage ``storage_url``
names (``router.tenancy.windows``: memory for one router process, Redis for replicas sharing a
limit; with memory, each of ``router --workers N``'s processes counts on its own, so a tenant
gets N times its rates). Storage failures fail open: the request is served, logged, unlimited.
Tokens: the estimate is charged on admission and corrected when the answer ends: an
answer that used fewer gives the rest back (while its window lasts), one that used more adds
the excess, counted even past the limit (the tokens were spent).

Requests in flight are counted in this process only, with Redis too: with N replicas (or
``router --workers N`` processes) a tenant may have N times ``max_concurrent`` in flight. A
counter in a shared storage would leak slots for good whenever a router died with requests in
flight.

Tenants not in the map share one set of counters under ``default`` (None: unlimited), so the
storage holds keys for the configured tenants and that one bucket only, whatever names come in.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from router.errors import RateLimited
from router.tenancy.windows import Charge, Window, Windows

__all__ = ["DEFAULT_BUCKET", "Admitted", "TenantLimiter", "TenantLimits"]

# the counters of every tenant that is not in the map (not a valid tenant name there)
DEFAULT_BUCKET = "*"
# what a request refused for its tenant's concurrency is told to wait: a slot's end is unknown
CONCURRENCY_RETRY_AFTER_S = 1.0


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """One tenant's limits; None: unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 (or None: unlimited), not {value}")


@dataclass(eq=False, slots=True)
class Admitted:
    """One admitted request. ``headers``: the ``x-ratelimit-*`` headers for its answer.
    ``finish`` must run once it ended, however it ended."""

    headers: tuple[tuple[bytes, bytes], ...]
    _limiter: TenantLimiter
    _bucket: str
    _tokens: Charge | None
    _finished: bool = field(default=False)

    async def finish(self, actual_tokens: int | None = None) -> None:
        """Release the request's concurrency slot and correct its token charge by
        ``actual_tokens`` (None, the request failed or its usage is unknown: the estimate
        stands). Idempotent: only the first call counts."""
        if self.finish_local(actual_tokens):
            return
        self._finished = True
        self._limiter._release(self._bucket)
        charge = self._tokens
        assert charge is not None and actual_tokens is not None  # what finish_local left
        await self._limiter.windows.adjust(charge, actual_tokens - charge.cost)

    def finish_local(self, actual_tokens: int | None = None) -> bool:
        """``finish`` without awaiting, where no storage call is needed (the memory storage,
        or nothing to correct): True when finished; False: nothing done, await ``finish``."""
        if self._finished:
            return True
        charge = self._tokens
        delta = 0
        if actual_tokens is not None and charge is not None:
            delta = actual_tokens - charge.cost
        windows = self._limiter.windows
        if delta and not windows.local:
            return False
        self._finished = True
        self._limiter._release(self._bucket)
        if delta:
            assert charge is not None
            windows.adjust_local(charge, delta)
        return True


@dataclass(frozen=True, slots=True)
class _Plan:
    """What admitting a request of one bucket needs, looked up once: its concurrency cap and
    its windows (None: that limit is off)."""

    bucket: str
    max_concurrent: int | None
    requests: Window | None
    tokens: Window | None


class TenantLimiter:
    """Admits requests of the tenants in ``limits`` (and of others under ``default``).

    ``storage_url``: ``memory://`` (default) or a storage ``limits`` supports, such as
    ``redis://127.0.0.1:6379``; ``namespace`` prefixes its keys (routers that share a Redis and
    its counters use the same one)."""

    def __init__(
        self,
        limits: Mapping[str, TenantLimits],
        storage_url: str = "memory://",
        *,
        default: TenantLimits | None = None,
        namespace: str = "pdr-tenant",
    ) -> None:
        self._limits = dict(limits)
        self._default = default
        self._in_flight: dict[str, int] = {}
        self.windows = Windows(storage_url, namespace=namespace)
        # the plan of each tenant in ``limits`` and of DEFAULT_BUCKET, made on first use
        self._plans: dict[str, _Plan] = {}

    def replace_limits(
        self, limits: Mapping[str, TenantLimits], default: TenantLimits | None = None
    ) -> None:
        """New limits from now on (a configuration reload). Requests in flight keep their
        slots and are released as usual; the windows keep their counts, now measured against
        the new limits."""
        self._limits = dict(limits)
        self._default = default
        self._plans = {}
        self.windows.forget()

    def in_flight(self, tenant: str) -> int:
        """The requests of ``tenant``'s bucket in flight in this process."""
        return self._in_flight.get(self._bucket(tenant), 0)

    async def admit(self, tenant: str, estimated_tokens: int) -> Admitted:
        """Admit one request of ``tenant`` expected to use ``estimated_tokens`` (prompt plus
        ``max_tokens``); raises RateLimited when one of its limits is reached."""
        windows = self.windows
        if windows.local:  # the memory storage: nothing to await
            return self.admit_local(tenant, estimated_tokens)
        plan = self._plan(tenant)
        self._take(plan.bucket, plan.max_concurrent)
        try:
            requests = None if plan.requests is None else await windows.charge(plan.requests, 1)
            tokens = None
            if plan.tokens is not None:
                try:
                    tokens = await windows.charge(plan.tokens, estimated_tokens)
                except RateLimited:
                    if requests is not None:  # the request was not served: it does not count
                        await windows.adjust(requests, -1)
                    raise
        except BaseException:
            self._release(plan.bucket)
            raise
        return Admitted(_headers(requests, tokens, time.time()), self, plan.bucket, tokens)

    def admit_local(self, tenant: str, estimated_tokens: int) -> Admitted:
        """``admit`` on the memory storage (``windows.local``), without awaiting."""
        plan = self._plans.get(tenant) or self._plan(tenant)
        self._take(plan.bucket, plan.max_concurrent)
        windows, now = self.windows, time.time()
        try:
            requests = tokens = None
            if plan.requests is not None:
                requests = windows.charge_local(plan.requests, 1, now)
            if plan.tokens is not None:
                try:
                    tokens = windows.charge_local(plan.tokens, estimated_tokens, now)
                except RateLimited:
                    if requests is not None:  # the request was not served: it does not count
                        windows.adjust_local(requests, -1)
                    raise
        except BaseException:
            self._release(plan.bucket)
            raise
        return Admitted(_headers(requests, tokens, now), self, plan.bucket, tokens)

    async def aclose(self) -> None:
        await self.windows.aclose()

    def _bucket(self, tenant: str) -> str:
        return tenant if tenant in self._limits else DEFAULT_BUCKET

    def _plan(self, tenant: str) -> _Plan:
        """``tenant``'s plan (kept for the tenants in the limits and the default bucket: a
        bounded set, whatever names come in)."""
        bucket = self._bucket(tenant)
        plan = self._plans.get(bucket)
        if plan is None:
            limits = self._limits.get(bucket, self._default)
            if limits is None:
                plan = _Plan(bucket, None, None, None)
            else:
                window = self.windows.window
                rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
                plan = _Plan(
                    bucket,
                    limits.max_concurrent,
                    None if rpm is None else window("requests", bucket, rpm),
                    None if tpm is None else window("tokens", bucket, tpm),
                )
            self._plans[bucket] = plan
        return plan

    def _take(self, bucket: str, max_concurrent: int | None) -> None:
        """Count one more request in flight for ``bucket``; raises RateLimited at the cap.
        Counted with or without a cap, so that a reload that sets one sees those in flight."""
        count = self._in_flight.get(bucket, 0)
        if max_concurrent is not None and count >= max_concurrent:
            raise RateLimited(
                f"Rate limit reached: {count} requests in flight, the limit is {max_concurrent}."
                " Please try again once one has finished.",
                limit_type="requests",
                reason="tenant_concurrency",
                retry_after_s=CONCURRENCY_RETRY_AFTER_S,
            )
        self._in_flight[bucket] = count + 1

    def _release(self, bucket: str) -> None:
        count = self._in_flight.get(bucket, 0) - 1
        if count > 0:
            self._in_flight[bucket] = count
        else:
            self._in_flight.pop(bucket, None)


def _headers(
    requests: Charge | None, tokens: Charge | None, now: float
) -> tuple[tuple[bytes, bytes], ...]:
    """The ``x-ratelimit-*`` headers of an admission's charges (both windows usually end
    together: begun by the same admission, so their reset is formatted once)."""
    if requests is None:
        return () if tokens is None else tokens.headers(tokens.reset(now))
    reset = requests.reset(now)
    if tokens is None:
        return requests.headers(reset)
    together = tokens.reset_at == requests.reset_at
    return requests.headers(reset) + tokens.headers(reset if together else tokens.reset(now))
