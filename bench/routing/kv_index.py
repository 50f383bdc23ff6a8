"""Micro-benchmark of the router's KV block index (``router/kv_cache/index.py``) against its
targets.

    python -m bench.routing.kv_index [--blocks 1000000] [--locations 8] [--prompts 2000] [--check]

1. fill: unique 2048-token prompts (block size 16: 128 blocks each), one location per prompt in
   turn, each prompt stored as engines report it (``BlockStored`` events of ``--event-blocks``
   blocks chained by ``parent_block_hash``, random 64-bit engine hashes). Reports the
   ``apply_stored`` throughput and the memory per indexed block measured with ``tracemalloc``
   over a second, traced fill (engine-hash maps included).
2. per prompt, with ``--blocks`` indexed: ``chain_keys`` for a 2048-token prompt, then ``match``
   for a stored prompt (hit) and a fresh one (miss), p50 / p99 each, plus the sum of both.
3. churn: another 10% of blocks stored past the cap, so eviction runs; throughput and the
   entry count after it.

Targets (PASS/FAIL): <= 200 bytes per block; chain_keys + match p99 <= 200 us (hit and miss).
With ``--check`` the exit status is 1 when a target fails. Runs in about 30-60 s at 1M blocks.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import time
import tracemalloc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from bench.common.stats import nearest_rank
from router.kv_cache.index import KVBlockIndex
from router.kv_cache.keys import chain_keys
from router.kv_cache.slots import Location

__all__ = ["BenchConfig", "Results", "main", "run_bench"]

BLOCK_SIZE = 16
PROMPT_TOKENS = 2048
MAX_BYTES_PER_BLOCK = 200.0
MAX_MATCH_P99_US = 200.0
_VOCAB_STRIDE = PROMPT_TOKENS  # prompt i uses token ids [i * stride, (i + 1) * stride)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Sizes of one run."""

    blocks: int = 1_000_000
    locations: int = 8
    prompts: int = 2000
    event_blocks: int = 16
    seed: int = 9


@dataclass(frozen=True, slots=True)
class Results:
    """What the run measured (times in microseconds)."""

    blocks_indexed: int
    bytes_per_block: float
    store_blocks_per_s: float
    chain_us: tuple[float, float]
    hit_us: tuple[float, float]
    miss_us: tuple[float, float]
    hit_total_us: tuple[float, float]
    miss_total_us: tuple[float, float]
    hit_blocks_matched: int
    churn_blocks_per_s: float
    churn_entries: int
    churn_evicted: int

    def verdicts(self) -> list[tuple[str, bool]]:
        """Each target with whether it was met."""
        return [
            (
                f"bytes per block <= {MAX_BYTES_PER_BLOCK:.0f}",
                self.bytes_per_block <= MAX_BYTES_PER_BLOCK,
            ),
            (
                f"hit chain_keys+match p99 <= {MAX_MATCH_P99_US:.0f} us",
                self.hit_total_us[1] <= MAX_MATCH_P99_US,
            ),
            (
                f"miss chain_keys+match p99 <= {MAX_MATCH_P99_US:.0f} us",
                self.miss_total_us[1] <= MAX_MATCH_P99_US,
            ),
        ]


def _prompt(number: int) -> list[int]:
    """A prompt no other prompt shares a block with (hash mixing makes the ids' order moot)."""
    base = number * _VOCAB_STRIDE
    return list(range(base, base + PROMPT_TOKENS))


