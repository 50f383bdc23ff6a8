"""Why routing on the cache does not work: named causes, each from evidence the router has, each
with its remedy in plain words (``GET /admin/diagnosis``, ``router doctor URL``).

Judged per prefill DP rank from the last routing-state evaluation
(``router.observability.routing_states``): its agreement window, its KV event feed, the
configured engine block size; plus the P<->D pairs whose decode recomputed the prompt
(``router.observability.pair_ledger``). A window speaks only once it holds
``agreement_min_requests`` requests. Read only; computed when asked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from router.observability.agreement import AgreementSummary
from router.observability.pair_ledger import PairLedger
from router.observability.routing_states import GAPPED, SILENT, RankState, RoutingStates

__all__ = ["CAUSES", "Finding", "diagnose", "report"]

# cause -> the remedy, in plain words
CAUSES: dict[str, str] = {
    "block_size_mismatch": "start the engine with the block size the router expects (vLLM "
    "--block-size, SGLang --page-size), or set --engine-block-size to the engine's",
    "tokenization_mismatch": "give the router the engine's own tokenizer (--tokenizer: the "
    "model's directory, the same revision) or tokenize with the engine (--render-url)",
    "chat_template_mismatch": "give the router the chat template the engine applies (the "
    "model's tokenizer_config.json; an engine started with --chat-template uses that file)",
    "hits_below_prediction": "the engine does not find the blocks its KV events announced: give "
    "every engine process the same block hashing (vLLM: the same --prefix-caching-hash-algo and "
    "PYTHONHASHSEED; a fixed seed across restarts), keep prefix caching on, and check that the "
    "events of this rank come from this engine (its --kv-events-config endpoint)",
    "hits_above_prediction": "the router's index misses blocks the engine holds: check "
    "pdr_kv_events_lost_total, give the router the replay endpoint (--kv-events-replay-port) "
    "and keep the engines' events on (every DP rank publishing)",
    "events_silent": "the engine computes prompts but no KV event reaches the router: start it "
    "with --kv-events-config (enable_kv_cache_events, publisher zmq, endpoint tcp://*:PORT) and "
    "check that the router's --kv-events-port (or the worker's events=) reaches it",
    "events_gapped": "KV event batches were lost or the publisher restarted: give the router the "
    "replay endpoint (--kv-events-replay-port) and check the network to the engine",
    "no_kv_events": "routing falls back to the approximate prefix tree: start the engines with "
    "--kv-events-config and give the router --kv-events-port (and --tokenizer or --render-url)",
    "no_token_ids": "precise routing needs the prompts' token ids: give the router the engine's "
    "tokenizer (--tokenizer) or its render endpoint (--render-url)",
    "cached_tokens_unreported": "the prefill's answer reports no cached tokens, so predictions "
    "are checked only against the engine's counters, not request by request: start vLLM with "
    "--enable-prompt-tokens-details, SGLang with --enable-cache-report",
    "prompts_shorter_than_a_block": "most prompts are shorter than one KV block: nothing of them "
    "can be cached or predicted (a smaller engine block size caches them)",
    "decode_recomputed": "the decode computed the prompt itself: the KV transfer did nothing; "
    "check the KV connector on both engines and the network between them "
    "(docs/operations/metrics.md, PD did not happen)",
}


@dataclass(frozen=True, slots=True)
class Finding:
    cause: str
    evidence: str
    worker: str | None = None  # the prefill (None: a pair)
    dp_rank: int | None = None
    decode: str | None = None  # decode_recomputed: the pair's decode

    def as_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "worker": self.worker,
            "dp_rank": self.dp_rank,
            "decode": self.decode,
            "evidence": self.evidence,
            "remedy": CAUSES[self.cause],
        }


def diagnose(states: RoutingStates, pairs: PairLedger) -> list[Finding]:
    """Every finding now, ranks first (in evaluation order), then the suspect pairs."""
    found: list[Finding] = []
    for location, judged in states.ranks.items():
        found += [
            Finding(cause, evidence, judged.worker, judged.dp_rank)
            for cause, evidence in _rank_causes(states, location, judged)
        ]
    for pair in pairs.suspects():
        evidence = (
            f"{pair.recomputes} of {pair.requests} requests' decode computed the prompt itself"
        )
        found.append(
            Finding("decode_recomputed", evidence, pair.prefill_url, None, pair.decode_url)
        )
    return found


def _rank_causes(
    states: RoutingStates, location: tuple[str, int], judged: RankState
) -> list[tuple[str, str]]:
    inputs, settings = states.inputs, states.settings
    if not inputs.predicts:
        return []  # load-only routing is a choice, not a fault
    causes: list[tuple[str, str]] = []
    if not inputs.tokenizes:
        causes.append(("no_token_ids", judged.reason))
    stats = inputs.feed.evidence(location)
    if stats is None or stats.last_batch_at is None:
        causes.append(_silent_or_missing(states, location, stats is not None))
    else:
        causes += _feed_causes(judged)
    causes += _block_size_causes(states, location)
    summary = judged.agreement
    if summary is not None and summary.requests >= settings.agreement_min_requests:
        causes += _window_causes(summary, states, stats is not None)
        if summary.reported == 0:
            causes += _counter_causes(summary, states, location)
    return causes


def _block_size_causes(states: RoutingStates, location: tuple[str, int]) -> list[tuple[str, str]]:
    """The block size the rank's events report and the one its engine's metrics report
    (``vllm:cache_config_info``), against the configured one, and against each other."""
    events = states.inputs.index.block_size_of(location)
    cache = states.engine_cache(location)
    engine = None if cache is None else cache.block_size
    expected = states.settings.engine_block_size
    sources = (("the KV events report blocks of", events), ("vllm:cache_config_info says", engine))
    if expected is not None:
        told = [
            f"{source} {size} tokens" for source, size in sources if size not in (None, expected)
        ]
        if told:
            return [
                ("block_size_mismatch", f"{'; '.join(told)}; --engine-block-size is {expected}")
            ]
        return []
    if events is not None and engine is not None and events != engine:
        told = [f"{source} {size} tokens" for source, size in sources]
        return [("block_size_mismatch", "; ".join(told))]
    return []


def _counter_causes(
    summary: AgreementSummary, states: RoutingStates, location: tuple[str, int]
) -> list[tuple[str, str]]:
    """An engine that reports no cached tokens per request: its own counters' hit rate over
    the last load polls against the predicted one over the window."""
    cache = states.engine_cache(location)
    measured = None if cache is None else cache.hit_rate()
    if measured is None or not summary.prompt_all:
        return []
    rate, looked_up = measured
    predicted = summary.predicted_all / summary.prompt_all
    if rate * 2 < predicted and predicted - rate > states.settings.agreement_tolerance:
        return [
            ("hits_below_prediction",
             f"the router predicted {predicted:.1%} of the prompt tokens cached over the last "
             f"{summary.requests} requests; the engine's own counters say {rate:.1%} of "
             f"{looked_up:.0f} tokens looked up")
        ]  # fmt: skip
    return []


def _silent_or_missing(
    states: RoutingStates, location: tuple[str, int], followed: bool
) -> tuple[str, str]:
    agreement = states.inputs.board.get(location)
    hits = 0 if agreement is None else agreement.cached_tokens
    if followed and hits > 0:
        return (
            "events_silent",
            f"no KV event ever arrived, yet the engine reported {hits} cached prompt tokens",
        )
    if followed and states.computed_at(location) is not None:
        return (
            "events_silent",
            "no KV event ever arrived, yet the engine's counters say it computed prompt tokens",
        )
    if followed:
        return "no_kv_events", "the KV event stream is followed but no event arrived yet"
    return "no_kv_events", "no KV event stream for this rank"


def _feed_causes(judged: RankState) -> list[tuple[str, str]]:
    if judged.reason.startswith(SILENT):
        return [("events_silent", judged.reason)]
    if judged.reason.startswith(GAPPED):
        return [("events_gapped", judged.reason)]
    return []


def _window_causes(
    summary: AgreementSummary, states: RoutingStates, followed: bool
) -> list[tuple[str, str]]:
    settings = states.settings
    causes: list[tuple[str, str]] = []
    if summary.reported == 0:
        causes.append(
            ("cached_tokens_unreported",
             f"none of the last {summary.requests} prefill answers reported cached tokens")
        )  # fmt: skip
    plain = summary.compared - summary.compared_chat
    plain_off = summary.miscounted - summary.miscounted_chat
    if plain and plain_off * 2 > plain:
        causes.append(
            ("tokenization_mismatch",
             f"the router's token count differs from the engine's usage.prompt_tokens for "
             f"{plain_off} of {plain} completions prompts")
        )  # fmt: skip
    elif summary.compared_chat and summary.miscounted_chat * 2 > summary.compared_chat:
        causes.append(
            ("chat_template_mismatch",
             f"the router's token count differs from the engine's for "
             f"{summary.miscounted_chat} of {summary.compared_chat} chat prompts"
             + (f", not for its {plain} completions prompts" if plain else ""))
        )  # fmt: skip
    causes += _hit_causes(summary, settings.agreement_tolerance, followed)
    if summary.short * 2 > summary.requests:
        causes.append(
            ("prompts_shorter_than_a_block",
             f"{summary.short} of the last {summary.requests} prompts are shorter than one block")
        )  # fmt: skip
    return causes


def _hit_causes(
    summary: AgreementSummary, tolerance: float, followed: bool
) -> list[tuple[str, str]]:
    error = summary.error_ratio
    if error is None or error <= tolerance or not followed:
        return []
    told = (
        f"over the last {summary.reported} requests the router predicted "
        f"{summary.predicted_tokens} cached prompt tokens, the engine reported "
        f"{summary.cached_tokens} (of {summary.prompt_tokens})"
    )
    if summary.cached_tokens * 2 < summary.predicted_tokens:
        return [("hits_below_prediction", f"KV events arrive, yet {told}")]
    if summary.predicted_tokens * 2 < summary.cached_tokens:
        return [("hits_above_prediction", told)]
    return []


def report(states: RoutingStates, pairs: PairLedger) -> dict[str, Any]:
    """``GET /admin/diagnosis``: each pool's and rank's state (with the rank's agreement) and
    every finding with its evidence and remedy."""
    ranks = []
    for location, judged in states.ranks.items():
        row = judged.as_dict()
        row["agreement"] = None if judged.agreement is None else judged.agreement.as_dict()
        cache = states.engine_cache(location)
        measured = None if cache is None else cache.hit_rate()
        # the engine's own prefix-cache counters over the last load polls (None: not read)
        row["engine_hit_rate"] = None if measured is None else round(measured[0], 4)
        ranks.append(row)
    findings = diagnose(states, pairs)
    return {
        "generated_at": time.time(),
        "pools": states.describe()["pools"],
        "ranks": ranks,
        "findings": [finding.as_dict() for finding in findings],
    }
