"""What precise cache-aware routing pays to tokenize a request, in process, through the router's
own token source (``router.scheduling.tokenizers.LocalTokenizer.tokens``).

    python -m bench.routing.tokenize_cost [--tokenizer DIR] [--prompt-tokens 2000]
        [--seen-tokens 1500] [--requests 200] [--groups 8] [--no-cache] [--check] [--json PATH]

Three rows, each on a fresh tokenizer (empty piece cache), ``--requests`` timed requests each:

* ``completions, prefix seen``: ``--groups`` prefixes of ``--seen-tokens`` tokens, each sent
  once untimed; then every timed prompt is one of them plus a fresh tail up to
  ``--prompt-tokens`` (the shared-prefix workload: a long preamble, a new question);
* ``completions, cold``: every prompt new, ``--prompt-tokens`` long;
* ``chat, prefix seen``: the seen prefix as a system message, the tail as the user's (the chat
  path cuts at the template's added tokens too).

Per row: wall time p50 / p99 of ``await tokens(request)`` (ms; encodes over
``INLINE_ENCODE_CHARS`` uncached characters go to a worker thread, as in the router), CPU per
request (process CPU time, worker threads included) and the piece cache's hit ratio.
``--no-cache`` cuts at added tokens only, as the router did before completions prompts were cut
into chunks (a completions prompt is then encoded whole). The tokenizer is the test one
(``testkit.tokenizer_dir``, the routing workload's) unless ``--tokenizer`` names another.
Target (PASS/FAIL): ``completions, prefix seen`` p50 <= 1 ms; ``--check`` makes a FAIL exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from bench.common.cli import write_json
from bench.common.stats import percentiles
from bench.common.table import text_table
from bench.routing.traces import sample_text
from router.scheduling.prompt_pieces import CHUNK_CHARS
from router.scheduling.tokenizers import LocalTokenizer
from router.schemas import Endpoint, ParsedRequest, parse_request
from testkit.tokenizer_dir import build_tokenizer_dir

__all__ = ["CostConfig", "Row", "main", "measure", "render"]

TARGET_SEEN_P50_MS = 1.0
_NO_CHUNKS = sys.maxsize  # chunk_chars: no text is long enough to be cut


@dataclass(frozen=True, slots=True)
class CostConfig:
    """One run's sizes (tokens under the measured tokenizer)."""

    prompt_tokens: int = 2000
    seen_tokens: int = 1500
    requests: int = 200
    groups: int = 8
    cache: bool = True
    seed: int = 0


_DEFAULTS = CostConfig()


class Row(msgspec.Struct, frozen=True):
    """One request shape's figures."""

    name: str
    prompt_tokens: float  # mean over the timed requests
    p50_ms: float
    p99_ms: float
    cpu_ms: float  # per request
    hit_ratio: float


@dataclass(frozen=True, slots=True)
class _Shape:
    name: str
    endpoint: Endpoint
    seen: bool


_SHAPES = (
    _Shape("completions, prefix seen", Endpoint.COMPLETIONS, seen=True),
    _Shape("completions, cold", Endpoint.COMPLETIONS, seen=False),
    _Shape("chat, prefix seen", Endpoint.CHAT, seen=True),
)


def chars_per_token(tokenizer: LocalTokenizer) -> float:
    """Characters per token of the trace text under ``tokenizer``."""
    text = sample_text(random.Random("calibrate"), 4000, 4.0)
    return len(text) / max(1, len(tokenizer.encode(text, add_special_tokens=False)))


def _request(endpoint: Endpoint, prefix: str, tail: str) -> ParsedRequest:
    if endpoint is Endpoint.CHAT:
        messages = [{"role": "system", "content": prefix}, {"role": "user", "content": tail}]
        body: dict[str, object] = {"model": "m", "messages": messages}
    else:
        body = {"model": "m", "prompt": f"{prefix} {tail}"}
    return parse_request(endpoint, msgspec.json.encode(body))