def _events(
    tokens: list[int], rng: random.Random, event_blocks: int
) -> Iterator[tuple[list[int], int | None, list[int]]]:
    """A prompt as an engine reports it: (engine hashes, parent hash, token ids) per event."""
    parent: int | None = None
    step = event_blocks * BLOCK_SIZE
    for start in range(0, len(tokens), step):
        chunk = tokens[start : start + step]
        hashes = [rng.getrandbits(64) for _ in range(len(chunk) // BLOCK_SIZE)]
        yield hashes, parent, chunk
        parent = hashes[-1]


def _fill(index: KVBlockIndex, config: BenchConfig, first: int, blocks: int) -> float:
    """Store prompts ``first``, ``first + 1``, ... (``blocks`` blocks, rounded down to whole
    prompts, at least one); return the seconds spent inside ``apply_stored``."""
    rng = random.Random(config.seed + first)
    per_prompt = PROMPT_TOKENS // BLOCK_SIZE
    spent = 0.0
    for number in range(first, first + max(1, blocks // per_prompt)):
        location: Location = (f"w{number % config.locations}", 0)
        for hashes, parent, chunk in _events(_prompt(number), rng, config.event_blocks):
            began = time.perf_counter()
            index.apply_stored(location, hashes, parent, chunk, BLOCK_SIZE)
            spent += time.perf_counter() - began
    return spent


def _traced_bytes_per_block(config: BenchConfig) -> float:
    """Memory the index holds per block after a fill, measured with tracemalloc."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = KVBlockIndex(max_blocks=config.blocks)
        _fill(index, config, 0, config.blocks)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        return held / max(1, index.stats.blocks)
    finally:
        tracemalloc.stop()


def _time_matches(
    index: KVBlockIndex, prompts: list[list[int]]
) -> tuple[list[float], list[float], int]:
    """Per prompt: chain_keys seconds, match seconds, and the best match of the last one."""
    chain_s: list[float] = []
    match_s: list[float] = []
    best = 0
    gc.collect()
    gc.disable()  # as timeit does: time the index, not the collector's pauses
    try:
        for tokens in prompts:
            began = time.perf_counter()
            keys = chain_keys(tokens, BLOCK_SIZE)
            keyed = time.perf_counter()
            found = index.match(keys, BLOCK_SIZE)
            done = time.perf_counter()
            chain_s.append(keyed - began)
            match_s.append(done - keyed)
            best = max(found.values(), default=0)
    finally:
        gc.enable()
    return chain_s, match_s, best


def _p50_p99(seconds: Sequence[float]) -> tuple[float, float]:
    return nearest_rank(seconds, 50) * 1e6, nearest_rank(seconds, 99) * 1e6


def _sum_each(a: Sequence[float], b: Sequence[float]) -> list[float]:
    return [x + y for x, y in zip(a, b, strict=True)]


def run_bench(config: BenchConfig) -> Results:
    """Run the three sections and return their figures."""
    bytes_per_block = _traced_bytes_per_block(config)
    gc.collect()
    index = KVBlockIndex(max_blocks=config.blocks)
    store_s = _fill(index, config, 0, config.blocks)
    blocks = index.stats.blocks
    stored_prompts = max(1, config.blocks // (PROMPT_TOKENS // BLOCK_SIZE))
    rng = random.Random(config.seed)
    hits = [_prompt(rng.randrange(stored_prompts)) for _ in range(config.prompts)]
    misses = [_prompt(stored_prompts * 2 + n) for n in range(config.prompts)]
    hit_chain, hit_match, hit_best = _time_matches(index, hits)
    miss_chain, miss_match, _ = _time_matches(index, misses)
    churn_before = index.stats
    churn_s = _fill(index, config, stored_prompts * 4, max(1, config.blocks // 10))
    churn = index.stats.evicted - churn_before.evicted + index.stats.blocks - churn_before.blocks
    stats = index.stats
    return Results(
        blocks_indexed=blocks,
        bytes_per_block=bytes_per_block,
        store_blocks_per_s=blocks / store_s if store_s else math.inf,
        chain_us=_p50_p99(hit_chain + miss_chain),
        hit_us=_p50_p99(hit_match),
        miss_us=_p50_p99(miss_match),
        hit_total_us=_p50_p99(_sum_each(hit_chain, hit_match)),
        miss_total_us=_p50_p99(_sum_each(miss_chain, miss_match)),
        hit_blocks_matched=hit_best,
        churn_blocks_per_s=churn / churn_s if churn_s else math.inf,
        churn_entries=stats.blocks + stats.predicted,
        churn_evicted=stats.evicted,
    )


def render(config: BenchConfig, results: Results) -> str:
    """The report printed by ``main``."""
    pair = "p50 {:,.1f} us  p99 {:,.1f} us".format
    lines = [
        f"KV block index: {config.locations} locations, block size {BLOCK_SIZE}, "
        f"{PROMPT_TOKENS}-token prompts ({PROMPT_TOKENS // BLOCK_SIZE} keys)",
        f"blocks indexed            {results.blocks_indexed:,}",
        f"bytes per block           {results.bytes_per_block:,.1f} (tracemalloc, with hash maps)",
        f"apply_stored              {results.store_blocks_per_s:,.0f} blocks/s",
        f"chain_keys per prompt     {pair(*results.chain_us)}",
        f"match, hit                {pair(*results.hit_us)}  "
        f"({results.hit_blocks_matched} blocks matched)",
        f"match, miss               {pair(*results.miss_us)}",
        f"chain_keys + match, hit   {pair(*results.hit_total_us)}",
        f"chain_keys + match, miss  {pair(*results.miss_total_us)}",
        f"apply_stored past the cap {results.churn_blocks_per_s:,.0f} blocks/s "
        f"({results.churn_evicted:,} evicted, {results.churn_entries:,} entries kept)",
    ]
    lines += [f"{'PASS' if ok else 'FAIL'}  {name}" for name, ok in results.verdicts()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags, run, print; 1 with ``--check`` when a target fails, else 0."""
    parser = argparse.ArgumentParser(
        prog="bench.routing.kv_index", description=__doc__.split("\n")[0]
    )
    defaults = BenchConfig()
    parser.add_argument("--blocks", type=int, default=defaults.blocks)
    parser.add_argument("--locations", type=int, default=defaults.locations)
    parser.add_argument("--prompts", type=int, default=defaults.prompts)
    parser.add_argument("--event-blocks", type=int, default=defaults.event_blocks)
    parser.add_argument("--check", action="store_true", help="exit 1 when a target fails")
    args = parser.parse_args(argv)
    config = BenchConfig(
        blocks=args.blocks,
        locations=args.locations,
        prompts=args.prompts,
        event_blocks=args.event_blocks,
    )
    results = run_bench(config)
    print(render(config, results))
    failed = not all(ok for _, ok in results.verdicts())
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
