"""Predicted against actual cache hits, per prefill DP rank: does routing on the cache work?

When the prefill policy predicts the cache (``cache_aware``) the router knows, for every request
it sends, the prompt tokens it predicted cached at the chosen (worker, DP rank); the prefill's
answer says how many the engine really found cached (``usage.prompt_tokens_details
.cached_tokens``: vLLM with ``--enable-prompt-tokens-details``, SGLang with
``--enable-cache-report``; ``router.pipeline.decode_usage`` reads it) and how many prompt tokens
it counted (``usage.prompt_tokens``, against the router's own count: same tokenization?).

Recording is O(1) per request (a tuple into a bounded deque, a few integer additions and one
bisect over the error buckets); the window's aggregates are computed only when asked
(``RankAgreement.summary``: ``/admin/explain``, ``/ready``, the routing states, the doctor).
Each process of ``router --workers N`` keeps its own (its metrics are summed at scrape).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "ERROR_BUCKETS",
    "MAX_LOCATIONS",
    "AgreementBoard",
    "AgreementSummary",
    "UNKNOWN",
    "RankAgreement",
]

# |actual - predicted| / prompt tokens of one request (which way: the token counters)
ERROR_BUCKETS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0)
MAX_LOCATIONS = 4096  # (worker, DP rank) places kept at most: the pool's, pruned when read
UNKNOWN = -1  # a count the engine (or the router) did not give
DEFAULT_BLOCK_TOKENS = 16  # a block's tokens when neither the settings nor the events say

Location = tuple[str, int]
# predicted, actual (UNKNOWN), engine prompt, router prompt (UNKNOWN), chat, precise
_Sample = tuple[int, int, int, int, bool, bool]


@dataclass(frozen=True, slots=True)
class AgreementSummary:
    """One rank's recent window (``requests`` of them), computed when asked."""

    requests: int  # in the window
    reported: int  # ... whose prefill answer reported its cached tokens
    predicted_tokens: int  # predicted cached, over the reported ones
    cached_tokens: int  # the engine's cached, over the reported ones
    prompt_tokens: int  # the engine's prompt tokens, over the reported ones
    abs_error_tokens: int  # sum of |actual - predicted| over the reported ones
    within_tolerance: int  # reported requests whose error is within the tolerance
    compared: int  # requests with the router's own exact token count (precise)
    miscounted: int  # ... where it differs from the engine's prompt_tokens
    miscounted_chat: int  # ... of them chat (or conversation) requests
    compared_chat: int
    short: int  # requests whose prompt is shorter than ``block_tokens``
    # predicted cached and prompt tokens over every request whose answer had usage (reported
    # cached tokens or not): against the engine's own counters when it reports none
    predicted_all: int = 0
    prompt_all: int = 0

    @property
    def error_ratio(self) -> float | None:
        """Mean |actual - predicted| as a share of the prompt (None: nothing reported)."""
        return self.abs_error_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def predicted_hit_rate(self) -> float | None:
        return self.predicted_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def actual_hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    def as_dict(self) -> dict[str, Any]:
        def rounded(value: float | None) -> float | None:
            return None if value is None else round(value, 4)

        return {
            "requests": self.requests,
            "reported": self.reported,
            "predicted_cached_tokens": self.predicted_tokens,
            "cached_tokens": self.cached_tokens,
            "prompt_tokens": self.prompt_tokens,
            "mean_abs_error_tokens": round(self.abs_error_tokens / self.reported, 1)
            if self.reported
            else None,
            "error_ratio": rounded(self.error_ratio),
            "predicted_hit_rate": rounded(self.predicted_hit_rate),
            "actual_hit_rate": rounded(self.actual_hit_rate),
            "within_tolerance": self.within_tolerance,
            "token_count_compared": self.compared,
            "token_count_differs": self.miscounted,
        }


