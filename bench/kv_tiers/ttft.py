"""Part 1 of ``bench.kv_tiers``: TTFT of a long repeated prefix served from L1, L2, L3 and
recomputed, through ``pd-cluster`` (1 prefill, 1 decode, the router), each row confirmed by the
prefill's own tier hit counters.

Every repeat takes a fresh prefix (``prefix_tokens`` ASCII characters: one token each with the
worker's byte tokenizer) and asks, each time with a new ``suffix_tokens`` tail (the question
after a shared system prompt), streaming, one request at a time:

1. ``recompute``: the first ask (the prefix is in no tier);
2. ``L1``: at once again (its pages are in the device pool);
3. fillers (other prompts of the same length) until the device pool has evicted the prefix,
   not enough to push it out of the host pool; ``L2``: ask again (loaded L2 -> L1);
4. fillers until the host pool has evicted it too (the file store keeps it); ``L3``: ask
   again (prefetched L3 -> L2 -> L1; ``wait_complete``, so the whole prefix comes from L3).

Before each ask the benchmark waits until the prefill's backups stop landing (the L3 writer
runs behind), then reads the prefill's ``/metrics`` before and after: a row's sample counts as
served from its tier when that tier's hit tokens are at least 90% of the prefix's full pages and
every other tier's at most 10% (recompute: no tier hit at all). Two clusters, up at the same
time, their repeats alternating: layer-by-layer loading on (the worker's default) and off
(``--no-hicache-layerwise``), a block of rows each. A cluster's TTFTs drift with the load on
the machine (and from one cluster process to another) by more than a tier costs, so each row
also shows its median over the same repeat's L1 ask: compare layerwise on and off there.
"""

from __future__ import annotations

import contextlib
import math
import random
import string
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from bench.common.cluster import Cluster, started_cluster
from bench.common.process import BenchError, free_port
from bench.kv_tiers.common import (
    CPU_PINNED,
    DISK,
    GPU,
    TIERS,
    TierCounters,
    TierShape,
    cluster_command,
    hicache_flags,
    scrape,
    settle,
)
from bench.kv_tiers.rows import RECOMPUTE, ROWS, TierRow, TierSample, confirm, tier_weights
from bench.load.cluster_ttft import RequestFailed, one_request

__all__ = [
    "ROWS",
    "TierRow",
    "TierSample",
    "TierTTFTConfig",
    "TierTTFTResult",
    "confirm",
    "run_tier_ttft",
    "sizes",
    "tier_weights",
]


@dataclass(frozen=True)
class TierTTFTConfig:
    shape: TierShape = field(default_factory=TierShape)
    prefix_tokens: int = 4096
    suffix_tokens: int = 64
    repeats: int = 5
    max_tokens: int = 4
    deadline_s: float = 480.0  # no repeat starts after it (one always runs)
    request_timeout_s: float = 60.0
    ready_timeout_s: float = 60.0
    seed: int = 0


@dataclass(frozen=True)
class Sizes:
    prompt_pages: int  # one prompt (prefix + suffix)
    l1_pages: int
    l2_pages: int
    l3_pages: int
    l1_fillers: int  # prompts that push the prefix out of L1 (not L2)
    l2_fillers: int  # prompts that push it out of L1 and L2 (not L3)


def sizes(cfg: TierTTFTConfig) -> Sizes:
    """Pools sized so that the fillers evict exactly as planned (module docstring)."""
    page = cfg.shape.page_size
    p = math.ceil((cfg.prefix_tokens + cfg.suffix_tokens) / page) + 1
    l1 = p + p // 4
    l1_fillers = math.ceil(1.1 * l1 / p)
    l2 = (1 + l1_fillers) * p + p // 4
    l2_fillers = math.ceil(1.1 * l2 / p)
    l3 = math.ceil((2 + l1_fillers + l2_fillers) * p * 1.25)
    return Sizes(p, l1, l2, l3, l1_fillers, l2_fillers)


@dataclass(frozen=True)
class TierTTFTResult:
    config: TierTTFTConfig
    sizes: Sizes
    rows: tuple[TierRow, ...]
    weights: dict[str, float] | None  # CPU_PINNED / DISK, from the layerwise-on rows
    wall_s: float
    failures: tuple[str, ...] = ()  # a cluster that did not start or died


# --- one cluster -------------------------------------------------------------------------------


