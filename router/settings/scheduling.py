"""Choosing the workers: the routing policies and KV-cache-aware prefill selection."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from router.kv_tiers import DEFAULT_TIER_WEIGHTS, check_tier_weights, parse_tier_weights
from router.settings.flags import DOCUMENTED, TUNING, PositiveFloat, cli

__all__ = ["CacheAwareSettings", "PolicySettings", "SessionSettings"]


class PolicySettings(BaseModel):
    """How a prefill and a decode worker are chosen (``router.scheduling.policies``)."""

    model_config = DOCUMENTED

    policy: str = Field(
        default="round_robin", json_schema_extra=cli("--policy", choices_of="policies")
    )
    """policy for both roles: `least_load` takes the lowest engine-reported load,
    `cache_aware` the prefill holding most of the prompt's KV cache (the decode: least_load)"""
    prefill_policy: str | None = Field(
        default=None,
        json_schema_extra=cli("--prefill-policy", choices_of="policies", default="--policy"),
    )
    """policy for prefill"""
    decode_policy: str | None = Field(
        default=None,
        json_schema_extra=cli("--decode-policy", choices_of="policies", default="--policy"),
    )
    """policy for decode"""
    model_aliases: dict[str, str] = Field(
        default_factory=dict,
        json_schema_extra=cli(
            "--model-alias", metavar="ALIAS=NAME", repeat=True, adapter="name_names"
        ),
    )
    """a model name clients may send for the served model NAME (the engines get NAME)"""
    model_policies: dict[str, str] = Field(
        default_factory=dict,
        json_schema_extra=cli(
            "--model-policy", metavar="MODEL=POLICY", repeat=True, adapter="model_policies"
        ),
    )
    """the policy of MODEL's pool, as `--policy` sets it for both roles (`cache_aware`: its
    prefills by cache, its decodes by load); the other models' pools follow `--policy`,
    `--prefill-policy` and `--decode-policy`"""


class CacheAwareSettings(BaseModel):
    """KV-cache-aware prefill selection (``cache_aware``) and skipping the prefill leg."""

    model_config = DOCUMENTED

    tokenizer: str | None = Field(default=None, json_schema_extra=cli("--tokenizer", metavar="DIR"))
    """the engines' Hugging Face tokenizer directory (`tokenizer.json`, the chat template from
    `tokenizer_config.json`): precise `cache_aware`"""
    model_tokenizers: dict[str, str] = Field(
        default_factory=dict,
        json_schema_extra=cli(
            "--model-tokenizer", metavar="MODEL=DIR", repeat=True, adapter="name_names"
        ),
    )
    """MODEL's own tokenizer directory (as `--tokenizer`) when the workers serve several models:
    precise `cache_aware` tokenizes each request with its model's (the other models':
    `--model-render-url`, else `--tokenizer` or `--render-url`)"""
    model_render_urls: dict[str, str] = Field(
        default_factory=dict,
        json_schema_extra=cli(
            "--model-render-url", metavar="MODEL=URL", repeat=True, adapter="name_names"
        ),
    )
    """MODEL's own render API (as `--render-url`: a vLLM engine or render server serving MODEL)
    when the workers serve several models; `--model-tokenizer` goes first"""
    render_url: str | None = Field(
        default=None, json_schema_extra=cli("--render-url", metavar="URL")
    )
    """tokenize with this vLLM engine's (or render server's) `POST /v1/.../render` instead of
    `--tokenizer` (5 s timeout, then approximate)"""
    kv_events_port: int | None = Field(
        default=None, ge=1, le=65535, json_schema_extra=cli("--kv-events-port")
    )
    """KV event port of every prefill (on its URL's host; DP rank r at port + r)"""
    kv_events_replay_port: int | None = Field(
        default=None, ge=1, le=65535, json_schema_extra=cli("--kv-events-replay-port")
    )
    """KV event replay port of every prefill"""
    max_indexed_blocks: int = Field(
        default=4_000_000, gt=0, json_schema_extra=cli("--max-indexed-blocks")
    )
    """cap on the KV blocks indexed, all workers together"""
    prediction_ttl_s: PositiveFloat = Field(default=2.0, json_schema_extra=cli("--prediction-ttl"))
    """seconds the entries a routing decision predicts live unless the engine's events
    confirm them"""
    share_predictions: bool = Field(default=False, json_schema_extra=TUNING)
    """each process also applies the entries its siblings (`--workers N`) and its replica
    peers (`--replica-listen`) predict (off by default: measured worse on the shared-prefix
    workload, docs/operations/processes.md)"""
    # SMG's cache_threshold
    cache_threshold: float = Field(
        default=0.3, ge=0.0, le=1.0, json_schema_extra=cli("--cache-threshold")
    )
    """a cached prefix counts only when it covers at least this share of the prompt (a shared
    template header alone must not pull every request along); below it the rank with the
    least queued prefill work wins"""
    # defaults measured by bench/kv_tiers/main.py; the env takes JSON ({"DISK": 0.7})
    tier_weights: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS),
        json_schema_extra=cli("--cache-tier-weights", metavar="TIER=WEIGHT,..."),
    )
    """tiered KV caches: what a cached block only in host memory (`CPU_PINNED`, or vLLM's
    `CPU`) or on `DISK` counts for in `cache_aware`, a GPU block being 1; each 0..1, a tier not
    given keeps its default"""
    balance_abs_threshold: float = Field(
        default=32.0, ge=0, json_schema_extra=cli("--balance-abs-threshold")
    )
    """`cache_aware`: load wins over the cache when max - min load exceeds this ..."""
    balance_rel_threshold: float = Field(
        default=1.5, ge=1.0, json_schema_extra=cli("--balance-rel-threshold")
    )
    """... and the max load exceeds this times the min"""
    approx_tree_max_chars: int = Field(
        default=16 * 1024 * 1024, gt=0, json_schema_extra=cli("--approx-tree-max-chars")
    )
    """approximate `cache_aware` (no tokenizer): prefix tree size cap per worker, chars"""
    tokenize_cache_entries: int = Field(
        default=8192, ge=0, json_schema_extra=cli("--tokenize-cache-entries")
    )
    """cached tokenized prompt segments"""
    pd_min_uncached_tokens: int = Field(
        default=0, ge=0, json_schema_extra=cli("--pd-min-uncached-tokens")
    )
    """vLLM protocols: a request with fewer predicted uncached prompt tokens skips the prefill
    leg (the decode prefills it; 0: never)"""
    prefill_saturated_waiting: int | None = Field(
        default=None, ge=1, json_schema_extra=cli("--prefill-saturated-waiting")
    )
    """vLLM protocols: when every prefill reports this many waiting requests, the decode
    prefills locally (none: never for load)"""

    @field_validator("tier_weights", mode="before")
    @classmethod
    def _parse_tier_weights(cls, value: object) -> object:
        return parse_tier_weights(value) if isinstance(value, str) else value

    @field_validator("tier_weights")
    @classmethod
    def _check_tier_weights(cls, value: dict[str, float]) -> dict[str, float]:
        return check_tier_weights(value)


