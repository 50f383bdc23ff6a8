"""Per-tenant limits on one router (``limits``' memory storage), on a clock the tests move."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping

import msgspec
import pytest
from limits import RateLimitItemPerMinute
from limits.aio.storage import MemoryStorage
from limits.aio.strategies import FixedWindowRateLimiter

from router.errors import RateLimited, error_body
from router.tenancy.headers import duration, duration_bytes
from router.tenancy.limiter import Admitted, TenantLimiter, TenantLimits
from router.tenancy.windows import Windows
from tests.router.tenancy.conftest import Clock

MakeLimiter = Callable[..., TenantLimiter]


@pytest.fixture
async def make_limiter(clock: Clock) -> AsyncIterator[MakeLimiter]:
    made: list[TenantLimiter] = []

    def make(limits: Mapping[str, TenantLimits], **kwargs: object) -> TenantLimiter:
        limiter = TenantLimiter(limits, **kwargs)  # type: ignore[arg-type]
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        await limiter.aclose()


def header(admitted: Admitted | RateLimited, name: str) -> str | None:
    found = [v.decode() for k, v in admitted.headers if k == name.encode()]
    assert len(found) <= 1, f"{name} sent {len(found)} times"
    return found[0] if found else None


async def test_requests_per_minute(make_limiter: MakeLimiter, clock: Clock) -> None:
    limiter = make_limiter({"acme": TenantLimits(requests_per_minute=3)})
    remaining = []
    for _ in range(3):
        admitted = await limiter.admit("acme", 10)
        assert header(admitted, "x-ratelimit-limit-requests") == "3"
        assert header(admitted, "x-ratelimit-reset-requests") == "1m0s"
        remaining.append(header(admitted, "x-ratelimit-remaining-requests"))
        await admitted.finish(10)
    assert remaining == ["2", "1", "0"]
    assert header(admitted, "x-ratelimit-limit-tokens") is None  # no token limit: not reported

    clock.advance(15)
    with pytest.raises(RateLimited) as refused:
        await limiter.admit("acme", 10)
    exc = refused.value
    assert exc.status == 429
    assert exc.retry_after_s == pytest.approx(45)
    assert header(exc, "retry-after") == "45"
    assert header(exc, "retry-after-ms") == "45000"
    assert header(exc, "x-ratelimit-remaining-requests") == "0"
    assert header(exc, "x-ratelimit-reset-requests") == "45s"
    error = msgspec.json.decode(error_body(exc))["error"]
    assert (error["type"], error["code"]) == ("requests", 429)

    clock.advance(45)  # the window is over
    assert header(await limiter.admit("acme", 10), "x-ratelimit-remaining-requests") == "2"


async def test_a_tenants_limit_is_its_own(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(
        {"a": TenantLimits(requests_per_minute=1), "b": TenantLimits(requests_per_minute=1)}
    )
    await limiter.admit("a", 1)
    await limiter.admit("b", 1)
    with pytest.raises(RateLimited):
        await limiter.admit("a", 1)


async def test_the_estimate_is_charged_and_a_refusal_charges_nothing(
    make_limiter: MakeLimiter,
) -> None:
    limiter = make_limiter({"acme": TenantLimits(requests_per_minute=10, tokens_per_minute=1000)})
    first = await limiter.admit("acme", 600)
    assert header(first, "x-ratelimit-remaining-tokens") == "400"
    assert header(first, "x-ratelimit-limit-tokens") == "1000"
    with pytest.raises(RateLimited) as refused:
        await limiter.admit("acme", 500)
    error = msgspec.json.decode(error_body(refused.value))["error"]
    assert (error["type"], error["code"]) == ("tokens", 429)
    assert header(refused.value, "x-ratelimit-remaining-tokens") == "400"
    assert refused.value.reason == "tenant_tokens"
    second = await limiter.admit("acme", 400)
    assert header(second, "x-ratelimit-remaining-tokens") == "0"
    # the refused request's request was given back: 2 of 10 spent, not 3
    assert header(second, "x-ratelimit-remaining-requests") == "8"


async def test_an_estimate_over_the_whole_budget_is_refused(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter({"acme": TenantLimits(tokens_per_minute=100)})
    with pytest.raises(RateLimited, match="exceed the limit of 100"):
        await limiter.admit("acme", 101)
    assert limiter.in_flight("acme") == 0
    await limiter.admit("acme", 100)


async def test_an_answer_that_used_fewer_tokens_leaves_room(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter({"acme": TenantLimits(tokens_per_minute=1000)})
    admitted = await limiter.admit("acme", 800)
    await admitted.finish(200)
    after = await limiter.admit("acme", 700)
    assert header(after, "x-ratelimit-remaining-tokens") == "100"


async def test_an_answer_that_used_more_tokens_counts_the_excess(
    make_limiter: MakeLimiter,
) -> None:
    limiter = make_limiter({"acme": TenantLimits(tokens_per_minute=1000)})
    admitted = await limiter.admit("acme", 300)
    await admitted.finish(1200)  # past the limit: the tokens were spent, they count
    with pytest.raises(RateLimited):
        await limiter.admit("acme", 1)


async def test_a_failed_request_keeps_its_estimate(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter({"acme": TenantLimits(tokens_per_minute=1000)})
    admitted = await limiter.admit("acme", 800)
    await admitted.finish(None)
    with pytest.raises(RateLimited):
        await limiter.admit("acme", 300)
    await limiter.admit("acme", 200)


async def test_no_refund_into_the_next_window(make_limiter: MakeLimiter, clock: Clock) -> None:
    limiter = make_limiter({"acme": TenantLimits(tokens_per_minute=1000)})
    admitted = await limiter.admit("acme", 800)
    clock.advance(61)  # the answer ends in the next window: its estimate is gone with the last
    await admitted.finish(0)
    await limiter.admit("acme", 1000)
    with pytest.raises(RateLimited):  # the next window got no 800 tokens of credit
        await limiter.admit("acme", 1)


async def test_max_concurrent(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter({"acme": TenantLimits(max_concurrent=2)})
    first = await limiter.admit("acme", 1)
    await limiter.admit("acme", 1)
    with pytest.raises(RateLimited) as refused:
        await limiter.admit("acme", 1)
    assert refused.value.reason == "tenant_concurrency"
    assert header(refused.value, "retry-after") == "1"
    await first.finish(1)
    await first.finish(1)  # harmless: the slot is freed once
    assert limiter.in_flight("acme") == 1
    await limiter.admit("acme", 1)
    assert limiter.in_flight("acme") == 2
    with pytest.raises(RateLimited):
        await limiter.admit("acme", 1)


async def test_a_refused_request_holds_no_slot(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter({"acme": TenantLimits(requests_per_minute=1, max_concurrent=1)})
    await (await limiter.admit("acme", 1)).finish(1)
    with pytest.raises(RateLimited):
        await limiter.admit("acme", 1)
    assert limiter.in_flight("acme") == 0


async def test_a_reload_keeps_requests_in_flight_and_window_counts(
    make_limiter: MakeLimiter,
) -> None:
    limiter = make_limiter({"acme": TenantLimits(max_concurrent=2, requests_per_minute=4)})
    held = [await limiter.admit("acme", 1), await limiter.admit("acme", 1)]
    limiter.replace_limits({"acme": TenantLimits(max_concurrent=3, requests_per_minute=5)})
    held.append(await limiter.admit("acme", 1))
    with pytest.raises(RateLimited, match="3 requests in flight"):
        await limiter.admit("acme", 1)
    limiter.replace_limits({"acme": TenantLimits(max_concurrent=1, requests_per_minute=5)})
    for admitted in held[:2]:
        await admitted.finish(1)
    with pytest.raises(RateLimited, match="1 requests in flight"):
        await limiter.admit("acme", 1)
    await held[2].finish(1)
    fourth = await limiter.admit("acme", 1)  # 4 of the (new) 5 this minute: the count was kept
    assert header(fourth, "x-ratelimit-remaining-requests") == "1"
    assert header(fourth, "x-ratelimit-limit-requests") == "5"


async def test_the_reset_headers_follow_the_window(make_limiter: MakeLimiter, clock: Clock) -> None:
    limiter = make_limiter({"acme": TenantLimits(requests_per_minute=10, tokens_per_minute=100)})
    first = await limiter.admit("acme", 30)
    assert header(first, "x-ratelimit-reset-requests") == "1m0s"
    assert header(first, "x-ratelimit-reset-tokens") == "1m0s"
    clock.advance(20.5)
    second = await limiter.admit("acme", 30)
    assert header(second, "x-ratelimit-reset-requests") == "39.5s"
    assert header(second, "x-ratelimit-reset-tokens") == "39.5s"
    assert header(second, "x-ratelimit-remaining-requests") == "8"
    assert header(second, "x-ratelimit-remaining-tokens") == "40"
    clock.advance(39.4)
    with pytest.raises(RateLimited) as refused:  # 60 of 100 tokens used: 50 more do not fit
        await limiter.admit("acme", 50)
    assert header(refused.value, "x-ratelimit-reset-tokens") == "100ms"
    assert header(refused.value, "x-ratelimit-remaining-tokens") == "40"
    clock.advance(0.1)  # a new window: full again, a minute to go
    third = await limiter.admit("acme", 30)
    assert header(third, "x-ratelimit-reset-requests") == "1m0s"
    assert header(third, "x-ratelimit-reset-tokens") == "1m0s"
    assert header(third, "x-ratelimit-remaining-requests") == "9"
    assert header(third, "x-ratelimit-remaining-tokens") == "70"
    clock.advance(30)
    await third.finish(10)  # 20 given back in the window it was charged in
    fourth = await limiter.admit("acme", 30)
    assert header(fourth, "x-ratelimit-reset-tokens") == "30s"
    assert header(fourth, "x-ratelimit-remaining-tokens") == "60"


async def test_unlisted_tenants_share_the_default(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(
        {"acme": TenantLimits(requests_per_minute=5)},
        default=TenantLimits(requests_per_minute=1),
    )
    await limiter.admit("stranger", 1)
    with pytest.raises(RateLimited):
        await limiter.admit("another-stranger", 1)
    await limiter.admit("acme", 1)

    unlimited = make_limiter({"acme": TenantLimits(requests_per_minute=1)})
    for _ in range(3):
        assert (await unlimited.admit("stranger", 10**9)).headers == ()


def test_limits_are_positive() -> None:
    with pytest.raises(ValueError, match="requests_per_minute"):
        TenantLimits(requests_per_minute=0)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.85, "850ms"),
        (1, "1s"),
        (6, "6s"),
        (59.9985, "59.999s"),
        (59.9994, "1m0s"),
        (2.4841, "2.485s"),
        (90.5, "1m30.5s"),
        (360, "6m0s"),
        (3600, "1h0m0s"),
        (-1, "0ms"),
    ],
)
def test_reset_durations_read_like_openais(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_a_reset_header_is_the_durations_text() -> None:
    """``duration_bytes`` (the header's short path) says what ``duration`` says, every
    millisecond of the first two minutes and around each boundary."""
    edges = [0.9994, 0.9995, 1.0, 59.9984, 59.9985, 59.9994, 59.99995, 60.0, 3599.9995, -0.5]
    for seconds in [ms / 1000 for ms in range(120_001)] + edges:
        assert duration_bytes(seconds) == duration(seconds).encode(), seconds


async def test_the_memory_windows_count_as_limits_own_fixed_window(clock: Clock) -> None:
    """The windows increment ``limits``' memory storage synchronously: the same fits,
    remaining counts and window ends as its fixed-window strategy on its own storage, across a
    window's end and a refusal."""
    windows = Windows("memory://", namespace="same")
    storage = MemoryStorage()
    reference = FixedWindowRateLimiter(storage)
    item = RateLimitItemPerMinute(10)
    ours: list[tuple[bool, int, float | None]] = []
    theirs: list[tuple[bool, int, float | None]] = []
    for step, cost in enumerate([3, 4, 5, 3, 1, 9, 2]):
        clock.advance(60 if step == 4 else 1)  # the first window ends before the fifth hit
        try:
            charge = await windows.charge(windows.window("tokens", "acme", 10), cost)
            assert charge is not None
            ours.append((True, charge.remaining, charge.reset_at))
        except RateLimited as refused:
            ours.append((False, int(header(refused, "x-ratelimit-remaining-tokens") or -1), None))
        fits = await reference.hit(item, "acme", cost=cost)
        if not fits:  # a refused hit is given back (limits' strategy counts it): as on Redis
            await storage.incr(item.key_for("acme"), item.get_expiry(), -cost)
        stats = await reference.get_window_stats(item, "acme")
        theirs.append((fits, stats.remaining, stats.reset_time if fits else None))
    assert ours == theirs
    await windows.aclose()