class _Asker:
    """Sends prompts through the router and reads the prefill's counters around each ask."""

    def __init__(
        self,
        cfg: TierTTFTConfig,
        cluster: Cluster,
        client: httpx.Client,
        errors: dict[str, list[str]],
    ) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.client = client
        self.prefills = [url for url, _port in cluster.prefills]
        page = cfg.shape.page_size
        self.expected = (cfg.prefix_tokens // page) * page  # the prefix's full pages
        self.errors = errors

    def send(self, prompt: str) -> float:
        if self.cluster.child.exit_code is not None:
            raise BenchError(self.cluster.child.describe("exited during the benchmark"))
        sample = one_request(
            self.client, self.cluster.url, self.cluster.model, prompt, self.cfg.max_tokens
        )
        return sample.ttft_s

    def ask(self, tier: str, prompt: str) -> TierSample | None:
        before = settle(self.client, self.prefills)
        try:
            ttft = self.send(prompt)
        except (RequestFailed, httpx.HTTPError, ValueError) as exc:
            self.errors.setdefault(tier, []).append(f"{type(exc).__name__}: {exc}")
            return None
        delta: TierCounters = scrape(self.client, self.prefills) - before
        hits = {t: delta.hit(t) for t in TIERS}
        return TierSample(
            ttft, hits, delta.load_pages, delta.prefetch_pages, confirm(tier, hits, self.expected)
        )


def _text(rng: random.Random, tokens: int) -> str:
    return "".join(rng.choices(string.ascii_lowercase + " ", k=tokens))


def _repeat(asker: _Asker, rng: random.Random, size: Sizes) -> dict[str, TierSample | None]:
    cfg = asker.cfg
    prefix = _text(rng, cfg.prefix_tokens)

    def prompt() -> str:
        return prefix + _text(rng, cfg.suffix_tokens)

    def fill(count: int) -> None:
        for _ in range(count):
            asker.send(_text(rng, cfg.prefix_tokens + cfg.suffix_tokens))

    got = {RECOMPUTE: asker.ask(RECOMPUTE, prompt()), GPU: asker.ask(GPU, prompt())}
    fill(size.l1_fillers)
    got[CPU_PINNED] = asker.ask(CPU_PINNED, prompt())
    fill(size.l2_fillers)
    got[DISK] = asker.ask(DISK, prompt())
    l1 = got[GPU]
    if l1 is None:
        return got
    return {
        tier: None if sample is None else replace(sample, over_l1_s=sample.ttft_s - l1.ttft_s)
        for tier, sample in got.items()
    }


def _worker_flags(cfg: TierTTFTConfig, size: Sizes, layerwise: bool) -> list[str]:
    tiers = hicache_flags(
        size.l2_pages,
        storage_pages=size.l3_pages,
        prefetch_policy="wait_complete",
        layerwise=layerwise,
    )
    return [*cfg.shape.flags(size.l1_pages), "--max-prompt-tokens", "16384", *tiers]


def _argv(cfg: TierTTFTConfig, size: Sizes, layerwise: bool, root: Path) -> list[str]:
    return cluster_command(
        prefills=1,
        decodes=1,
        port=free_port(),
        ready_timeout_s=cfg.ready_timeout_s,
        worker_flags=_worker_flags(cfg, size, layerwise),
        storage_dir=root,
    )


_Samples = dict[tuple[str, bool], list[TierSample]]


def _measure(
    cfg: TierTTFTConfig, size: Sizes, samples: _Samples, errors: dict[str, list[str]]
) -> None:
    """Both clusters side by side, their repeats alternating (so load on the machine that
    drifts over the run weighs on both alike); fills ``samples`` and ``errors``."""
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=5.0)
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(timeout=timeout))
        askers: dict[bool, _Asker] = {}
        for layerwise in (True, False):
            root = stack.enter_context(tempfile.TemporaryDirectory(prefix="kv-tiers-l3-"))
            argv = _argv(cfg, size, layerwise, Path(root))
            cluster = stack.enter_context(
                started_cluster(argv, cfg.ready_timeout_s, every_worker=True)
            )
            askers[layerwise] = _Asker(cfg, cluster, client, errors)
        rngs = {lw: random.Random(f"kv_tiers:{cfg.seed}:{lw}") for lw in askers}
        deadline = time.monotonic() + cfg.deadline_s
        for index in range(cfg.repeats):
            if index and time.monotonic() > deadline:
                break
            for layerwise, asker in askers.items():
                try:
                    got = _repeat(asker, rngs[layerwise], size)
                except (RequestFailed, httpx.HTTPError, ValueError) as exc:  # a filler failed
                    errors.setdefault("filler", []).append(f"{type(exc).__name__}: {exc}")
                    continue
                for tier, sample in got.items():
                    if sample is not None:
                        samples.setdefault((tier, layerwise), []).append(sample)


def _rows(samples: _Samples, errors: dict[str, list[str]]) -> list[TierRow]:
    fillers = tuple(errors.get("filler", ()))
    return [
        TierRow(
            label,
            tier,
            layerwise,
            tuple(samples.get((tier, layerwise), ())),
            tuple(errors.get(tier, ())) + fillers,
        )
        for label, tier, layerwise in ROWS
    ]


def run_tier_ttft(cfg: TierTTFTConfig) -> TierTTFTResult:
    """Both clusters (layer-by-layer loading on, off); a cluster that fails is reported, with
    whatever was measured before."""
    started_at = time.monotonic()
    size = sizes(cfg)
    samples: _Samples = {}
    errors: dict[str, list[str]] = {}
    failures: list[str] = []
    try:
        _measure(cfg, size, samples, errors)
    except BenchError as exc:
        failures.append(str(exc))
    rows = _rows(samples, errors)
    return TierTTFTResult(
        cfg, size, tuple(rows), tier_weights(rows), time.monotonic() - started_at, tuple(failures)
    )