async def _row(shape: _Shape, tokenizer_dir: Path, config: CostConfig) -> Row:
    chunk_chars = CHUNK_CHARS if config.cache else _NO_CHUNKS
    tokenizer = LocalTokenizer.from_dir(tokenizer_dir, chunk_chars=chunk_chars)
    cpt = chars_per_token(tokenizer)
    rng = random.Random(f"tokenize_cost:{config.seed}:{shape.name}")
    tail_tokens = max(1, config.prompt_tokens - config.seen_tokens)
    prefixes = [sample_text(rng, config.seen_tokens, cpt) for _ in range(config.groups)]
    for prefix in prefixes if shape.seen else ():
        await tokenizer.tokens(_request(shape.endpoint, prefix, "warm up"))
    hits, misses = tokenizer.cache.hits, tokenizer.cache.misses
    walls: list[float] = []
    sizes: list[int] = []
    cpu = 0.0
    for _ in range(config.requests):
        prefix = rng.choice(prefixes) if shape.seen else sample_text(rng, config.seen_tokens, cpt)
        request = _request(shape.endpoint, prefix, sample_text(rng, tail_tokens, cpt))
        cpu_began, began = time.process_time(), time.perf_counter()
        ids = await tokenizer.tokens(request)
        walls.append(time.perf_counter() - began)
        cpu += time.process_time() - cpu_began
        sizes.append(len(ids or ()))
    looked = tokenizer.cache.hits - hits + tokenizer.cache.misses - misses
    spread = percentiles(walls)
    return Row(
        name=shape.name,
        prompt_tokens=sum(sizes) / len(sizes),
        p50_ms=spread.p50,
        p99_ms=spread.p99,
        cpu_ms=1000.0 * cpu / config.requests,
        hit_ratio=(tokenizer.cache.hits - hits) / looked if looked else 0.0,
    )


def measure(tokenizer_dir: Path, config: CostConfig) -> list[Row]:
    """Every row of the table, measured in turn."""
    return [asyncio.run(_row(shape, tokenizer_dir, config)) for shape in _SHAPES]


def verdicts(rows: Sequence[Row]) -> list[tuple[str, bool]]:
    """Each target with whether it was met."""
    seen = next(row for row in rows if row.name == _SHAPES[0].name)
    label = f"completions, prefix seen: tokenize p50 <= {TARGET_SEEN_P50_MS:g} ms"
    return [(f"{label} ({seen.p50_ms:.2f} ms)", seen.p50_ms <= TARGET_SEEN_P50_MS)]


def render(rows: Sequence[Row], config: CostConfig) -> str:
    """The table, a line of what was run, and the verdicts."""
    header = ["request", "tokens", "p50 ms", "p99 ms", "CPU ms/req", "cache hit %"]
    body = [
        [r.name, f"{r.prompt_tokens:.0f}", f"{r.p50_ms:.3f}", f"{r.p99_ms:.3f}"]
        + [f"{r.cpu_ms:.3f}", f"{100 * r.hit_ratio:.0f}"]
        for r in rows
    ]
    mode = "chunked piece cache" if config.cache else "--no-cache: cut at added tokens only"
    lines = [
        f"tokenize_cost: {mode}; {config.requests} requests per row, {config.groups} prefixes "
        f"of ~{config.seen_tokens} tokens seen before, prompts ~{config.prompt_tokens} tokens",
        "",
        *text_table([header, *body], left=1),
        "",
    ]
    lines += [f"{'PASS' if ok else 'FAIL'}  {label}" for label, ok in verdicts(rows)]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench.routing.tokenize_cost",
        description="Tokenize cost per request for precise cache-aware routing, in process.",
    )
    parser.add_argument("--tokenizer", type=Path, help="a Hugging Face tokenizer directory")
    parser.add_argument("--prompt-tokens", type=int, default=_DEFAULTS.prompt_tokens)
    parser.add_argument("--seen-tokens", type=int, default=_DEFAULTS.seen_tokens)
    parser.add_argument("--requests", type=int, default=_DEFAULTS.requests)
    parser.add_argument("--groups", type=int, default=_DEFAULTS.groups)
    parser.add_argument("--seed", type=int, default=_DEFAULTS.seed)
    parser.add_argument(
        "--no-cache", action="store_true", help="cut at added tokens only (the router before)"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when a target fails")
    parser.add_argument("--json", type=Path, help="also write the rows here as JSON")
    args = parser.parse_args(argv)
    if min(args.prompt_tokens, args.seen_tokens, args.requests, args.groups) < 1:
        parser.error("sizes and counts must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    config = CostConfig(
        prompt_tokens=args.prompt_tokens,
        seen_tokens=min(args.seen_tokens, args.prompt_tokens),
        requests=args.requests,
        groups=args.groups,
        cache=not args.no_cache,
        seed=args.seed,
    )
    with tempfile.TemporaryDirectory(prefix="tokenize-cost-") as scratch:
        tokenizer_dir = args.tokenizer or build_tokenizer_dir(Path(scratch) / "tokenizer")
        rows = measure(tokenizer_dir, config)
    print(render(rows, config))
    if args.json is not None:
        write_json({"config": config, "tokenizer": args.tokenizer, "rows": rows}, args.json)
    failed = not all(ok for _, ok in verdicts(rows))
    return 1 if failed and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