class SessionSettings(BaseModel):
    """Session affinity (``router.scheduling.session_affinity``): a session key header pins a
    session to its prefill DP rank and decode for a while, so that a conversation's turns find
    their KV cache where the last turn left it."""

    model_config = DOCUMENTED

    header: str = Field(default="X-Session-Id", json_schema_extra=cli("--session-header"))
    """the request header holding the session key (empty: no session affinity)"""
    mode: Literal["soft", "hard"] = Field(
        default="soft", json_schema_extra=cli("--session-affinity")
    )
    """`soft`: a pin yields (and the session re-pins) when its worker is unhealthy, its breaker
    open, draining, at its cap or over `--session-load-bound`; `hard`: the request is answered
    503 instead (a request asks for it with `X-Session-Affinity: hard`)"""
    ttl_s: PositiveFloat = Field(default=600.0, json_schema_extra=cli("--session-ttl"))
    """seconds a pin lives after the session's last request"""
    max_entries: int = Field(default=100_000, gt=0, json_schema_extra=cli("--session-max-entries"))
    """pins kept at most (the least recently used goes first)"""
    max_key_bytes: int = Field(default=256, gt=0, json_schema_extra=TUNING)
    """a longer session key (or one not printable ASCII) is answered 400"""
    load_bound: float = Field(default=2.0, ge=0.0, json_schema_extra=cli("--session-load-bound"))
    """soft pins: a pinned worker yields when its load score exceeds this times the least
    loaded candidate's plus one (0: load never moves a session)"""

    @field_validator("load_bound")
    @classmethod
    def _check_load_bound(cls, value: float) -> float:
        if 0 < value < 1:
            raise ValueError("a load bound is 0 (off) or at least 1")
        return value

    @field_validator("header")
    @classmethod
    def _check_header(cls, value: str) -> str:
        if not value.isascii() or any(c in value for c in " :\t\r\n"):
            raise ValueError(f"{value!r} is not an HTTP header name")
        return value