class RankAgreement:
    """One (worker, DP rank): cumulative counts (the metrics) and the last ``window`` requests."""

    __slots__ = (
        "buckets",
        "cached_tokens",
        "error_sum",
        "last_computed_at",
        "predicted_tokens",
        "prompt_tokens",
        "reported",
        "requests",
        "unreported",
        "url",
        "window",
    )

    def __init__(self, url: str, window: int) -> None:
        self.url = url
        self.window: deque[_Sample] = deque(maxlen=window)
        self.requests = 0  # every recorded request (cumulative)
        self.reported = 0  # ... whose answer reported cached tokens
        self.unreported = 0  # ... whose answer did not
        self.predicted_tokens = 0  # over the reported ones, cumulative
        self.cached_tokens = 0
        self.prompt_tokens = 0
        self.buckets = [0] * (len(ERROR_BUCKETS) + 1)  # the last one: above the top bound
        self.error_sum = 0.0
        # time.monotonic() of the last answer that says the engine computed prompt tokens
        # (then it stored new blocks, and should have published them)
        self.last_computed_at: float | None = None

    def record(
        self,
        predicted: int,
        actual: int,
        prompt: int,
        router_prompt: int,
        chat: bool,
        precise: bool,
    ) -> None:
        self.requests += 1
        self.window.append((predicted, actual, prompt, router_prompt, chat, precise))
        if actual == UNKNOWN:
            self.unreported += 1
            return
        self.reported += 1
        self.predicted_tokens += predicted
        self.cached_tokens += actual
        self.prompt_tokens += prompt
        if prompt > 0:
            error = abs(actual - predicted) / prompt
            self.error_sum += error
            self.buckets[bisect_left(ERROR_BUCKETS, error)] += 1
            if actual < prompt:
                self.last_computed_at = time.monotonic()

    def summary(self, tolerance: float, block_tokens: int) -> AgreementSummary:
        """The window's aggregates; ``tolerance``: the share of the prompt an error may reach
        and still agree; ``block_tokens``: a prompt shorter than this counts as short."""
        reported = predicted = cached = prompt = abs_error = within = 0
        compared = miscounted = miscounted_chat = compared_chat = short = 0
        predicted_all = prompt_all = 0
        for p, a, n, own, chat, precise in self.window:
            if n == UNKNOWN:  # the answer had no usage at all
                continue
            predicted_all, prompt_all = predicted_all + p, prompt_all + n
            if n < block_tokens:
                short += 1
            if precise and own != UNKNOWN:
                compared += 1
                compared_chat += chat
                if own != n:
                    miscounted += 1
                    miscounted_chat += chat
            if a == UNKNOWN:
                continue
            reported += 1
            predicted, cached, prompt = predicted + p, cached + a, prompt + n
            error = abs(a - p)
            abs_error += error
            within += error <= tolerance * n
        return AgreementSummary(
            len(self.window), reported, predicted, cached, prompt, abs_error, within,
            compared, miscounted, miscounted_chat, compared_chat, short, predicted_all, prompt_all,
        )  # fmt: skip


class AgreementBoard:
    """Every prefill rank's agreement, keyed by (worker id, DP rank); bounded by the pool
    (``prune``) and by ``MAX_LOCATIONS``."""

    def __init__(self, window: int = 64) -> None:
        self.window = window
        self._ranks: dict[Location, RankAgreement] = {}

    def rank(self, worker_id: str, rank: int, url: str) -> RankAgreement:
        """The rank's record (made on first use; none past ``MAX_LOCATIONS``: a throwaway)."""
        key = (worker_id, rank)
        found = self._ranks.get(key)
        if found is None:
            found = RankAgreement(url, self.window)
            if len(self._ranks) < MAX_LOCATIONS:
                self._ranks[key] = found
        return found

    def get(self, location: Location) -> RankAgreement | None:
        return self._ranks.get(location)

    def prune(self, live_ids: Collection[str]) -> None:
        """Forget the workers that left the pool."""
        for key in [key for key in self._ranks if key[0] not in live_ids]:
            del self._ranks[key]

    def items(self) -> Iterator[tuple[Location, RankAgreement]]:
        return iter(list(self._ranks.items()))

    def describe(
        self, tolerance: float, block_size: Callable[[Location], int | None]
    ) -> list[dict[str, Any]]:
        """Each rank's recent agreement (``/admin/explain``); ``block_size``: a rank's KV block
        size (its events', the configured one), for counting prompts shorter than a block."""
        rows = []
        for location, agreement in sorted(self.items(), key=lambda item: item[0]):
            size = block_size(location) or DEFAULT_BLOCK_TOKENS
            summary = agreement.summary(tolerance, size)
            rows.append({"worker": agreement.url, "dp_rank": location[1], **summary.as_dict()})
        return rows
